"""Loading a preconditioner state saved with another number of ranks (elastic restarts).

* Without ``allow_world_size_change`` the load is refused, naming the keyword.
* With it, dp_kfac's rank-0 state (complete: the owners' layers are gathered into
  it) is loaded on one rank and on three: every factor and decomposition is kept,
  a RuntimeWarning says the run is not a bitwise continuation, the layers are placed
  again at the next step (non-owners then drop what they do not own), and the ranks
  stay bitwise identical.
* A state lacking decompositions of held factors (KAISA with one gradient worker per
  layer keeps each decomposition in its column only) makes the next step decompose.
* Every other strategy (owner reduction, d_kfac, spd_kfac, KAISA) continues too, with
  bitwise-identical replicas.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from strategy_cases import batch, make_model, make_preconditioner

import dpkfac

STEPS = 3


def _train(rank: int, variant: str, **overrides: Any) -> tuple[Any, dpkfac.KFACPreconditioner]:
    model = make_model()
    pre = make_preconditioner(model, variant, **overrides)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
    return model, pre


def _save(rank: int, world_size: int, variant: str, overrides: dict[str, Any]) -> Any:
    """Train a few steps on ``world_size`` ranks; rank 0 returns the (complete) state."""
    _, pre = _train(rank, variant, **overrides)
    state = pre.state_dict()  # a collective under dp_kfac
    return state if rank == 0 else None


@pytest.fixture(scope="module")
def dp_state() -> dict[str, Any]:
    return run_ranks(_save, 2, "dp_kfac", {})[0]


def _held(pre: dpkfac.KFACPreconditioner) -> dict[str, tuple[bool, bool]]:
    return {
        name: (layer.factors["A"].running is not None, layer.has_decompositions())
        for name, layer in pre.layers.items()
    }


def test_another_world_size_is_refused_without_the_keyword(dp_state):
    pre = make_preconditioner(make_model(), "dp_kfac")
    with pytest.raises(ValueError, match=r"world_size=2.*world_size=1.*allow_world_size_change"):
        pre.load_state_dict(dp_state)


def test_dp_kfac_state_of_two_ranks_continues_on_one(dp_state):
    model = make_model()
    pre = make_preconditioner(model, "dp_kfac")
    with pytest.warns(RuntimeWarning, match="world_size=2.*world_size=1.*not a bitwise"):
        pre.load_state_dict(dp_state, allow_world_size_change=True)
    assert pre.steps == STEPS and not pre.strategy.placed
    for name, entry in dp_state["layers"].items():
        layer = pre.layers[name]
        for which in ("A", "G"):
            assert torch.equal(layer.factors[which].running, entry[which]), (name, which)
        assert layer.has_decompositions(), name
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    x, y = batch(STEPS, 0)
    F.cross_entropy(model(x), y).backward()
    pre.step()
    assert pre.strategy.placed and {x.owner for x in pre.layers.values()} == {0}
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    state = pre.state_dict()
    assert state["world_size"] == 1 and state["steps"] == STEPS + 1
    assert all(entry["A"] is not None for entry in state["layers"].values())


def _resume_on(rank: int, world_size: int, state: dict[str, Any]) -> dict[str, Any]:
    model = make_model()
    pre = make_preconditioner(model, "dp_kfac")
    with pytest.warns(RuntimeWarning, match="not a bitwise"):
        pre.load_state_dict(state, allow_world_size_change=True)
    loaded = _held(pre)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS, STEPS + 2):
        opt.zero_grad()
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
    gathered = pre.state_dict()
    return {
        "loaded": loaded,
        "held": _held(pre),
        "owners": {name: layer.owner for name, layer in pre.layers.items()},
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "gathered": gathered if rank == 0 else None,
    }


def test_dp_kfac_state_of_two_ranks_continues_on_three(dp_state):
    results = run_ranks(_resume_on, 3, dp_state)
    for rank, result in enumerate(results):
        # Every rank starts from the whole state (all layers, all decompositions)...
        assert all(result["loaded"].values()) and all(all(v) for v in result["loaded"].values())
        # ...and after the new placement keeps exactly the layers it owns.
        assert result["owners"] == results[0]["owners"]
        for name, (factor, decomposition) in result["held"].items():
            owned = result["owners"][name] == rank
            assert factor == owned and decomposition == owned, (rank, name)
        for name, tensor in result["params"].items():
            assert torch.equal(tensor, results[0]["params"][name]), (rank, name)
    assert len(set(results[0]["owners"].values())) == 3  # the placement uses all three ranks
    layers = results[0]["gathered"]["layers"]
    assert results[0]["gathered"]["world_size"] == 3
    assert all(entry["A"] is not None and entry["A_decomp"] for entry in layers.values())


def test_missing_decompositions_are_computed_at_the_next_step():
    # One gradient worker per layer: each rank holds only its own layers' decompositions,
    # and rank 0's checkpoint gathers them all.
    state = run_ranks(_save, 2, "kaisa_mem_opt", {"inv_update_steps": 100})[0]
    entries = list(state["layers"].values())
    assert all(e["A"] is not None and e["A_decomp"] is not None for e in entries)
    # A checkpoint that lacks some (written before they were gathered) still loads.
    for entry in entries[:2]:
        entry["A_decomp"] = entry["G_decomp"] = None
    model = make_model()
    pre = make_preconditioner(model, "kaisa_mem_opt", inv_update_steps=100)
    with pytest.warns(RuntimeWarning, match="missing decompositions are computed"):
        pre.load_state_dict(state, allow_world_size_change=True)
    x, y = batch(STEPS, 0)
    F.cross_entropy(model(x), y).backward()
    pre.step()  # step 3: not a decomposition step of the schedule, yet it decomposes
    assert all(layer.has_decompositions() for layer in pre.layers.values())


def _continue(rank: int, world_size: int, state: dict[str, Any], variant: str) -> dict[str, Any]:
    model = make_model()
    pre = make_preconditioner(model, variant)
    with pytest.warns(RuntimeWarning, match="not a bitwise"):
        pre.load_state_dict(state, allow_world_size_change=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS, STEPS + 2):
        opt.zero_grad()
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", ["dp_kfac_owner", "d_kfac", "spd_kfac", "kaisa_mem_opt"])
def test_every_strategy_continues_on_another_world_size(variant):
    state = run_ranks(_save, 2, variant, {})[0]
    params = run_ranks(_continue, 3, state, variant)
    for rank, result in enumerate(params):
        for name, tensor in result.items():
            assert torch.isfinite(tensor).all(), (rank, name)
            assert torch.equal(tensor, params[0][name]), (rank, name)
