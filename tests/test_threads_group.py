"""The in-process process group (experiments/threads.py) against dense references.

Every collective the strategies and the training loop use, at world sizes 1 to
5: all-reduce (each op), broadcast, rooted reduce, all-gather and reduce-scatter
of even and of uneven shards (NCCL's coalesced broadcasts and reduces, which
gloo cannot run), the tensor forms, gather, scatter, the object collectives,
barrier and subgroups; dpkfac's Communicator over it, uneven shards included.
Then what makes it usable as a harness: failures, deadlocks and hangs end the
run at once naming the rank, and each rank keeps its own random streams.
"""

from __future__ import annotations

import datetime
import random
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dpkfac.comm import Communicator
from experiments.distributed import DistEnv
from experiments.threads import ThreadWorld, launch, run_threads

pytestmark = pytest.mark.distributed

# Shard sizes per rank: uneven, one empty (as an owner with no layers).
UNEVEN = (5, 1, 0, 7, 3)


def _value(rank: int, n: int, salt: float = 0.0) -> torch.Tensor:
    """A float64 tensor only ``rank`` would send: exact sums, distinguishable sources."""
    return torch.arange(n, dtype=torch.float64) * 0.5 + 100.0 * rank + salt


def _all_reduce_ops(rank: int, world_size: int) -> dict[str, list[float]]:
    out = {}
    for name, op in [
        ("sum", dist.ReduceOp.SUM),
        ("avg", dist.ReduceOp.AVG),
        ("max", dist.ReduceOp.MAX),
        ("min", dist.ReduceOp.MIN),
        ("product", dist.ReduceOp.PRODUCT),
    ]:
        t = torch.tensor([rank + 1.0, -rank - 0.5], dtype=torch.float64)
        dist.all_reduce(t, op=op)
        out[name] = t.tolist()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_all_reduce_matches_the_reduction_of_every_rank(world_size: int) -> None:
    a = [r + 1.0 for r in range(world_size)]
    b = [-r - 0.5 for r in range(world_size)]
    expected = {
        "sum": [sum(a), sum(b)],
        "avg": [sum(a) / world_size, sum(b) / world_size],
        "max": [max(a), max(b)],
        "min": [min(a), min(b)],
        "product": [float(np.prod(a)), float(np.prod(b))],
    }
    for out in run_threads(_all_reduce_ops, world_size):
        assert out == expected


def _rooted(rank: int, world_size: int, root: int) -> dict[str, Any]:
    b = _value(rank, 4)
    dist.broadcast(b, src=root)
    r = _value(rank, 3)
    dist.reduce(r, dst=root)
    return {"broadcast": b, "reduce": r}


@pytest.mark.parametrize(("world_size", "root"), [(2, 1), (4, 0), (4, 3)])
def test_broadcast_and_rooted_reduce(world_size: int, root: int) -> None:
    results = run_threads(_rooted, world_size, root)
    total = sum(_value(r, 3) for r in range(world_size))
    for rank, out in enumerate(results):
        assert torch.equal(out["broadcast"], _value(root, 4))
        # NCCL's reduce leaves non-roots' buffers as they were.
        assert torch.equal(out["reduce"], total if rank == root else _value(rank, 3))


def _uneven(rank: int, world_size: int, sizes: tuple[int, ...]) -> dict[str, Any]:
    mine = _value(rank, sizes[rank])
    sent = mine.clone()
    gathered = [torch.full((n,), -1.0, dtype=torch.float64) for n in sizes[:world_size]]
    dist.all_gather(gathered, mine)
    inputs = [_value(rank, n, salt=0.25 * i) for i, n in enumerate(sizes[:world_size])]
    kept = [t.clone() for t in inputs]
    reduced = torch.full((sizes[rank],), -1.0, dtype=torch.float64)
    dist.reduce_scatter(reduced, inputs)
    return {
        "gathered": gathered,
        "reduced": reduced,
        "input_kept": torch.equal(mine, sent) and all(map(torch.equal, inputs, kept)),
    }


@pytest.mark.parametrize("world_size", [2, 3, 5])
@pytest.mark.parametrize("sizes", [UNEVEN, (4, 4, 4, 4, 4)], ids=["uneven", "even"])
def test_all_gather_and_reduce_scatter_of_shards(world_size: int, sizes: tuple[int, ...]) -> None:
    """Shards of different sizes, as dp_kfac's owner reduction hands them over (no padding)."""
    results = run_threads(_uneven, world_size, sizes)
    for rank, out in enumerate(results):
        assert out["input_kept"], "inputs are read, never written"
        for src, t in enumerate(out["gathered"]):
            assert torch.equal(t, _value(src, sizes[src])), (rank, src)
        # Dense reference: rank r's shard summed over every rank, in rank order.
        expected = _value(0, sizes[rank], salt=0.25 * rank)
        for other in range(1, world_size):
            expected = expected + _value(other, sizes[rank], salt=0.25 * rank)
        assert torch.equal(out["reduced"], expected), rank


def _tensor_forms(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    gathered = torch.empty(world_size * 3, dtype=torch.float64)
    dist.all_gather_single(gathered, _value(rank, 3))
    scattered = torch.empty(2, dtype=torch.float64)
    dist.reduce_scatter_single(scattered, _value(rank, 2 * world_size))
    return {"gathered": gathered, "scattered": scattered}


def test_all_gather_and_reduce_scatter_of_one_tensor() -> None:
    world_size = 3
    dense = torch.stack([_value(r, 2 * world_size) for r in range(world_size)]).sum(0)
    for rank, out in enumerate(run_threads(_tensor_forms, world_size)):
        assert torch.equal(out["gathered"], torch.cat([_value(r, 3) for r in range(world_size)]))
        assert torch.equal(out["scattered"], dense[2 * rank : 2 * rank + 2])


def _gather_scatter_objects(rank: int, world_size: int) -> dict[str, Any]:
    root = world_size - 1
    into = (
        [torch.zeros(2, dtype=torch.float64) for _ in range(world_size)] if rank == root else None
    )
    dist.gather(_value(rank, 2), into, dst=root)
    part = torch.zeros(2, dtype=torch.float64)
    pieces = [_value(r, 2, salt=1.0) for r in range(world_size)] if rank == 0 else None
    dist.scatter(part, pieces, src=0)
    objects: list[Any] = [None] * world_size
    dist.all_gather_object(objects, {"rank": rank, "text": "x" * rank})
    onto: list[Any] | None = [None] * world_size if rank == root else None
    dist.gather_object(("rank", rank), onto, dst=root)
    box: list[Any] = [f"from {rank}"]
    dist.broadcast_object_list(box, src=1)
    dist.barrier()
    return {"gather": into, "scatter": part, "all": objects, "onto": onto, "box": box[0]}


def test_gather_scatter_and_object_collectives() -> None:
    world_size = 4
    results = run_threads(_gather_scatter_objects, world_size)
    for rank, out in enumerate(results):
        assert torch.equal(out["scatter"], _value(rank, 2, salt=1.0))
        assert out["all"] == [{"rank": r, "text": "x" * r} for r in range(world_size)]
        assert out["box"] == "from 1"
        if rank == world_size - 1:
            assert all(torch.equal(t, _value(r, 2)) for r, t in enumerate(out["gather"]))
            assert out["onto"] == [("rank", r) for r in range(world_size)]


def _subgroups(rank: int, world_size: int) -> dict[str, Any]:
    timeout = datetime.timedelta(seconds=30)
    # Every rank takes part in making every group (use_local_synchronization=False) ...
    rows = [dist.new_group([0, 1], timeout=timeout), dist.new_group([2, 3], timeout=timeout)]
    row = rows[rank // 2]
    assert dist.get_backend(row) == "threads"
    # ... or only the members do (a column group each, made in a different order).
    col_ranks = [rank % 2, rank % 2 + 2]
    col = dist.new_group(col_ranks, timeout=timeout, use_local_synchronization=True)
    outside = rows[1 - rank // 2]
    r = torch.tensor([float(rank)])
    dist.all_reduce(r, group=row)
    c = torch.tensor([float(rank)])
    dist.all_reduce(c, group=col)
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=col_ranks[1], group=col)  # src is a global rank
    return {
        "row": r.item(),
        "col": c.item(),
        "bcast": b.item(),
        "outside": outside == dist.GroupMember.NON_GROUP_MEMBER,
        "col_rank": dist.get_rank(col),
    }


def test_subgroups_of_both_kinds_and_their_ranks() -> None:
    for rank, out in enumerate(run_threads(_subgroups, 4)):
        row = [0, 1] if rank < 2 else [2, 3]
        assert out["row"] == sum(row)
        assert out["col"] == rank % 2 + rank % 2 + 2
        assert out["bcast"] == rank % 2 + 2
        assert out["outside"] and out["col_rank"] == rank // 2


def _communicator(rank: int, world_size: int) -> dict[str, Any]:
    comm = Communicator(timeout=30)
    mean = [_value(rank, 3), _value(rank, 4).reshape(2, 2)]
    comm.allreduce_mean(mean, "grad_allreduce")
    shards = [
        [_value(r if r == rank else 50, n, salt=i) for i, n in enumerate(sizes)]
        for r, sizes in enumerate(_OWNED[:world_size])
    ]
    comm.all_gather(shards, "precond_broadcast", cap_bytes=48)
    owned = [
        [_value(rank, n, salt=i) for i, n in enumerate(sizes)] for sizes in _OWNED[:world_size]
    ]
    comm.reduce_scatter_mean(owned, "grad_allreduce")
    return {"mean": mean, "gathered": shards, "owned": owned[rank], "backend": comm.backend}


# Per owner, the sizes of its tensors (dp_kfac's owner-contiguous shards).
_OWNED = ([5, 2], [], [7], [1, 1, 4])


def test_communicator_uses_the_uneven_all_gather_and_reduce_scatter() -> None:
    """dpkfac's Communicator sees backend ``threads`` and runs the uneven path gloo cannot."""
    world_size = 4
    results = run_threads(_communicator, world_size)
    for rank, out in enumerate(results):
        assert out["backend"] == "threads"
        dense = sum(_value(r, 3) for r in range(world_size)) / world_size
        assert torch.allclose(out["mean"][0], dense, rtol=0, atol=1e-12)
        for r, tensors in enumerate(out["gathered"]):
            for i, t in enumerate(tensors):
                assert torch.equal(t, _value(r, t.numel(), salt=i)), (rank, r, i)
        for i, t in enumerate(out["owned"]):
            expected = sum(_value(r, t.numel(), salt=i) for r in range(world_size)) / world_size
            assert torch.allclose(t, expected, rtol=0, atol=1e-12), (rank, i)


# ------------------------------------------------------------------------- failures


def _mismatched_sizes(rank: int, world_size: int) -> None:
    out = [torch.zeros(2) for _ in range(world_size)]
    dist.all_gather(out, torch.zeros(3 if rank == 1 else 2))


def _rank_raises(rank: int, world_size: int) -> None:
    if rank == 2:
        raise ValueError("rank 2's own mistake")
    dist.barrier()


def _skips_barrier(rank: int, world_size: int) -> None:
    if rank == 0:
        dist.barrier()


def _different_calls(rank: int, world_size: int) -> None:
    t = torch.zeros(1)
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)


def _stalls(rank: int, world_size: int) -> None:
    if rank == 1:
        time.sleep(1.5)  # holds the turn: nobody else can make progress
    dist.barrier()


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_mismatched_sizes, "3 torch.float32 elements into a buffer of 2"),
        (_rank_raises, "rank 2's own mistake"),
        (_skips_barrier, "deadlock: rank 0 waits in barrier"),
        (_different_calls, "the ranks made different collective calls"),
    ],
)
def test_failures_end_the_run_at_once_naming_the_rank(fn: Any, message: str) -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match=message):
        run_threads(fn, 3)
    assert time.monotonic() - started < 5.0


def test_a_stalled_world_times_out_naming_the_waiting_rank() -> None:
    with pytest.raises(AssertionError, match=r"timeout: rank 0 waited .* rank 1 holds the turn"):
        run_threads(_stalls, 3, group_timeout_s=0.5)


def test_world_size_and_timeout_are_checked() -> None:
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        ThreadWorld(0)
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds, got -1"):
        ThreadWorld(2, timeout_s=-1)


def test_the_process_keeps_its_own_torch_distributed_state() -> None:
    """Thread-local group bookkeeping is installed for the run and removed after it."""
    world = dist.distributed_c10d._world
    run_threads(lambda rank, world_size: dist.barrier(), 3)
    assert dist.distributed_c10d._world is world
    assert not dist.is_initialized()


# ------------------------------------------------------------------------- random streams


def _draws(rank: int, world_size: int) -> list[float]:
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    out = []
    for _ in range(3):
        out += [random.random(), float(np.random.rand()), torch.rand(1).item()]
        dist.barrier()  # hands the turn to the others between draws
        out.append(torch.randn(2).sum().item())
    return out


def _serial_draws(rank: int) -> list[float]:
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    out = []
    for _ in range(3):
        out += [random.random(), float(np.random.rand()), torch.rand(1).item()]
        out.append(torch.randn(2).sum().item())
    return out


def test_each_rank_draws_its_own_random_streams() -> None:
    """Seeding in one rank thread never moves another's generators (python, numpy, torch)."""
    state = torch.get_rng_state()
    results = run_threads(_draws, 4)
    assert torch.equal(torch.get_rng_state(), state), "the launching thread's streams are kept"
    for rank, draws in enumerate(results):
        assert draws == _serial_draws(rank), rank


def test_ranks_start_from_the_launching_threads_streams() -> None:
    """As forked processes would: an unseeded first draw is the same on every rank."""
    torch.manual_seed(7)
    expected = torch.rand(1).item()
    torch.manual_seed(7)
    assert launch(lambda rank, world_size: torch.rand(1).item(), 3) == [expected] * 3


def _env_objects(rank: int, world_size: int) -> tuple[list[Any] | None, list[Any]]:
    env = DistEnv(rank=rank, world_size=world_size)
    return env.gather_objects({"rank": rank}, dst=1), env.all_gather_objects(rank)


def test_dist_env_gathers_objects_onto_one_rank() -> None:
    """Evaluation and checkpoints gather onto one rank (P unpicklings, not P**2)."""
    world_size = 3
    results = run_threads(_env_objects, world_size)
    for rank, (onto, everyone) in enumerate(results):
        assert onto == ([{"rank": r} for r in range(world_size)] if rank == 1 else None)
        assert everyone == list(range(world_size))


def test_the_torch_internals_seam_names_what_moved(monkeypatch: Any) -> None:
    """The private c10d names launcher=threads needs are all present in this torch, and a
    torch that moved one fails the launcher with the name (not deep in a collective)."""
    from experiments import c10d_seam

    assert c10d_seam.problems() == []
    assert torch.__version__.startswith(c10d_seam.WRITTEN_AGAINST + ".")
    # Every field of c10d's _World is made thread-local.
    assert c10d_seam._world_properties() <= {*c10d_seam.WORLD_FIELDS, "pg_config_info"}
    assert set(vars(c10d_seam.ThreadLocalWorld())) == set(c10d_seam.WORLD_FIELDS)
    monkeypatch.delattr(torch._C._distributed_c10d, "_set_thread_isolation_mode")
    with pytest.raises(RuntimeError, match="_set_thread_isolation_mode is gone"):
        run_threads(lambda rank, world_size: rank, 2)
    monkeypatch.undo()
    monkeypatch.setattr(
        dist.distributed_c10d._World, "pg_new_field", property(lambda s: 1), raising=False
    )
    with pytest.raises(RuntimeError, match=r"does not make thread-local: \['pg_new_field'\]"):
        c10d_seam.check()
