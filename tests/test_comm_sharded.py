"""Owner-contiguous reduce-scatter and all-gather (dp_kfac's owner reduction).

Each rank owns a run of tensors of its own size (no padding). The reduce-scatter
leaves every owner the average of its tensors and the others' as they were; the
all-gather hands every rank's tensors to every rank (on gloo, whose
reduce-scatter sends an all-reduce's bytes and which has no all-gather of uneven
shards, both by alltoallv, whose works complete futures as a DDP communication hook
needs; a round is cut into calls that carry a piece of every shard each, and a tensor
may straddle two calls). Rounds under a
byte cap come from one pure rule, and the cost model books exactly what is handed
over, round by round.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st

import dpkfac.comm as comm_module
from dpkfac.comm import Communicator
from dpkfac.costmodel.traffic import comm_counts, sharded_collectives
from dpkfac.plan.fusion import shard_rounds

# Per rank, the element counts of the tensors it owns: uneven, one rank owning nothing.
SIZES = ([5, 1, 7], [], [3, 3], [12])


def _shards(world_size: int, rank: int, fill: bool) -> list[list[torch.Tensor]]:
    """The same layout on every rank; each rank's copy of tensor (r, i) holds 100·rank + …"""
    out = []
    for r in range(world_size):
        out.append(
            [
                torch.arange(n, dtype=torch.float64) + 100.0 * rank + 10.0 * i + r
                if fill
                else torch.full((n,), -1.0, dtype=torch.float64)
                for i, n in enumerate(SIZES[r])
            ]
        )
    return out


def _calls(world_size: int, cap: int | None) -> int:
    """The alltoallv calls gloo's rounds take (:func:`~dpkfac.comm.message_calls`)."""
    sizes = [[8 * n for n in SIZES[r]] for r in range(world_size)]
    return sum(
        comm_module.message_calls(
            "gloo", max(sum(sizes[r][i] for i in idx) for r, idx in enumerate(rnd))
        )
        for rnd in shard_rounds(sizes, cap)
    )


def _cut(message: int | None) -> None:
    """A smaller message per call (``None``: the library's), so that a round takes several."""
    if message is not None:
        comm_module.GLOO_MESSAGE_BYTES = message


def _reduce_scatter(
    rank: int, world_size: int, cap: int | None, message: int | None = None
) -> dict[str, Any]:
    _cut(message)
    comm = Communicator()
    shards = _shards(world_size, rank, fill=True)
    handle = comm.reduce_scatter_mean(shards, "grad_allreduce", cap_bytes=cap, async_op=True)
    # Each round's work completes a future (a DDP communication hook returns them).
    torch.futures.wait_all([w.get_future() for w in handle.works])
    comm.wait(handle)
    return {
        "shards": shards,
        "stats": comm.stats.as_dict(),
        "works": len(handle.works),
        "calls": _calls(world_size, cap),
    }


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize(("cap", "message"), [(None, None), (40, None), (None, 24), (40, 16)])
def test_each_owner_gets_the_average_of_its_own_tensors(
    world_size: int, cap: int | None, message: int | None
) -> None:
    results = run_ranks(_reduce_scatter, world_size, cap, message)
    mean_rank = sum(range(world_size)) / world_size
    for rank, out in enumerate(results):
        for r, tensors in enumerate(out["shards"]):
            for i, t in enumerate(tensors):
                expected = torch.arange(t.numel(), dtype=torch.float64) + 10.0 * i + r
                offset = 100.0 * (mean_rank if r == rank else rank)  # others' left as they were
                assert torch.equal(t, expected + offset), (rank, r, i)
        sizes = [[8 * n for n in SIZES[r]] for r in range(world_size)]
        predicted = comm_counts(sharded_collectives("grad_allreduce", "reduce_scatter", sizes, cap))
        assert out["stats"]["grad_allreduce"] == predicted["grad_allreduce"], rank
        # A round is one collective in the books, however many calls carry it.
        assert out["works"] == out["calls"], rank
        if message is not None:
            assert out["calls"] > len(shard_rounds([[8 * n for n in s] for s in SIZES], cap))
    if cap is not None:  # the cap splits the exchange into rounds
        assert results[0]["stats"]["grad_allreduce"]["calls"] > 1


def _all_gather(
    rank: int, world_size: int, cap: int | None, message: int | None = None
) -> dict[str, Any]:
    _cut(message)
    comm = Communicator()
    shards = _shards(world_size, rank, fill=False)
    shards[rank] = _shards(world_size, rank, fill=True)[rank]
    comm.all_gather(shards, "precond_broadcast", cap_bytes=cap)
    return {"shards": shards, "stats": comm.stats.as_dict(), "backend": comm.backend}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(("cap", "message"), [(None, None), (40, None), (None, 24)])
def test_every_rank_receives_every_owners_tensors(
    world_size: int, cap: int | None, message: int | None
) -> None:
    results = run_ranks(_all_gather, world_size, cap, message)
    for out in results:
        for r, tensors in enumerate(out["shards"]):
            for i, t in enumerate(tensors):
                expected = torch.arange(t.numel(), dtype=torch.float64) + 100.0 * r + 10.0 * i + r
                assert torch.equal(t, expected), (r, i)
        # gloo gathers uneven shards by alltoallv, each round accounted as one gather.
        assert out["backend"] == "gloo"
        sizes = [[8 * n for n in SIZES[r]] for r in range(world_size)]
        predicted = comm_counts(sharded_collectives("precond_broadcast", "all_gather", sizes, cap))
        assert out["stats"]["precond_broadcast"] == predicted["precond_broadcast"]


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(0, 500), max_size=6), min_size=1, max_size=6),
    cap=st.one_of(st.none(), st.integers(1, 2000)),
)
def test_rounds_take_every_tensor_once_in_order_within_the_cap(
    sizes: list[list[int]], cap: int | None
) -> None:
    rounds = shard_rounds(sizes, cap)
    world = len(sizes)
    for r in range(world):
        taken = [i for round_ in rounds for i in round_[r]]
        assert taken == list(range(len(sizes[r])))
    for round_ in rounds:
        assert len(round_) == world and any(round_)
        for r, idx in enumerate(round_):
            assert idx == sorted(idx)
            if cap is not None and len(idx) > 1:  # a run over the share is a single tensor
                assert sum(sizes[r][i] for i in idx) <= max(1, cap // world)
