"""The tuning protocol (experiments/bench/tuning.py) and the paired intervals (intervals.py).

The protocol is pure, so it is driven here with made-up score surfaces until it asks
for nothing more; hypothesis draws the surfaces (where the best learning rate and
damping lie, where training diverges, how noisy seeds are) and the invariants are
checked on every one: every configuration gets the same treatment, a chosen point is
interior unless the next point diverged or the cap was reached (and the cell says so),
damping is tuned at the tuning world sizes and reused elsewhere, finalists run their
seeds, paired cells run theirs, and every decision has a reason.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.bench import intervals
from experiments.bench.tuning import (
    SGD,
    Outcome,
    Planner,
    Point,
    Protocol,
    one_three,
    outcome,
    pending,
    point_key,
    read_results,
    search,
    study_cells,
)

Surface = Callable[[Point], Outcome]


def _drive(
    protocol: Protocol,
    cells: list[tuple[str, str, int]],
    surface: Surface,
    same_step: dict[str, str] | None = None,
    rounds: int = 60,
) -> tuple[Planner, list, dict]:
    """Run the protocol to its end on a score surface: the plans and every run made."""
    results: dict = {}
    for _ in range(rounds):
        planner = Planner(protocol, results, same_step=same_step, one_rank_kfac="dp_kfac")
        plans = planner.plan(cells)
        todo = pending(plans)
        if not todo:
            return planner, plans, results
        for point in todo:
            assert point.key() not in results, "a run is never asked for twice"
            results[point.key()] = surface(point)
    raise AssertionError("the protocol did not finish")


def _surface(best_lr: dict[str, float], best_damping: float, diverge_above: float, noise: float):
    def f(point: Point) -> Outcome:
        x = point.lr_multiplier
        if x > diverge_above:
            return Outcome(math.nan, True, "non-finite training loss")
        score = 0.9 - 0.03 * (math.log2(x) - math.log2(best_lr[point.strategy])) ** 2
        if point.damping == point.damping:
            score -= 0.02 * (math.log10(point.damping) - math.log10(best_damping)) ** 2
        rng = random.Random(hash((point.key(), "noise")))
        score += noise * rng.random()
        # The fingerprint: a configuration's run is its own (no stand-ins here).
        return Outcome(score, False, "", repr(point.key()))

    return f


def test_search_extends_towards_the_best_until_it_is_interior() -> None:
    up = lambda v, u: v * 2 if u else v / 2  # noqa: E731
    s = search({}, (0.5, 1.0, 2.0), up, 10, safe_up=False, name="lr")
    assert s.pending == (0.5, 1.0, 2.0) and s.best is None
    s = search({0.5: 0.8, 1.0: 0.85, 2.0: 0.9}, (0.5, 1.0, 2.0), up, 10, False, "lr")
    assert s.best == 2.0 and s.pending == (4.0,)  # best at the top edge: one more above
    s = search({0.5: 0.8, 1.0: 0.85, 2.0: 0.9, 4.0: None}, (0.5, 1.0, 2.0), up, 10, False, "lr")
    assert s.done and s.best == 2.0 and s.notes == ("the next higher lr (4) diverged",)
    s = search({0.5: 0.8, 1.0: 0.9, 2.0: 0.85}, (0.5, 1.0, 2.0), up, 10, False, "lr")
    assert s.done and s.best == 1.0 and not s.notes
    s = search({0.5: None, 1.0: None, 2.0: None}, (0.5, 1.0, 2.0), up, 10, False, "lr")
    assert s.pending == (0.25,)  # everything diverged: towards safety (smaller lr)
    s = search({0.5: 0.9, 1.0: 0.8, 2.0: 0.7}, (0.5, 1.0, 2.0), up, 3, False, "lr")
    assert s.done and "stopped at 3 points" in s.notes[0]
    # A tie goes to the smaller value.
    s = search({0.5: 0.8, 1.0: 0.9, 2.0: 0.9, 4.0: 0.7}, (0.5, 1.0, 2.0), up, 10, False, "lr")
    assert s.best == 1.0


def test_the_one_three_series() -> None:
    assert [one_three(0.01, True), one_three(0.03, True), one_three(0.1, True)] == [0.03, 0.1, 0.3]
    assert [one_three(0.001, False), one_three(0.003, False)] == [0.0003, 0.001]
    with pytest.raises(ValueError, match="1-3 series"):
        Protocol(damping=(0.001, 0.005))
    with pytest.raises(ValueError, match="unknown tuning setting"):
        Protocol.from_config({"lr_strat": [1, 2]})


def test_damping_comes_from_the_nearest_tuned_world_size() -> None:
    p = Protocol(damping_at=(4, 64))
    assert [p.damping_source(q) for q in (1, 4, 16, 32, 64, 256)] == [4, 4, 4, 64, 64, 64]


@settings(max_examples=40, deadline=None)
@given(
    sgd_best=st.sampled_from([0.125, 0.5, 1.0, 2.0, 8.0]),
    kfac_best=st.sampled_from([0.25, 1.0, 4.0]),
    best_damping=st.sampled_from([0.0003, 0.001, 0.01, 0.1]),
    diverge_above=st.sampled_from([2.0, 4.0, 64.0]),
    noise=st.sampled_from([0.0, 0.001, 0.05]),
)
def test_every_configuration_is_tuned_alike_to_an_interior_point(
    sgd_best: float, kfac_best: float, best_damping: float, diverge_above: float, noise: float
) -> None:
    protocol = Protocol(paired={"m": (16, 64)}, max_points=10)
    best = {SGD: sgd_best, "dp_kfac": kfac_best, "d_kfac": kfac_best}
    cells = [("m", s, p) for p in (64, 4, 16) for s in (SGD, "dp_kfac", "d_kfac")]
    surface = _surface(best, best_damping, diverge_above, noise)
    _, plans, results = _drive(protocol, cells, surface)
    for plan in plans:
        assert plan.done and plan.decisions, plan
        assert all(d["reason"] for d in plan.decisions)
        if plan.failed:
            continue
        lr, damping = plan.chosen
        # Interior among the lrs tried at the chosen damping, or the cell says why not.
        tried = sorted(
            x
            for (m, s, p, x, d, seed), _ in results.items()
            if (m, s, p, seed) == (plan.model, plan.strategy, plan.world_size, 0)
            and d == point_key("", "", 0, 0, damping, 0)[4]
        )
        if lr in (tried[0], tried[-1]):
            assert any("diverged" in n or "stopped" in n for n in plan.notes), (plan, tried)
        # The finalists ran every final seed; paired cells their paired seeds.
        seeds = (
            protocol.paired_seeds
            if (plan.strategy in protocol.paired_strategies and plan.world_size in (16, 64))
            else protocol.final_seeds
        )
        for seed in range(seeds):
            key = point_key(plan.model, plan.strategy, plan.world_size, lr, damping, seed)
            assert key in results
        if plan.strategy == SGD:
            assert damping != damping  # SGD has no damping
        elif plan.world_size in protocol.damping_at:
            # Damping was searched: at least its 4 values at one learning rate.
            at = {
                d
                for (m, s, p, x, d, seed) in results
                if (m, s, p) == (plan.model, plan.strategy, plan.world_size)
            }
            assert len(at) >= len(protocol.damping)
        else:
            source = next(
                q
                for q in plans
                if (q.model, q.strategy, q.world_size)
                == (plan.model, plan.strategy, protocol.damping_source(plan.world_size))
            )
            assert damping == source.damping
    # Where the surface's best is reachable, SGD finds its own (not K-FAC's) learning rate.
    if noise == 0 and sgd_best < diverge_above:
        sgd = [p for p in plans if p.strategy == SGD]
        assert all(p.chosen[0] == sgd_best for p in sgd)


def test_a_same_step_configuration_takes_its_twins_choice_only_when_bitwise_equal() -> None:
    protocol = Protocol()
    cells = [("m", "d_kfac", 4), ("m", "kaisa_mem_opt", 4)]
    base = _surface({"d_kfac": 1.0, "kaisa_mem_opt": 1.0}, 0.01, 64.0, 0.0)

    def same(point: Point) -> Outcome:  # kaisa computes d_kfac's step: equal fingerprints
        twin = Point(
            point.model,
            "d_kfac",
            point.world_size,
            point.lr_multiplier,
            point.damping,
            point.seed,
            "",
        )
        o = base(twin)
        return Outcome(o.val_acc, o.diverged, o.note, repr(twin.key()))

    _, plans, results = _drive(protocol, cells, same, same_step={"kaisa_mem_opt": "d_kfac"})
    kaisa = plans[1]
    assert kaisa.stand_in_for == "d_kfac" and kaisa.chosen == plans[0].chosen
    assert sum(1 for k in results if k[1] == "kaisa_mem_opt") == 1  # one check run
    # A run that differs: kaisa is tuned on its own.
    _, plans, results = _drive(protocol, cells, base, same_step={"kaisa_mem_opt": "d_kfac"})
    assert plans[1].stand_in_for == "" and plans[1].done
    assert sum(1 for k in results if k[1] == "kaisa_mem_opt") > 5


def test_rows_become_outcomes() -> None:
    protocol = Protocol()
    curve = '[{"step": 1, "train_loss": 0.5}]'
    row = {
        "task": "convergence_scale",
        "model": "m",
        "strategy": "dp_kfac",
        "world_size": 4,
        "lr_multiplier": 1.0,
        "damping": 0.01,
        "seed": 0,
        "final_val_acc": 0.9,
        "final_acc": 0.9,
        "curve": curve,
        "error": "",
    }
    assert not outcome(row, protocol).diverged
    assert outcome({**row, "final_val_acc": 0.11}, protocol).diverged  # at chance
    assert outcome({**row, "curve": '[{"step": 1, "train_loss": NaN}]'}, protocol).diverged
    crash = {**row, "error": "RankFailed: rank 2 timed out"}
    failed = outcome(crash, protocol)
    assert failed.diverged and failed.note.startswith("failed: RankFailed")
    # A crash is no outcome (the run is asked for again) until it failed twice.
    key = point_key("m", "dp_kfac", 4, 1.0, 0.01, 0)
    assert key not in read_results([crash], protocol)
    assert read_results([crash, row], protocol)[key].val_acc == 0.9  # the retry's result
    twice = read_results([crash, crash], protocol)[key]
    assert twice.diverged and twice.note.endswith("(2 attempts)")
    sgd = {**row, "strategy": SGD, "damping": float("nan")}
    results = read_results([row, sgd, {**row, "final_val_acc": 0.95}], protocol)
    assert results[point_key("m", "dp_kfac", 4, 1.0, 0.01, 0)].val_acc == 0.95  # the latest
    assert point_key("m", SGD, 4, 1.0, math.nan, 0) in results


def test_the_studys_cells_in_order() -> None:
    node = {
        "study": {"experiments": ["a", "b"], "world_sizes": [64, 4], "strategies": ["none", "x"]},
        "max_world_size": {"b": 16},
    }
    assert study_cells(node) == [
        ("a", "none", 64),
        ("a", "x", 64),
        ("a", "none", 4),
        ("a", "x", 4),
        ("b", "none", 4),
        ("b", "x", 4),
    ]


# ---------------------------------------------------------------- intervals
def test_the_paired_bootstrap_interval_and_verdicts() -> None:
    rng = np.random.default_rng(1)
    b = rng.normal(1000, 100, size=12)
    a = b * 1.02 + rng.normal(0, 5, size=12)  # paired: 2% more steps, little noise
    ratio = intervals.paired_bootstrap(a, b, intervals.ratio_of_means, resamples=2000)
    assert ratio.low < 1.02 < ratio.high and ratio.high - ratio.low < 0.02 and ratio.pairs == 12
    assert intervals.verdict(ratio, (0.8, 1.25), lower_is_better=True) == "equivalent"
    slow = intervals.paired_bootstrap(a * 1.5, b, intervals.ratio_of_means, resamples=2000)
    assert intervals.verdict(slow, (0.8, 1.25), lower_is_better=True) == "worse"
    fast = intervals.paired_bootstrap(a * 0.5, b, intervals.ratio_of_means, resamples=2000)
    assert intervals.verdict(fast, (0.8, 1.25), lower_is_better=True) == "better"
    wide = intervals.Interval(1.1, 0.9, 1.4, 3)
    assert intervals.verdict(wide, (0.8, 1.25), lower_is_better=True) == "inconclusive"
    acc = intervals.paired_bootstrap(
        [0.9, 0.91, 0.92], [0.95, 0.96, 0.97], intervals.mean_difference
    )
    assert acc.value == pytest.approx(-0.05) and acc.high < -0.01
    assert intervals.verdict(acc, (-0.01, 0.01), lower_is_better=False) == "worse"
    # Deterministic, and pairing matters: shuffling one side widens the interval.
    again = intervals.paired_bootstrap(a, b, intervals.ratio_of_means, resamples=2000)
    assert again == ratio
    unpaired = intervals.paired_bootstrap(
        a, rng.permutation(b), intervals.ratio_of_means, resamples=2000
    )
    assert unpaired.high - unpaired.low > 2 * (ratio.high - ratio.low)
    with pytest.raises(ValueError, match="paired values"):
        intervals.paired_bootstrap([1.0], [1.0, 2.0], intervals.mean_difference)


def test_a_run_is_claimed_once_and_a_dead_drivers_claim_is_taken_over(tmp_path: Path) -> None:
    import os

    from experiments.bench import tune

    point = Point("m", "dp_kfac", 4, 1.0, 0.01, 0, "lr")
    folder = tune._claim(tmp_path, point)
    assert folder is not None and (folder / "claimed_by").read_text() == str(os.getpid())
    assert tune._claim(tmp_path, point) is None  # this (live) process holds it
    (folder / "claimed_by").write_text("999999999")  # no such process
    assert tune._claim(tmp_path, point) == folder
