"""kaisa: the gradient-worker grid, its placement, and d_kfac's update at every fraction."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from strategy_cases import batch, concat_batch, make_model, max_rel_err, run

import dpkfac
from dpkfac.plan import scheme_of
from dpkfac.plan.assignment import grad_worker_grid, kaisa_assign
from dpkfac.strategies import strategy_options

STEPS = 3


def test_grid_matches_kaisa_layout() -> None:
    columns, rows = grad_worker_grid(8, 2)
    assert columns == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert rows == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grad_worker_grid(4, 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])  # COMM-OPT
    assert grad_worker_grid(4, 1) == ([[0], [1], [2], [3]], [[0, 1, 2, 3]])  # MEM-OPT
    with pytest.raises(ValueError, match="must divide the world size 6"):
        grad_worker_grid(6, 4)


def test_greedy_placement_balances_columns_then_ranks() -> None:
    # Four equal layers on P = 4 with 2 workers: two columns, each gets two layers,
    # spread over its two ranks.
    owners = kaisa_assign([1.0, 1.0, 1.0, 1.0], 4, 2)
    assert sorted(owners) == [0, 1, 2, 3]
    # One heavy layer alone in a column; the light ones share the other column.
    owners = kaisa_assign([10.0, 1.0, 1.0], 4, 2)
    assert owners[0] % 2 != owners[1] % 2 and owners[1] % 2 == owners[2] % 2


def test_fraction_must_give_a_divisor_of_the_world_size() -> None:
    opts = strategy_options("kaisa", {"grad_worker_fraction": 0.5})
    assert opts.grad_workers(4) == 2
    with pytest.raises(ValueError, match="f·P must be an integer that divides P"):
        opts.grad_workers(3)
    with pytest.raises(ValueError, match="grad_worker_fraction must be in"):
        strategy_options("kaisa", {"grad_worker_fraction": 1.5})
    with pytest.raises(ValueError, match="unknown grad_worker_fraction 'half'"):
        strategy_options("kaisa", {"grad_worker_fraction": "half"})
    cls = scheme_of("kaisa")
    mem = strategy_options("kaisa", {"grad_worker_fraction": "mem_opt"})
    assert cls.preconditioners(2, 4, mem) == (2,)
    assert cls.preconditioners(2, 4, opts) == (0, 2)


def _train(rank: int, world_size: int, fraction: float | str) -> dict[str, Any]:
    model = make_model()
    pre = dpkfac.KFACPreconditioner(
        model, strategy="kaisa", grad_worker_fraction=fraction, kl_clip=0.01, damping=0.01
    )
    params = run(model, pre, [batch(step, rank) for step in range(STEPS)])["params"]
    held = sum(x.decomposition("A") is not None for x in pre.layers.values())
    return {"params": params, "held": held}


def _reference(world_size: int) -> list[dict[str, torch.Tensor]]:
    """d_kfac on one rank with the concatenated batch: what every fraction must give."""
    model = make_model()
    pre = dpkfac.KFACPreconditioner(model, strategy="d_kfac", kl_clip=0.01, damping=0.01)
    return run(model, pre, [concat_batch(step, world_size) for step in range(STEPS)])["params"]


@pytest.mark.distributed
@pytest.mark.parametrize("fraction", ["comm_opt", 0.5, "mem_opt"])
def test_every_fraction_gives_d_kfac_update_at_four_ranks(fraction: float | str) -> None:
    results = run_ranks(_train, 4, fraction)
    ref = _reference(4)
    for step in range(STEPS):
        assert max_rel_err(results[0]["params"][step], ref[step]) < 1e-10, (fraction, step)
        for rank in range(1, 4):
            for name, t in results[rank]["params"][step].items():
                assert torch.equal(t, results[0]["params"][step][name]), (fraction, rank, name)
    # Each layer's decompositions are held by its f·P gradient workers (3 layers):
    # COMM-OPT: every rank holds all of them; MEM-OPT: one rank per layer.
    held = [r["held"] for r in results]
    workers = {"comm_opt": 4, 0.5: 2, "mem_opt": 1}[fraction]
    assert sum(held) == 3 * workers
    if fraction == "comm_opt":
        assert held == [3] * 4
