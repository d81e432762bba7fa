"""One cost per layer: what placement balances against what the timing model prices.

The default placement cost (``assignment_cost="compute"``) counts flops, with
no hardware: every rank computes the same placement with nothing measured.
The timing model also prices a per-call latency. Where latency dominates
(small decompositions on a GPU) the two disagree: on ``v100_ib100`` at P=8,
LPT by flops is predicted slower for ResNet-32 than round robin, although it
splits the flops better. :func:`~dpkfac.costmodel.timing.seconds_cost` is the
timing model's own per-layer cost; placing by it removes the disagreement.
"""

from __future__ import annotations

import math

import pytest

from dpkfac.costmodel import owner_seconds, predict, seconds_cost
from dpkfac.costmodel.zoo import ZOO
from dpkfac.plan.assignment import COSTS, assign_layers, rank_loads
from dpkfac.plan.presets import PRESETS

HW = PRESETS["v100_ib100"]


def _iteration(model: str, p: int, assignment: str, cost: object) -> float:
    shapes, kfac = ZOO[model]
    options = {"assignment": assignment, "assignment_cost": cost}
    return predict(
        shapes, strategy="dp_kfac", world_size=p, hardware=HW, kfac=kfac, options=options
    ).iteration_avg


def test_the_p8_resnet32_paradox_is_per_call_latency() -> None:
    """LPT by flops: better flop split, predicted slower, because its busiest rank holds
    more layers (more latency-bound decompositions) than round robin's."""
    shapes, _ = ZOO["resnet32"]
    flops = [COSTS["compute"](s) for s in shapes]
    owners = {
        a: assign_layers(list(shapes), 8, cost="compute", method=a) for a in ("lpt", "round_robin")
    }
    split = {a: max(rank_loads(o, flops, 8)) / (sum(flops) / 8) for a, o in owners.items()}
    assert split["lpt"] < split["round_robin"]  # 1.096 < 1.174
    assert _iteration("resnet32", 8, "lpt", "compute") > _iteration(
        "resnet32", 8, "round_robin", "compute"
    )
    most = {a: max(o.count(r) for r in range(8)) for a, o in owners.items()}
    assert most["lpt"] > most["round_robin"]  # 5 layers (10 decompositions) against 4


def _busiest_compute(model: str, p: int, assignment: str, cost: object) -> float:
    """The busiest rank's predicted K-FAC compute seconds on a factor-and-decomposition step."""
    shapes, kfac = ZOO[model]
    options = {"assignment": assignment, "assignment_cost": cost}
    pr = predict(shapes, strategy="dp_kfac", world_size=p, hardware=HW, kfac=kfac, options=options)
    return pr.steps[(True, True)].computation


@pytest.mark.parametrize("model", ["resnet32", "bert_base"])
@pytest.mark.parametrize("p", [2, 3, 4, 8, 16])
def test_best_by_the_timing_models_cost_has_the_least_busy_rank(model, p) -> None:
    """ "best" keeps the better of LPT and round robin by its cost; by the timing model's
    cost, that is the placement whose busiest rank the model predicts least busy."""
    _, kfac = ZOO[model]
    timed = seconds_cost(HW, kfac)
    best = _busiest_compute(model, p, "best", timed)
    for assignment in ("lpt", "round_robin"):
        for cost in ("compute", timed):
            assert best <= _busiest_compute(model, p, assignment, cost) * (1 + 1e-12)


def test_placing_by_seconds_resolves_the_p8_resnet32_paradox() -> None:
    timed = seconds_cost(HW, ZOO["resnet32"][1])
    assert _iteration("resnet32", 8, "lpt", timed) < _iteration(
        "resnet32", 8, "round_robin", "compute"
    )


@pytest.mark.parametrize("model", ["resnet32", "bert_base"])
def test_owner_seconds_add_up_to_each_ranks_predicted_compute(model) -> None:
    """The per-layer cost is the timing model's: a rank's K-FAC compute seconds on a step
    that builds factors and decomposes are the sum of its owned layers' costs."""
    shapes, kfac = ZOO[model]
    p = 4
    pr = predict(shapes, strategy="dp_kfac", world_size=p, hardware=HW, kfac=kfac)
    step = pr.steps[(True, True)]
    assert pr.plan is not None
    for rank, phases in enumerate(step.phases_per_rank):
        owned = [s for i, s in enumerate(shapes) if pr.plan.preconditions(rank, i)]
        expected = sum(
            owner_seconds(
                s,
                HW,
                compute_method=kfac.compute_method,
                weight_sharing=kfac.weight_sharing,
            )
            for s in owned
        )
        got = sum(phases[ph] for ph in ("factor_compute", "decomposition", "precondition"))
        assert math.isclose(got, expected, rel_tol=1e-12), (rank, got, expected)


def test_seconds_cost_amortises_the_update_intervals() -> None:
    shapes, kfac = ZOO["resnet32"]
    s = shapes[5]
    every = owner_seconds(s, HW, factor_every=1, decomp_every=1)
    sparse = owner_seconds(s, HW, factor_every=2, decomp_every=10)
    pre = owner_seconds(s, HW, factor_every=10**12, decomp_every=10**12)
    assert pre < sparse < every
    with pytest.raises(ValueError, match="int update intervals"):
        seconds_cost(HW, type(kfac)(inv_update_steps=lambda step: 10))
