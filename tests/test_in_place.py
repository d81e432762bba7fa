"""A large tensor travels alone, in its own storage (``plan.fusion.fused_buckets``).

Gathering BERT's 23 MB word-embedding gradient into a flat buffer and copying the average
back are two passes on the step's critical path; a tensor of at least
``fusion.ALONE_BYTES`` is all-reduced (or broadcast) where it lies instead. Checked here:

* the rule: every tensor once, in order; a large one alone; the runs between them capped;
* the communicator: all-reduces, broadcasts and reduces of mixed buckets land the same
  values as before (a reduce leaves the other ranks' copies as they were), one collective
  per bucket of the rule;
* a training step: dp_kfac (overlapped owner reduction, and the ordinary step) writes
  bitwise the gradients it wrote with every tensor packed, and hands over exactly the
  bytes and calls the cost model prices, with the tensor alone.

The threshold is lowered here (``monkeypatch``, inherited by the forked ranks) so that the
tests' tiny models have tensors above it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from hypothesis import given
from hypothesis import strategies as st
from strategy_cases import embed_batch, embed_net, make_preconditioner

from dpkfac.comm import Communicator, bucket_plan, in_place
from dpkfac.costmodel import PRESETS, predict, shapes_from_model
from dpkfac.costmodel.traffic import fused_collectives
from dpkfac.options import KFACOptions
from dpkfac.plan import fusion
from dpkfac.plan.fusion import ALONE_BYTES, fused_buckets, size_cap_buckets, travels_alone

#: The threshold the distributed tests run with: EmbedNet's table (256 KB) is above it.
LOW = 64 * 1024


@given(
    sizes=st.lists(st.integers(0, 3 * ALONE_BYTES), max_size=12),
    cap=st.none() | st.integers(1, 2 * ALONE_BYTES),
)
def test_fused_buckets_keep_order_and_put_every_large_tensor_alone(
    sizes: list[int], cap: int | None
) -> None:
    buckets = fused_buckets(sizes, cap)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))  # once each, in order
    assert all(b for b in buckets)
    for b in buckets:
        large = [i for i in b if sizes[i] >= ALONE_BYTES]
        if large:
            assert b == large and len(b) == 1
            assert travels_alone("allreduce", [sizes[b[0]]])
        elif cap is not None and len(b) > 1:
            assert sum(sizes[i] for i in b) <= cap
    if all(s < ALONE_BYTES for s in sizes):  # nothing large: the capped rule, unchanged
        if cap is not None:
            assert buckets == size_cap_buckets(sizes, cap)
        else:
            assert buckets == ([list(range(len(sizes)))] if sizes else [])
    # The cost model prices the same buffers, alone ones in their own storage (packing none).
    colls = fused_collectives("grad_allreduce", "allreduce", sizes, cap, 2)
    nbytes = [sum(sizes[i] for i in b) for b in buckets]
    alone = [len(b) == 1 and sizes[b[0]] >= ALONE_BYTES for b in buckets]
    assert [c.nbytes for c in colls] == nbytes
    assert [c.own_storage for c in colls] == alone
    packed = [0 if a else n for a, n in zip(alone, nbytes, strict=True)]
    assert [c.pack_bytes for c in colls] == packed


def test_only_a_contiguous_alone_tensor_of_an_in_place_kind_travels_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fusion, "ALONE_BYTES", 800)
    big, small = torch.zeros(10, 10, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    assert travels_alone("allreduce", [800]) and travels_alone("broadcast", [800])
    assert not travels_alone("reduce", [800])  # a reduce may use a non-root's buffer as scratch
    assert not travels_alone("allreduce", [799]) and not travels_alone("allreduce", [800, 8])
    assert in_place(True, [big]) and not in_place(False, [big])
    assert not in_place(True, [big.T])  # not contiguous: packed
    assert not in_place(False, [small])
    assert bucket_plan([small, big, small, small], [3, 100, 3, 3], None) == [[0], [1], [2, 3]]
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        fused_buckets([1, -1], None)


#: Small, large, small, large but transposed (not contiguous), large; float64.
SHAPES = [(5,), (20, 10), (3,), (10, 20), (300,)]


def _tensors(rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s tensors of :data:`SHAPES`: integers, so every mean is exact."""
    out = []
    for s in SHAPES:
        n = torch.Size(s).numel()
        out.append(torch.arange(n, dtype=torch.float64).reshape(s) * (rank + 1) + n)
    out[3] = out[3].T
    return out


def _collectives(rank: int, world_size: int) -> dict[str, Any]:
    comm = Communicator()
    reduced, sent, onto = _tensors(rank), _tensors(rank), _tensors(rank)
    comm.allreduce_mean(reduced, "grad_allreduce")
    comm.broadcast(sent, 1, "precond_broadcast")
    comm.reduce_mean(onto, 0, "grad_allreduce")
    return {"reduced": reduced, "sent": sent, "onto": onto, "stats": comm.stats.as_dict()}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_in_own_storage_land_the_same_values(
    monkeypatch: pytest.MonkeyPatch, world_size: int
) -> None:
    monkeypatch.setattr(fusion, "ALONE_BYTES", 1000)  # the (20, 10) and (300,) tensors
    results = run_ranks(_collectives, world_size)
    per_rank = [_tensors(r) for r in range(world_size)]
    mean = [sum(ts) / world_size for ts in zip(*per_rank, strict=True)]
    for rank, res in enumerate(results):
        for got, want in zip(res["reduced"], mean, strict=True):
            assert torch.equal(got, want)  # integers: the mean is exact
        for got, want in zip(res["sent"], per_rank[1], strict=True):
            assert torch.equal(got, want)
        for got, want, own in zip(res["onto"], mean, per_rank[rank], strict=True):
            assert torch.equal(got, want if rank == 0 else own)  # others' copies as they were
        # Buckets [0], [1], [2], [3], [4]: the large ones alone (3, transposed, is packed
        # alone: the plan is the same on every rank whatever the layout), a reduce too.
        assert res["stats"]["grad_allreduce"]["calls"] == 5 + 5, res["stats"]
        assert res["stats"]["precond_broadcast"]["calls"] == 5


def _train(rank: int, world_size: int, options: dict[str, Any]) -> dict[str, Any]:
    model = embed_net()
    pre = make_preconditioner(model, "dp_kfac", **options)
    grads = []
    for step in range(4):
        pre.reset_stats()
        model.zero_grad()
        ids, y = embed_batch(step, rank)
        F.cross_entropy(model(ids), y).backward()
        pre.step()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return {"grads": grads, "stats": pre.comm_stats()}


OPTIONS = {
    "owner-overlap-kl": {"grad_reduction": "owner", "overlap": True, "kl_clip": 0.01},
    "allreduce": {},
}
#: Calls the embedding's travelling alone adds: step()'s one all-reduce of every gradient
#: splits in two; the overlapped engine all-reduces a bucket's other gradients apart already.
EXTRA_CALLS = {"owner-overlap-kl": 0, "allreduce": 1}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(OPTIONS))
def test_a_step_with_the_embedding_alone_is_bitwise_the_same_and_priced(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    options = OPTIONS[name]
    packed = run_ranks(_train, 2, options)
    monkeypatch.setattr(fusion, "ALONE_BYTES", LOW)
    alone = run_ranks(_train, 2, options)
    for a, b in zip(packed, alone, strict=True):
        for ga, gb in zip(a["grads"], b["grads"], strict=True):
            assert ga.keys() == gb.keys()
            assert all(torch.equal(ga[n], gb[n]) for n in ga), name
    calls = [r[0]["stats"]["grad_allreduce"]["calls"] for r in (packed, alone)]
    assert calls[1] - calls[0] == EXTRA_CALLS[name]
    shapes = shapes_from_model(embed_net(), embed_batch(0, 0)[0], ready_order=True)
    pred = predict(
        shapes,
        strategy="dp_kfac",
        options={k: v for k, v in options.items() if k != "kl_clip"},
        world_size=2,
        hardware=PRESETS["cpu_gloo_local"],
        param_itemsize=8,
        kfac=KFACOptions(damping=0.01, factor_decay=0.9, lr=0.1, kl_clip=options.get("kl_clip")),
    )
    for rank, res in enumerate(alone):
        assert res["stats"] == pred.update.comm_of(rank), (name, rank)
    own = [c for c in pred.update.collectives if c.own_storage]
    assert own and all(c.pack_bytes == 0 for c in own)
