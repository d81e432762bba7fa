"""The ``convergence_scale`` table: its preset, its checks, its writer and one tiny sweep.

The real sweep trains hundreds of runs for many hours; what can be checked in
seconds is checked here: the preset composes and its bad values are named, the
learning-rate rule and the skip rules, the writer on synthetic rows (the
learning rate chosen on validation and never on test, the seed spread and the
takeaway computed from it, time to target = steps x predicted seconds per
step), and one end-to-end sweep through ``python -m experiments.bench -m
table=convergence_scale`` at P in {1, 4} on 400 generated samples that writes
the table into a temporary results folder.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from experiments.bench import convergence_scale as cs
from experiments.bench import pages, tables
from experiments.bench.run import compose_config
from experiments.config import ExperimentError, validate_benchmark

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------- preset
def _compose(*overrides: str) -> Any:
    return compose_config("benchmark", ["table=convergence_scale", *overrides])


def test_the_preset_composes_and_validates() -> None:
    cfg = _compose()
    validate_benchmark(cfg)
    assert cfg.task == "convergence_scale" and cfg.table_name == "convergence_scale"
    node = cfg.convergence_scale
    assert node.batch_size == 16 and node.hardware == "v100_ib100"
    assert dict(node.seeds_at) == {256: 1}
    # The documented way to run every seed at P=256 (conf/benchmark.yaml):
    assert "'convergence_scale.seeds_at={256:3}'" in (ROOT / "conf" / "benchmark.yaml").read_text()
    wide = _compose("convergence_scale.seeds_at={256:3}", "world_size=256", "seed=2")
    assert dict(wide.convergence_scale.seeds_at) == {256: 3} and cs.skip_reason(wide) is None
    assert cs.skip_reason(_compose("world_size=256", "seed=2")) == "P=256 runs seeds 0..0"
    assert set(node.targets) == {"mnist1d_mlp", "mnist1d_cnn", "digits_cnn"}
    assert dict(node.max_world_size) == {"digits_cnn": 16}
    assert list(node.overrides) == ["data.val_fraction=0.1"]  # lr chosen on validation
    preset = (ROOT / "conf" / "table" / "convergence_scale.yaml").read_text()
    for sweep in (
        "strategy: none,dp_kfac,d_kfac,kaisa_mem_opt,grouped_auto",
        "world_size: 1,4,16,64,256",
        "convergence_scale.experiment: mnist1d_mlp,mnist1d_cnn,digits_cnn",
        "seed: 0,1,2",
    ):
        assert sweep in preset, sweep


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("convergence_scale.batch_size=0", "convergence_scale.batch_size=0"),
        ("convergence_scale.experiment=nope", "convergence_scale.experiment='nope'"),
        ("convergence_scale.hardware=tpu", "convergence_scale.hardware='tpu'"),
        ("convergence_scale.lr_multiplier=-1", "convergence_scale.lr_multiplier=-1"),
        ("convergence_scale.fidelity_every=-2", "convergence_scale.fidelity_every=-2"),
        ("convergence_scale.experiment=cifar10_resnet32", "convergence_scale.targets="),
        ("convergence_scale.targets.mnist1d_mlp=1.5", "convergence_scale.targets="),
        ("convergence_scale.seeds_at={256:0}", "convergence_scale.seeds_at="),
        ("convergence_scale.max_world_size={digits_cnn:0}", "convergence_scale.max_world_size="),
        ("convergence_scale.one_rank_kfac=none", "convergence_scale.one_rank_kfac='none'"),
        ("convergence_scale.one_rank_kfac=dp-kfac", "convergence_scale.one_rank_kfac='dp-kfac'"),
        ("+convergence_scale.same_step.kaisa=d_kfac", "convergence_scale.same_step="),
        ("convergence_scale.same_step.kaisa_mem_opt=kaisa_mem_opt", "convergence_scale.same_step="),
        ("convergence_scale.same_step_check=null", "convergence_scale.same_step_check=None"),
        ("convergence_scale.same_step_check.seed=-1", "convergence_scale.same_step_check="),
    ],
)
def test_bad_values_are_named(override: str, named: str) -> None:
    with pytest.raises(ExperimentError, match=f"invalid value {named}"):
        validate_benchmark(_compose(override))


def test_learning_rate_rule_and_skips() -> None:
    node = {"batch_size": 16, "base_lr": 0.05, "base_batch": 64, "lr_multiplier": 0.5}
    assert cs.learning_rate(node, 1) == pytest.approx(0.05 * 16 / 64 * 0.5)
    assert cs.learning_rate(node, 256) == pytest.approx(0.05 * 4096 / 64 * 0.5)
    # null: the experiment preset's own lr and batch (digits_cnn: 0.02 at 32).
    own = {**node, "base_lr": None, "base_batch": None, "experiment": "digits_cnn"}
    assert cs.base_lr_and_batch(own) == (0.02, 32)
    assert cs.learning_rate(own, 4) == pytest.approx(0.02 * 64 / 32 * 0.5)
    assert cs.skip_reason(_compose("world_size=64", "convergence_scale.experiment=digits_cnn"))
    assert cs.skip_reason(_compose("world_size=256", "seed=0")) is None
    assert "seeds 0..0" in str(cs.skip_reason(_compose("world_size=256", "seed=1")))
    assert cs.skip_reason(_compose("world_size=64", "seed=2")) is None
    limited = _compose("world_size=64", "+convergence_scale.max_world_size.mnist1d_mlp=16")
    assert "up to P=16" in str(cs.skip_reason(limited))
    # A configuration that computes another's step trains at its check point only (P > 1).
    twin = ("strategy=kaisa_mem_opt", "world_size=16")
    check = ("convergence_scale.lr_multiplier=0.5", "seed=0")
    assert cs.skip_reason(_compose(*twin, *check)) is None
    assert "d_kfac's step" in str(cs.skip_reason(_compose(*twin, check[0], "seed=1")))
    assert "x0.5 seed 0 only" in str(cs.skip_reason(_compose(*twin, "seed=0")))  # x1
    assert cs.skip_reason(_compose(*twin, "seed=1", "convergence_scale.same_step=null")) is None
    assert cs.skip_reason(_compose("strategy=d_kfac", "world_size=16", "seed=1")) is None


def test_the_job_trains_what_the_study_fixes_and_prices_it(tmp_path: Path) -> None:
    """The training config of a job, and the cost model's price of its step, without training."""
    fake = 'convergence_scale.overrides=["data.fake=true"]'
    cfg = _compose(
        "strategy=grouped_auto", "world_size=64", "convergence_scale.lr_multiplier=0.5", fake
    )
    train = cs.training_config(cfg, tmp_path)
    assert train.launcher.name == "threads" and train.launcher.world_size == 64
    assert train.data.batch_size == 16 and train.optimizer.lr == pytest.approx(0.05 * 16 * 0.5)
    assert not train.trainer.scale_lr and train.trainer.check_replicas
    assert train.strategy.fidelity_every == 20 and train.strategy.hardware == "v100_ib100"
    model, x = cs.model_and_input(train)
    grouped = cs.predicted_iteration(train, 64, "v100_ib100", model, x)
    assert grouped["pred_iteration_s"] > 0 and "factor_group_size=" in grouped["pred_chosen"]
    sgd_train = cs.training_config(_compose("strategy=none", "world_size=64", fake), tmp_path)
    assert "fidelity_every" not in sgd_train.strategy
    sgd = cs.predicted_iteration(sgd_train, 64, "v100_ib100", model, x)
    assert 0 < sgd["pred_iteration_s"] < grouped["pred_iteration_s"]
    assert cs.layer_kinds(model)["0"] == "Linear"


def _sweep_strategies() -> list[str]:
    preset = (ROOT / "conf" / "table" / "convergence_scale.yaml").read_text()
    line = next(x for x in preset.splitlines() if x.strip().startswith("strategy:"))
    return line.split(":", 1)[1].strip().split(",")


def _trained(tmp_path: Path, strategy: str, p: int, steps: int = 12) -> dict[str, Any]:
    """The checkpoint after ``steps`` steps of this grid point's own training config."""
    import torch

    from experiments.train import run

    overrides = f'convergence_scale.overrides=["data.fake=true","trainer.max_steps={steps}"]'
    cfg = _compose(f"strategy={strategy}", f"world_size={p}", overrides)
    train = cs.training_config(cfg, tmp_path / f"{strategy}_{p}")
    train.trainer.checkpoint_every_steps = steps
    run(train)
    path = tmp_path / f"{strategy}_{p}" / "checkpoints" / "last.pt"
    return torch.load(path, weights_only=False)


def _assert_same_step(reference: dict[str, Any], state: dict[str, Any], name: str) -> None:
    """Bitwise the same parameters, momentum buffers and history (wall time aside)."""
    import torch

    for key, value in reference["model"].items():
        assert torch.equal(value, state["model"][key]), (name, key)
    momenta = [s["momentum_buffer"] for s in reference["optimizer"]["state"].values()]
    theirs = [s["momentum_buffer"] for s in state["optimizer"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(momenta, theirs, strict=True)), name
    untimed = [
        [{k: v for k, v in h.items() if k != "wall_time_s"} for h in c["history"]]
        for c in (state, reference)
    ]
    assert untimed[0] == untimed[1], name


def test_at_one_rank_every_kfac_configuration_trains_the_same_parameters(
    tmp_path: Path,
) -> None:
    """What lets the sweep train one K-FAC configuration at P=1 for all (``one_rank_kfac``):
    each of the sweep's K-FAC configurations, trained 12 steps by the job's own training
    config on one rank, ends with bitwise the same parameters, optimizer state and
    history as dp_kfac; and the others' P=1 jobs are skipped, SGD's and dp_kfac's not."""
    states = {}
    check = ("world_size=1", "convergence_scale.lr_multiplier=0.5", "seed=0")
    for strategy in _sweep_strategies():
        skipped = cs.skip_reason(_compose(f"strategy={strategy}", "world_size=1"))  # x1
        assert (skipped is None) == (strategy in ("none", "dp_kfac")), (strategy, skipped)
        assert cs.skip_reason(_compose(f"strategy={strategy}", *check)) is None
        if strategy != "none":
            states[strategy] = _trained(tmp_path, strategy, 1)
    reference = states.pop("dp_kfac")
    assert len(states) >= 3
    for strategy, state in states.items():
        _assert_same_step(reference, state, strategy)
    assert cs.skip_reason(_compose("strategy=d_kfac", "world_size=4")) is None
    every = _compose("strategy=d_kfac", "world_size=1", "convergence_scale.one_rank_kfac=null")
    assert cs.skip_reason(every) is None
    assert "d_kfac computes dp_kfac's step on one rank" in str(
        cs.skip_reason(_compose("strategy=d_kfac", "world_size=1"))
    )


def test_at_four_ranks_each_same_step_configuration_trains_its_twins_parameters(
    tmp_path: Path,
) -> None:
    """What lets the sweep train kaisa_mem_opt and grouped_auto at one grid point per
    (model, P) (``same_step``): at P=4, as threads, each ends 12 steps bitwise where its
    twin does (kaisa_mem_opt: d_kfac's averaged factors and decompositions, one rank
    preconditions; grouped_auto: its cost model picks k = 1 here, each layer's factors from
    its owner's batch alone, as dp_kfac's)."""
    same = _compose().convergence_scale.same_step
    assert set(same) == {"kaisa_mem_opt", "grouped_auto"}
    states = {s: _trained(tmp_path, s, 4) for s in [*same, *same.values()]}
    for strategy, twin in same.items():
        assert strategy in _sweep_strategies() and twin in _sweep_strategies()
        _assert_same_step(states[twin], states[strategy], strategy)
    with pytest.raises(AssertionError):  # what the check tells apart: local against averaged
        _assert_same_step(states["dp_kfac"], states["d_kfac"], "d_kfac")


# ------------------------------------------------------------------- writer
def _curve(spe: int, steps: float, epochs: int = 20) -> str:
    """A run that stays below the target (0.85) until ``steps``, above it after."""
    return json.dumps(
        [
            {"step": spe * e, "epoch": float(e), "test_acc": acc, "val_acc": acc}
            for e in range(1, epochs + 1)
            for acc in [0.9 if spe * e >= steps else 0.8]
        ]
    )


def _reach(rows: pd.DataFrame, where: pd.Series, epochs: float) -> None:
    """The runs at ``where`` reach the target after ``epochs`` epochs (NaN: never)."""
    for i in rows.index[where]:
        spe = int(rows.at[i, "steps_per_epoch"])
        rows.at[i, "steps_to_target"] = epochs * spe
        rows.at[i, "epochs_to_target"] = epochs
        rows.at[i, "curve"] = _curve(spe, epochs * spe)


def _row(strategy: str, p: int, seed: int, m: float, **values: Any) -> dict[str, Any]:
    spe = 5000 // p
    steps = values.pop("steps_to_target", 4 * spe)
    curve = _curve(spe, steps)
    row = {
        "task": "convergence_scale",
        "model": "mnist1d_mlp",
        "label": "MLP",
        "strategy": strategy,
        "world_size": p,
        "seed": seed,
        "batch_size": 16,
        "global_batch": 16 * p,
        "lr_multiplier": m,
        "lr": 0.0125 * p * m,
        "lr_rule": "lr = 0.05 x (batch 16 x P / 64) x multiplier",
        "target": 0.85,
        "steps_per_epoch": spe,
        "steps": 20 * spe,
        "epochs": 20.0,
        "final_acc": 0.9,
        "final_val_acc": 0.9,
        "steps_to_target": steps,
        "epochs_to_target": steps / spe if steps == steps else math.nan,
        "curve": curve,
        "fidelity_cosine": json.dumps({} if strategy == "none" else {"Linear": 0.9}),
        "step_s": 0.004 * p,
        "seconds": 10.0,
        "replicas_identical": p > 1,
        "pred_iteration_s": 0.001 if strategy == "none" else 0.0015,
        "pred_hardware": "v100_ib100",
        "pred_chosen": "",
        "error": "",
    }
    row.update(values)
    return row


def _rows() -> pd.DataFrame:
    """d_kfac reaches the target in 4 epochs (one seed in 3 at P=16); dp_kfac keeps up to
    P=4, is two epochs late at P=16. SGD needs 6 epochs. The multiplier 2 has the best
    test accuracy everywhere but the worse validation accuracy: it must never be chosen."""
    rows = []
    for p in (1, 4, 16):
        spe = 5000 // p
        for seed in (0, 1):
            for m in (0.5, 2.0):
                bad = {"final_val_acc": 0.5, "final_acc": 0.99} if m == 2.0 else {}
                d_steps = (3 if (p == 16 and seed == 1) else 4) * spe
                dp_steps = (6 if p == 16 else 4) * spe
                rows += [
                    _row("d_kfac", p, seed, m, steps_to_target=d_steps, **bad),
                    _row("dp_kfac", p, seed, m, steps_to_target=dp_steps, **bad),
                    _row("none", p, seed, m, steps_to_target=6 * spe, **bad),
                ]
    return pd.DataFrame(rows)


def test_the_target_counts_as_reached_once_the_run_stays_above_it() -> None:
    """A crossing the run falls back from (the CNN's plateau at P=4) is not reaching it."""
    acc = [0.90, 0.955, 0.94, 0.951, 0.949, 0.96, 0.97]
    curve = [{"step": 10 * e, "epoch": float(e), "test_acc": a} for e, a in enumerate(acc, 1)]
    assert cs.reached(curve, 0.95) == (60.0, 6.0)
    assert cs.reached(curve, 0.90) == (10.0, 1.0)
    assert all(math.isnan(x) for x in cs.reached(curve[:-2], 0.95))  # ends below: never
    diverged = [*curve, {"step": 80, "epoch": 8.0, "test_acc": math.nan}]
    assert all(math.isnan(x) for x in cs.reached(diverged, 0.95))
    assert all(math.isnan(x) for x in cs.reached([], 0.95))
    # The writer recomputes every row from its curve: a stored figure from an older rule
    # (the first crossing, epoch 2 here) does not survive.
    row = pd.DataFrame([_row("dp_kfac", 4, 0, 1.0, steps_to_target=2 * 1250, target=0.95)])
    row["curve"] = json.dumps(curve)
    fixed = cs.with_steps_to_target(row)
    assert (fixed.at[0, "steps_to_target"], fixed.at[0, "epochs_to_target"]) == (60.0, 6.0)


def test_the_writer_chooses_on_validation_and_states_the_claim(tmp_path: Path) -> None:
    paths = tables.write_table("convergence_scale", _rows(), tmp_path)
    grid = pd.read_csv(paths["csv"])
    assert len(grid) == 3 * 3 * 2 * 2  # every grid point, chosen or not
    assert set(grid.loc[grid["chosen"], "lr_multiplier"]) == {0.5}  # val, never test
    cells = pd.read_csv(paths["cells"])
    assert len(cells) == 9 and set(cells["lr_multiplier"]) == {0.5}
    d16 = cells[(cells["strategy"] == "d_kfac") & (cells["P"] == 16)].iloc[0]
    assert (d16["steps_min"], d16["steps_max"]) == (3 * 312, 4 * 312)
    assert d16["steps_to_target"] == pytest.approx(3.5 * 312)
    dp4 = cells[(cells["strategy"] == "dp_kfac") & (cells["P"] == 4)].iloc[0]
    assert dp4["pred_time_to_target_s"] == pytest.approx(4 * 1250 * 0.0015)
    assert dp4["measured_ms_per_rank"] == pytest.approx(4.0)  # in-process step / P
    assert math.isnan(d16["measured_ms_per_rank"])  # P > 4: not reported
    assert dp4["cosine_Linear"] == pytest.approx(0.9)
    md = paths["md"].read_text().split("\n")
    assert md[0].startswith("# ") and md[2].startswith("**Takeaway (mnist1d_mlp).**")
    assert "leave d_kfac's seed spread (± one evaluation) from P=16" in md[2]
    assert "Time to target (mnist1d_mlp)" in md[3]
    # SGD 6 epochs; dp_kfac 4 (6 at P=16) at 1.5x SGD's predicted seconds per step.
    assert "P=4: 1.50x fewer steps, each 1.50x dearer, neither wins (1.00x SGD's" in md[3]
    assert "P=16: 1.00x fewer steps, each 1.50x dearer, cheaper steps win (1.50x" in md[3]
    assert paths["png"].exists()
    text = paths["md"].read_text()
    assert "Grid points in this table: 36 runs" in text
    assert "lr = 0.05 x (batch 16 x P / 64) x multiplier (mnist1d_mlp)" in text  # per model
    line = cs.headline(cells)
    assert line is not None and line.startswith("- **Convergence as P grows**")
    assert "mnist1d_mlp at P=16 (global batch 256, 2 seed(s)): dp_kfac 1872 steps, " in line
    assert "d_kfac 1092 steps to 0.85" in line
    assert (
        "- mnist1d_mlp, P=16 (12 runs): d_kfac, dp_kfac, none: multipliers 0.5, 2; seeds 0, 1"
        in text
    )


def test_same_step_stand_ins_fill_only_where_the_runs_are_bitwise_equal() -> None:
    """A configuration whose runs equal another's (kaisa_mem_opt and d_kfac at P=16, d_kfac
    and dp_kfac at P=1) takes the other's runs for its missing points, priced as its own
    step; one whose run differs (grouped_auto here) keeps its own; SGD and a configuration
    with as many points as its match get none; applying it twice adds nothing."""
    rows = [
        _row(s, 16, seed, m) for s in ("d_kfac", "dp_kfac") for seed in (0, 1) for m in (0.5, 1)
    ]
    for r in rows:  # every run a different curve
        r["final_acc"] = hash((r["strategy"], r["seed"], r["lr_multiplier"])) % 1000 / 1000
    twin = {**rows[0], "strategy": "kaisa_mem_opt", "pred_iteration_s": 0.002}
    other = {**rows[4], "strategy": "grouped_auto", "final_val_acc": 0.5}  # differs
    sgd = [_row("none", 16, 0, 0.5), _row("none", 16, 1, 0.5)]
    one_rank = [_row("dp_kfac", 1, 0, 0.5), _row("dp_kfac", 1, 1, 0.5), _row("d_kfac", 1, 0, 0.5)]
    frame = pd.DataFrame([*rows, twin, other, *sgd, *one_rank])
    out = cs.with_same_step_stand_ins(frame)
    added = out.iloc[len(frame) :]
    one = added[added["world_size"] == 1]
    assert list(zip(one["strategy"], one["run_as"], one["seed"], strict=True)) == [
        ("d_kfac", "dp_kfac", 1)
    ]
    added = added[added["world_size"] == 16]
    assert set(added["strategy"]) == {"kaisa_mem_opt"} and set(added["run_as"]) == {"d_kfac"}
    assert len(added) == 3
    d = frame[(frame["strategy"] == "d_kfac") & (frame["world_size"] == 16)]
    d = d.set_index(["lr_multiplier", "seed"])
    for r in added.itertuples():
        assert r.final_acc == d.loc[(r.lr_multiplier, r.seed), "final_acc"]
        assert r.pred_iteration_s == 0.002 and math.isnan(r.step_s)  # its own price, no time
    assert len(cs.with_same_step_stand_ins(out)) == len(out)
    cells = cs.cells_frame(cs.choose_lr(out)).set_index(["strategy", "P"])
    kaisa = cells.loc[("kaisa_mem_opt", 16)]
    assert (kaisa["run_as"], kaisa["pred_iteration_ms"]) == ("d_kfac", pytest.approx(2.0))
    assert (
        cells.loc[("grouped_auto", 16), "run_as"],
        cells.loc[("grouped_auto", 16), "seeds"],
    ) == (
        "",
        1,
    )
    lines = cs.coverage(out)
    assert any("kaisa_mem_opt's runs (multipliers 0.5; seeds 0) equal d_kfac's" in x for x in lines)
    assert any("stand for 3 more of kaisa_mem_opt's grid points" in x for x in lines)
    shown = cs._markdown_frame(cells.reset_index())
    assert "kaisa_mem_opt (with d_kfac's runs)" in set(shown["configuration"])


def test_a_failed_job_is_listed_not_dropped(tmp_path: Path) -> None:
    failed = {
        "task": "convergence_scale",
        "model": "mnist1d_mlp",
        "label": "MLP",
        "strategy": "grouped_auto",
        "world_size": 64,
        "setting": "paper",
        "error": "RankFailed: rank 3 raised",
    }
    rows = pd.concat([_rows(), pd.DataFrame([failed])], ignore_index=True)
    paths = tables.write_table("convergence_scale", rows, tmp_path)
    md = paths["md"].read_text()
    assert "## Failed jobs" in md and "grouped_auto P=64 paper: RankFailed: rank 3 raised" in md
    assert len(pd.read_csv(paths["csv"])) == 36  # the failed job is no grid point


def test_the_takeaway_when_dp_kfac_keeps_up() -> None:
    rows = _rows()
    late = (rows["strategy"] == "dp_kfac") & (rows["world_size"] == 16)
    _reach(rows, late, 4)  # within d_kfac's 3..4 epochs
    rows.loc[rows["strategy"] == "dp_kfac", "pred_iteration_s"] = 0.0012
    cells = cs.cells_frame(cs.choose_lr(pages.ok_rows(rows, cs.TASK)))
    text, time = cs.takeaway(cells)
    assert "P=16: 1.50x fewer steps, each 1.20x dearer, fewer steps win (0.80x" in time
    assert "stay within d_kfac's seed spread (± one evaluation) at every P where both" in text
    assert text.endswith("(1, 4, 16).")


def test_a_cell_that_misses_the_target_is_outside_and_said_so() -> None:
    rows = _rows()
    late = (rows["strategy"] == "dp_kfac") & (rows["world_size"] == 4) & (rows["seed"] == 1)
    _reach(rows, late, math.nan)
    cells = cs.cells_frame(cs.choose_lr(pages.ok_rows(rows, cs.TASK)))
    dp4 = cells[(cells["strategy"] == "dp_kfac") & (cells["P"] == 4)].iloc[0]
    assert (dp4["reached"], dp4["seeds"]) == (1, 2) and math.isnan(dp4["pred_time_to_target_s"])
    text = cs.takeaway(cells)[0]
    assert "from P=4 (dp_kfac reached in 1 of 2 seed(s)" in text


def test_no_choice_without_validation_accuracy() -> None:
    rows = _rows()
    rows["final_val_acc"] = math.nan
    assert not cs.choose_lr(pages.ok_rows(rows, cs.TASK))["chosen"].any()


def test_coverage_lists_each_multiplier_with_its_seeds_and_a_lone_multiplier_is_an_edge() -> None:
    """A sweep run in parts holds extra seeds at some multipliers only: the page says which."""
    rows = [_row("d_kfac", 64, 0, m, final_val_acc=0.9 - abs(m - 0.5)) for m in (0.25, 0.5, 1.0)]
    rows += [_row("d_kfac", 64, s, 0.5) for s in (1, 2)]
    rows += [_row("dp_kfac", 64, 0, 0.5)]
    runs = cs.choose_lr(pages.ok_rows(pd.DataFrame(rows), cs.TASK))
    assert cs.coverage(runs)[2:] == [
        "- mnist1d_mlp, P=64 (6 runs): d_kfac: x0.25 (seeds 0) x0.5 (seeds 0, 1, 2) x1 (seeds 0); "
        "dp_kfac: multipliers 0.5; seeds 0"
    ]
    edge = cs.cells_frame(runs).set_index("strategy")["lr_at_grid_edge"]
    assert not edge["d_kfac"] and edge["dp_kfac"]


def test_a_grid_point_run_again_keeps_its_latest_run_and_the_page_counts_the_earlier() -> None:
    """A rerun on another machine replaces the point's earlier run in the table (the
    stand-ins compare bitwise, and two machines' runs are not bitwise equal); the machines
    line counts runs per CPU and kernels, and rows from before the columns existed."""
    old = _row("d_kfac", 4, 0, 0.5, time="2026-12-02T15:57:27", final_acc=0.935)
    new = _row(
        "d_kfac",
        4,
        0,
        0.5,
        time="2026-12-03T07:17:06",
        final_acc=0.9357,
        cpu="EPYC",
        cpu_capability="AVX512",
    )
    kept = _row("d_kfac", 4, 1, 0.5, time="2026-12-02T16:48:52")
    frame = pd.DataFrame([new, old, kept])  # the rerun merged first: time decides
    latest = cs.latest_runs(frame)
    assert sorted(latest["final_acc"]) == [0.9, 0.9357]
    assert len(cs.latest_runs(latest)) == 2
    lines = cs.coverage(cs.choose_lr(latest), superseded=len(frame) - len(latest))
    assert lines[0] == (
        "Grid points in this table: 2 runs (cells not listed were not run). 1 earlier run(s) "
        "of grid points that ran again are left out: a point keeps its latest run, and all "
        "are in `results/raw/convergence_scale.csv`."
    )
    assert lines[1].startswith(
        "Machines: 1 on EPYC (AVX512 kernels); 1 from before the machine was recorded"
    )


def test_the_machine_columns_name_the_cpu_and_torchs_kernels() -> None:
    """What tells two machines' bitwise-different runs apart is in every row."""
    from experiments.bench.measure import machine

    where = machine()
    assert where["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert where["cpu"] and where["cpus"] == os.cpu_count()
    assert where["torch"] == torch.__version__


def test_multipliers_are_compared_on_the_seeds_they_all_ran() -> None:
    """x0.5 beats x0.25 on seed 0; its two extra seeds are worse than x0.25's lone seed 0,
    which must not win the choice on a mean over fewer seeds."""
    rows = [
        _row("d_kfac", 64, 0, 0.25, final_val_acc=0.95),
        _row("d_kfac", 64, 0, 0.5, final_val_acc=0.96),
        _row("d_kfac", 64, 1, 0.5, final_val_acc=0.93),
        _row("d_kfac", 64, 2, 0.5, final_val_acc=0.93),
    ]
    runs = cs.choose_lr(pages.ok_rows(pd.DataFrame(rows), cs.TASK))
    assert set(runs.loc[runs["chosen"], "lr_multiplier"]) == {0.5}
    assert runs["chosen"].sum() == 3  # every seed of the chosen multiplier


def test_extra_seeds_overturn_the_seed_0_screening() -> None:
    """SGD at CNN P=64: x0.5 wins on seed 0 and diverges in seeds 1 and 2; x0.25, run with
    three seeds too, wins on their mean; x1's lone seed 0 is no finalist."""
    rows = [_row("none", 64, 0, 1.0, final_val_acc=0.5)]
    rows += [_row("none", 64, s, 0.5, final_val_acc=v) for s, v in enumerate((0.99, 0.1, 0.1))]
    rows += [_row("none", 64, s, 0.25, final_val_acc=0.98) for s in range(3)]
    runs = cs.choose_lr(pages.ok_rows(pd.DataFrame(rows), cs.TASK))
    assert set(runs.loc[runs["chosen"], "lr_multiplier"]) == {0.25}


# --------------------------------------------------------- end to end, tiny
def test_a_tiny_sweep_writes_the_table(tmp_path: Path) -> None:
    """The real command at P in {1, 4}, 3 configurations, 2 learning rates, 1 seed, 400
    generated samples, one epoch; every rank a thread, the table into tmp_path."""
    results = tmp_path / "results"
    command = [
        sys.executable,
        "-m",
        "experiments.bench",
        "-m",
        "table=convergence_scale",
        "convergence_scale.experiment=mnist1d_mlp",
        "strategy=none,dp_kfac,d_kfac,kaisa_mem_opt",
        "world_size=1,4",
        "seed=0",
        "convergence_scale.lr_multiplier=0.5,2",
        'convergence_scale.overrides=["data.fake=true","trainer.max_epochs=1"]',
        "convergence_scale.targets.mnist1d_mlp=0.2",
        "convergence_scale.fidelity_every=2",
        f"results_dir={results}",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grid = pd.read_csv(results / "convergence_scale.csv").set_index(["strategy", "world_size"])
    assert len(grid) == 4 * 2 * 2  # every grid point: trained, or another's run standing in
    # Trained at x0.5 only (seed 0): d_kfac and kaisa_mem_opt at P=1 (dp_kfac's step), and
    # kaisa_mem_opt at P=4 (d_kfac's); their x2 points are their twins' runs.
    stood = grid[grid["run_as"] != grid.index.get_level_values("strategy")]
    assert set(stood.index) == {("d_kfac", 1), ("kaisa_mem_opt", 1), ("kaisa_mem_opt", 4)}
    assert (stood["lr_multiplier"] == 2).all() and stood["step_s"].isna().all()
    assert list(stood["run_as"]) == ["dp_kfac", "dp_kfac", "d_kfac"]
    for (_, p), r in stood.iterrows():
        twin = grid.loc[(r["run_as"], p)].set_index("lr_multiplier")
        assert r["final_acc"] == twin.loc[2, "final_acc"]
    grid = grid.reset_index()
    assert grid.groupby(["strategy", "world_size"])["chosen"].sum().eq(1).all()
    kfac4 = grid[(grid["world_size"] == 4) & (grid["strategy"] != "none")]
    assert kfac4["replicas_identical"].all()
    assert all(json.loads(v)["Linear"] <= 1.0 + 1e-9 for v in kfac4["fidelity_cosine"])
    assert (grid["pred_iteration_s"] > 0).all()
    md = (results / "convergence_scale.md").read_text().split("\n")
    assert md[2].startswith("**Takeaway (mnist1d_mlp).**")
    assert "so d_kfac's runs stand for 1 more of kaisa_mem_opt's grid points" in "\n".join(md)
    assert "so dp_kfac's runs stand for 1 more of d_kfac's grid points" in "\n".join(md)
    assert "Grid points in this table: 13 runs" in "\n".join(md)
    assert (results / "convergence_scale.png").exists()
    raw = pd.read_csv(results / "raw" / "convergence_scale.csv")
    assert (raw["cpu_capability"] == torch.backends.cpu.get_cpu_capability()).all()
    assert f"Machines: 13 on {raw['cpu'].iloc[0]} (" in "\n".join(md)


def test_the_time_sentence_when_sgd_takes_fewer_steps() -> None:
    """More steps for dp_kfac read as more, not as a fraction 'fewer' (P=256 on MNIST-1D)."""
    rows = _rows()
    _reach(rows, rows["strategy"] == "dp_kfac", 12)  # SGD: 6
    rows.loc[rows["strategy"] == "dp_kfac", "pred_iteration_s"] = 0.0012
    _, time = cs.takeaway(cs.cells_frame(cs.choose_lr(pages.ok_rows(rows, cs.TASK))))
    assert "x more steps, each 1.20x dearer, SGD's steps are fewer and cheaper (" in time
    assert "x fewer steps" not in time


def test_a_skipped_probe_counts_for_nothing_in_the_cosine() -> None:
    probes = [
        {"layer": "fc1", "cosine": 0.5},
        {"layer": "fc1", "cosine": math.nan},  # skipped (eigh did not converge)
        {"layer": "fc2", "cosine": math.nan},
    ]
    kinds = {"fc1": "Linear", "fc2": "Conv2d"}
    got = cs.fidelity_by_kind(probes, kinds)
    assert got["Linear"] == 0.5 and math.isnan(got["Conv2d"])


def test_ranks_in_one_process_resolve_auto_once(tmp_path: Path, monkeypatch: Any) -> None:
    """grouped_auto's choice is made once per process, not once per thread rank (at P=256
    the 256 resolutions ran one after another for over an hour before the first step);
    the run's own end-of-run replica check fails it if the ranks configured differently."""
    from dpkfac import placement

    calls = []
    real = placement.resolve

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["world_size"])
        return real(*args, **kwargs)

    monkeypatch.setattr(placement, "resolve", counted)
    placement._RESOLVED.clear()
    _trained(tmp_path, "grouped_auto", 4, steps=2)
    assert calls == [4]
