"""Placement is one pure function, agreed on by every rank whatever its first batch.

Each rank measures batch size and positions on its own first batch. A
placement that prices layers with them (every balanced dp_kfac assignment)
must first agree on them across ranks, or the ranks compute different owner
maps, the broadcasts mismatch and the replicas silently diverge. These tests
give the ranks first batches of very different shapes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from torch import nn

import dpkfac
from dpkfac.costmodel import PRESETS, choose_options
from dpkfac.plan import scheme_of
from dpkfac.plan.assignment import ASSIGNMENTS, LayerShape, Placement
from dpkfac.strategies import STRATEGIES, strategy_class, strategy_options

#: (strategy, options) pairs: every registered strategy, every dp_kfac assignment.
CASES = [("dp_kfac", {"assignment": a}) for a in ASSIGNMENTS] + [
    (name, {}) for name in STRATEGIES if name != "dp_kfac"
]


#: Layer sizes whose balanced owner maps change with the first batch's shape.
DIMS = ((4, 12), (12, 32), (32, 4))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 12), nn.ReLU(), nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 4)
    ).double()


def _first_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0: 8 examples of 1 position; others: 2 examples of 50 positions."""
    n, t = (8, 1) if rank == 0 else (2, 50)
    g = torch.Generator().manual_seed(rank)
    return torch.randn(n, t, 4, generator=g, dtype=torch.float64), torch.randint(0, 4, (n, t))


def _place(rank: int, world_size: int, strategy: str, options: dict) -> dict:
    model = _model()
    pre = dpkfac.KFACPreconditioner(model, strategy=strategy, kl_clip=None, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x, y = _first_batch(rank) if step == 0 else _first_batch(0)
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        pre.step()
        opt.step()
    owners = [(x.owner, x.a_decomposer, x.g_decomposer) for x in pre.layers.values()]
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    # The options as the run resolved them (spd_kfac measures its hardware model).
    return {"owners": owners, "params": params, "options": pre.strategy.options}


@pytest.mark.distributed
@pytest.mark.parametrize(("strategy", "options"), CASES, ids=lambda c: str(c))
def test_ranks_agree_on_placement_with_different_first_batches(
    strategy: str, options: dict
) -> None:
    results = run_ranks(_place, 2, strategy, options)
    assert results[0]["owners"] == results[1]["owners"], (strategy, options)
    assert torch.equal(results[0]["params"], results[1]["params"])
    # The agreed shapes are the element-wise maximum: N = 8, T = 50.
    shapes = [
        LayerShape.linear(str(i), d_in, d_out, batch_size=8, positions=50)
        for i, (d_in, d_out) in zip((0, 2, 4), DIMS, strict=True)
    ]
    cls = scheme_of(strategy)
    assert results[0]["options"] == results[1]["options"]
    expected = cls.placement(shapes, 2, results[0]["options"])
    got = Placement(*map(tuple, zip(*results[0]["owners"], strict=True)))
    assert got == expected


def test_placement_uses_batch_is_declared_for_every_batch_dependent_assignment() -> None:
    """A placement that changes with the batch statistics must say so."""
    small = [
        LayerShape.linear(str(i), d_in, d_out, batch_size=8) for i, (d_in, d_out) in enumerate(DIMS)
    ]
    for strategy, options in CASES:
        cls = scheme_of(strategy)
        opts, _ = choose_options(
            cls,
            strategy_options(strategy, options),
            shapes=small,
            world_size=2,
            hardware=PRESETS["cpu_gloo_local"],
        )
        if cls.placement_uses_batch(opts):
            continue
        for n, t in ((1, 1), (8, 50), (2, 1000)):
            varied = [
                LayerShape(s.name, s.kind, s.a_dim, s.g_dim, positions=t, batch_size=n)
                for s in small
            ]
            assert cls.placement(varied, 2, opts) == cls.placement(small, 2, opts), strategy


def test_unknown_options_and_values_are_named() -> None:
    with pytest.raises(ValueError, match=r"^unknown option 'nope' for strategy 'dp_kfac'\. "):
        strategy_options("dp_kfac", {"nope": 1})
    with pytest.raises(ValueError, match="unknown assignment 'random'"):
        strategy_options("dp_kfac", {"assignment": "random"})
    with pytest.raises(ValueError, match="unknown strategy 'x-kfac'"):
        strategy_class("x-kfac")
    # The papers' hyphenated spellings are read, never written.
    assert strategy_class("spd-kfac").name == "spd_kfac"
    pre = dpkfac.KFACPreconditioner(_model(), strategy="d-kfac")
    assert pre.strategy_name == "d_kfac" and "strategy='d_kfac'" in repr(pre)


def test_a_layer_has_an_owner_only_where_one_rank_decomposes_both() -> None:
    """ "Owner" has one meaning: the rank that decomposes both of a layer's factors (-1 where
    two ranks do, or every rank); the decomposers are named apart."""
    placed = Placement.per_factor([0, 0, 1, 0, None, None, None, 1])
    assert placed.owner == (0, -1, -1, -1)
    assert placed.a_decomposer == (0, 1, None, None)
    assert placed.g_decomposer == (0, 0, None, 1)
    assert [placed.decomposer(i, "G") for i in range(4)] == [0, 0, None, 1]
    assert Placement.per_layer([2, 0]).owner == (2, 0)


def test_a_checkpoint_naming_the_decomposers_owners_still_loads() -> None:
    from dpkfac.curvature import EigenDecomposition, KFACLayer, helper_for
    from dpkfac.curvature.state import layer_state, load_layer_state

    module = nn.Linear(3, 2)
    helper = helper_for(module)
    assert helper is not None
    layer = KFACLayer("fc", module, helper)
    layer.set_placement(-1, 1, 0)
    entry = layer_state(layer, held=False)
    assert (entry["a_decomposer"], entry["g_decomposer"]) == (1, 0)
    old = {k: v for k, v in entry.items() if not k.endswith("_decomposer")}
    old.update(a_owner=0, g_owner=None)  # the keys checkpoints were written with before
    load_layer_state(layer, old, EigenDecomposition, held=None)
    assert (layer.owner, layer.a_decomposer, layer.g_decomposer) == (-1, 0, None)
