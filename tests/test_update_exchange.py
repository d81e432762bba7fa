"""The step's exchanges as data (dpkfac/plan/exchange.py): one description of the gradients'
reduction and of the updates' exchange, which the runtime launches and the cost model prices.

The pure rules are checked on drawn inputs here; that the runtime's bytes and calls equal the
cost model's for every scheme is the differential test's (tests/test_costmodel.py,
tests/test_scale_sim.py), which now read both from this one description.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dpkfac.costmodel import ModelShapes
from dpkfac.costmodel.traffic import grad_collectives, precond_collectives
from dpkfac.plan import DPKFACOptions, DPKFACScheme
from dpkfac.plan.assignment import LayerShape
from dpkfac.plan.exchange import (
    Transfer,
    decomposition_transfers,
    factor_transfers,
    gradient_transfers,
    update_nbytes,
    update_shapes,
    update_transfers,
    waited_by_layers,
)

senders = st.lists(st.lists(st.integers(0, 50), max_size=4), min_size=1, max_size=6)


@given(senders)
def test_each_sender_broadcasts_its_layers_in_group_order(sent_by: list[list[int]]) -> None:
    assert update_transfers(False, sent_by) == [
        Transfer("broadcast", (tuple(s),), root=i) for i, s in enumerate(sent_by) if s
    ]


@given(senders)
def test_under_the_owner_reduction_one_all_gather_carries_every_shard(
    sent_by: list[list[int]],
) -> None:
    transfers = update_transfers(True, sent_by)
    if not any(sent_by):
        assert transfers == []
        return
    assert transfers == [Transfer("all_gather", tuple(tuple(s) for s in sent_by))]


# Items: (owner or None, tag); None is a parameter of no K-FAC layer.
items = st.lists(st.tuples(st.none() | st.integers(0, 3), st.integers()), max_size=12)


@given(items, st.booleans(), st.booleans())
def test_gradients_travel_once_onto_their_owners_then_the_rest(
    grads: list[tuple[int | None, int]], owner_reduction: bool, kfac_first: bool
) -> None:
    def owner(g: tuple[int | None, int]) -> int | None:
        return g[0]

    transfers = gradient_transfers(owner_reduction, grads, owner, 4, kfac_first=kfac_first)
    carried = [g for t in transfers for shard in t.shards for g in shard]
    assert sorted(map(repr, carried)) == sorted(map(repr, grads))  # each once
    # What the layers wait for comes first; the rest, if any, is one all-reduce after it.
    waited = [waited_by_layers(t, owner) for t in transfers]
    assert waited == sorted(waited, reverse=True)
    if not owner_reduction and not kfac_first:
        assert transfers == ([Transfer("allreduce", (tuple(grads),))] if grads else [])
        return
    for t in transfers:
        if not waited_by_layers(t, owner):
            assert t == Transfer("allreduce", (tuple(g for g in grads if g[0] is None),))
    if not owner_reduction:
        kfac = tuple(g for g in grads if g[0] is not None)
        assert all(t.kind == "allreduce" for t in transfers)
        assert [t.shards[0] for t in transfers if waited_by_layers(t, owner)] == (
            [kfac] if kfac else []
        )
        return
    kinds = [t.kind for t in transfers]
    assert kinds == sorted(kinds, key=["reduce_scatter", "allreduce"].index)  # K-FAC first
    for t in transfers:
        if t.kind == "reduce_scatter":
            assert len(t.shards) == 4
            for r, shard in enumerate(t.shards):  # each owner's, in the given order
                assert list(shard) == [g for g in grads if g[0] == r]
        else:
            assert list(t.shards[0]) == [g for g in grads if g[0] is None]


def _two_layers() -> tuple[ModelShapes, object]:
    layers = (LayerShape("a", "linear", 5, 3, batch_size=4), LayerShape("b", "linear", 7, 2))
    shapes = ModelShapes(layers, bias=(False, False), captured=(True, True), other_params=(6,))
    plan = DPKFACScheme.plan(layers, 2, DPKFACOptions(grad_reduction="owner"))
    assert sorted(plan.preconditioners) == [(0,), (1,)]  # one layer per owner
    return shapes, plan


def test_the_cost_model_prices_one_all_gather_of_the_owners_updates() -> None:
    """The owners' updates go by one all-gather on every backend (gloo's is an alltoallv):
    one call carrying every owner's update and KL scalars."""
    shapes, plan = _two_layers()
    kw = {"itemsize": 4, "cap_bytes": 2**20, "kl_clip": True}
    priced = precond_collectives(shapes, plan, 0, **kw)
    assert [(c.kind, c.nbytes) for c in priced] == [("all_gather", 4 * (5 * 3 + 2 + 7 * 2 + 2))]


def test_the_cost_model_reduces_gradients_as_the_transfers_say() -> None:
    shapes, plan = _two_layers()
    owner = grad_collectives(shapes, 2, itemsize=4, cap_bytes=2**20, plan=plan)
    plain = grad_collectives(shapes, 2, itemsize=4, cap_bytes=2**20)
    assert [(c.kind, c.nbytes) for c in owner] == [("reduce_scatter", 4 * 29), ("allreduce", 24)]
    assert [(c.kind, c.nbytes) for c in plain] == [("allreduce", 4 * 35)]


@given(senders)
def test_each_decomposer_broadcasts_its_own_in_group_order(sent_by: list[list[int]]) -> None:
    assert decomposition_transfers(sent_by) == update_transfers(False, sent_by)


@given(st.lists(st.integers(0, 50), max_size=8), st.sampled_from(["none", "allreduce"]))
def test_factors_travel_in_one_fused_all_reduce_from_step(factors: list[int], comm: str) -> None:
    transfers = factor_transfers(comm, factors)
    if comm == "none" or not factors:
        assert transfers == []
    else:
        assert transfers == [Transfer("allreduce", (tuple(factors),))]


def test_pipelined_factors_travel_per_fusion_bucket_or_alone_while_profiled() -> None:
    assert factor_transfers("pipelined", ["a", "b", "c"]) == [
        Transfer("allreduce", (("a",),)),
        Transfer("allreduce", (("b",),)),
        Transfer("allreduce", (("c",),)),
    ]
    buckets = [["a", "b"], [], ["c"]]
    assert factor_transfers("pipelined", ["a", "b", "c"], buckets) == [
        Transfer("allreduce", (("a", "b"),)),
        Transfer("allreduce", (("c",),)),
    ]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("with_kl", [False, True])
def test_an_update_travels_as_the_one_layout_says(dtype: torch.dtype, with_kl: bool) -> None:
    """The runtime's buffers for one layer's update (sender's and receiver's) have the shapes
    and bytes the cost model counts: the matrix, then the KL scalars in at least float32."""
    from dpkfac.curvature import KFACLayer, helper_for
    from dpkfac.strategies.base import Preconditioned, update_buffers

    module = torch.nn.Linear(3, 5).to(dtype)
    module.weight.grad = torch.zeros_like(module.weight)
    helper = helper_for(module)
    assert helper is not None
    layer = KFACLayer("fc", module, helper)
    shapes = update_shapes(5, 4, with_kl=with_kl)
    nbytes = update_nbytes(5, 4, with_kl=with_kl, itemsize=torch.finfo(dtype).bits // 8)
    sent = Preconditioned(
        torch.ones(5, 4, dtype=dtype),
        torch.ones((), dtype=torch.promote_types(dtype, torch.float32)),
        True,
    )
    for result in (sent, None):
        buffers = update_buffers(layer, result, with_kl=with_kl)
        assert tuple(tuple(b.shape) for b in buffers) == shapes
        assert [b.numel() * b.element_size() for b in buffers] == nbytes
