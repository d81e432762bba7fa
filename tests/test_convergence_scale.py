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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from experiments.bench import convergence_scale as cs
from experiments.bench import tables
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
    assert node.evals_per_epoch == 20 and node.damping is None
    # Two targets per experiment, fixed before the runs; the verdict's margins too.
    assert {m: list(t) for m, t in node.targets.items()} == {
        "mnist1d_mlp": [0.85, 0.95],
        "mnist1d_cnn": [0.95, 0.98],
        "digits_cnn": [0.95, 0.97],
    }
    assert list(node.verdict.steps_ratio) == [0.8, 1.25] and node.verdict.final_acc == 0.01
    assert dict(node.max_world_size) == {"digits_cnn": 16}
    assert list(node.overrides) == ["data.val_fraction=0.1"]  # lr chosen on validation
    assert list(node.study.strategies) == [
        "none",
        "dp_kfac",
        "d_kfac",
        "kaisa_mem_opt",
        "grouped_auto",
    ]
    assert list(node.study.world_sizes) == [64, 4, 16, 256, 1]  # tuned sizes first
    assert list(node.tuning.damping) == [0.001, 0.003, 0.01, 0.03]
    assert dict(node.tuning.paired) == {"mnist1d_mlp": [16, 64, 256], "mnist1d_cnn": [16, 64, 256]}
    assert node.tuning.paired_seeds >= 8 and node.tuning.final_seeds >= 3


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
        ("convergence_scale.targets.mnist1d_mlp=[0.95,0.9]", "convergence_scale.targets="),
        ("convergence_scale.damping=-0.01", "convergence_scale.damping=-0.01"),
        ("convergence_scale.evals_per_epoch=0", "convergence_scale.evals_per_epoch=0"),
        ("convergence_scale.max_world_size={digits_cnn:0}", "convergence_scale.max_world_size="),
        ("convergence_scale.one_rank_kfac=none", "convergence_scale.one_rank_kfac='none'"),
        ("convergence_scale.one_rank_kfac=dp-kfac", "convergence_scale.one_rank_kfac='dp-kfac'"),
        ("+convergence_scale.same_step.kaisa=d_kfac", "convergence_scale.same_step="),
        ("convergence_scale.same_step.kaisa_mem_opt=kaisa_mem_opt", "convergence_scale.same_step="),
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
    assert cs.skip_reason(_compose("world_size=256", "seed=5")) is None
    limited = _compose("world_size=64", "+convergence_scale.max_world_size.mnist1d_mlp=16")
    assert "up to P=16" in str(cs.skip_reason(limited))
    assert cs.targets_of({"targets": {"m": 0.9}}, "m") == (0.9, 0.9)
    with pytest.raises(ValueError, match="low, high"):
        cs.targets_of({"targets": {"m": [0.9, 0.8]}}, "m")


def test_the_job_trains_what_the_study_fixes_and_prices_it(tmp_path: Path) -> None:
    """The training config of a job, and the cost model's price of its step, without training."""
    fake = 'convergence_scale.overrides=["data.fake=true"]'
    cfg = _compose(
        "strategy=grouped_auto", "world_size=64", "convergence_scale.lr_multiplier=0.5", fake
    )
    train = cs.training_config(cfg, tmp_path, eval_every_steps=3)
    assert train.trainer.eval_every_steps == 3
    assert train.launcher.name == "threads" and train.launcher.world_size == 64
    assert train.data.batch_size == 16 and train.optimizer.lr == pytest.approx(0.05 * 16 * 0.5)
    assert not train.trainer.scale_lr and train.trainer.check_replicas
    assert train.strategy.fidelity_every == 20 and train.strategy.hardware == "v100_ib100"
    model, x, steps_per_epoch = cs.model_and_input(train)
    # 400 generated samples, 320 of them training: 320 // 64 ranks // 16 per rank = 0 steps,
    # and at P=2, 10 (what sets the evaluation interval).
    assert steps_per_epoch == 0
    two = cs.training_config(_compose("strategy=dp_kfac", "world_size=2", fake), tmp_path)
    assert cs.model_and_input(two)[2] == 10
    damped = cs.training_config(
        _compose("strategy=dp_kfac", "convergence_scale.damping=0.003", fake), tmp_path
    )
    assert damped.strategy.damping == 0.003
    grouped = cs.predicted_iteration(train, 64, "v100_ib100", model, x)
    assert grouped["pred_iteration_s"] > 0 and "factor_group_size=" in grouped["pred_chosen"]
    sgd_train = cs.training_config(_compose("strategy=none", "world_size=64", fake), tmp_path)
    assert "fidelity_every" not in sgd_train.strategy
    sgd = cs.predicted_iteration(sgd_train, 64, "v100_ib100", model, x)
    assert 0 < sgd["pred_iteration_s"] < grouped["pred_iteration_s"]
    assert cs.layer_kinds(model)["0"] == "Linear"


def _sweep_strategies() -> list[str]:
    return list(_compose().convergence_scale.study.strategies)


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
    """What lets the protocol run every other K-FAC configuration once at P=1
    (``one_rank_kfac``, a same-step check): each of the study's K-FAC configurations,
    trained 12 steps by the job's own training config on one rank, ends with bitwise the
    same parameters, optimizer state and history as dp_kfac."""
    from experiments.bench.tuning import Planner, Protocol

    states = {}
    for strategy in _sweep_strategies():
        if strategy != "none":
            states[strategy] = _trained(tmp_path, strategy, 1)
    reference = states.pop("dp_kfac")
    assert len(states) >= 3
    for strategy, state in states.items():
        _assert_same_step(reference, state, strategy)
    node = _compose().convergence_scale
    planner = Planner(
        Protocol(), {}, same_step=dict(node.same_step), one_rank_kfac=node.one_rank_kfac
    )
    assert all(planner.twin(s, 1) == "dp_kfac" for s in states)
    assert planner.twin("dp_kfac", 1) is None and planner.twin("none", 1) is None
    assert planner.twin("d_kfac", 4) is None and planner.twin("kaisa_mem_opt", 4) == "d_kfac"


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
#: The study the writer tests plan: one model, P in {4, 16}, SGD and the paired pair.
_STUDY = [
    "convergence_scale.study.experiments=[mnist1d_mlp]",
    "convergence_scale.study.world_sizes=[4,16]",
    "convergence_scale.study.strategies=[none,dp_kfac,d_kfac]",
    "convergence_scale.tuning.damping_at=[4]",
    "convergence_scale.tuning.paired={mnist1d_mlp:[16]}",
    "convergence_scale.tuning.paired_seeds=4",
]


def _row(point: Any, val: float, steps: float, pred_s: float, spe: int = 100) -> dict[str, Any]:
    """A finished run: its test accuracy climbs to ``val`` and crosses 0.85 at ``steps``."""
    every = max(1, spe // 20)
    curve = [
        {
            "step": k * every,
            "epoch": k * every / spe,
            "test_acc": val if k * every >= steps else 0.8,
            "val_acc": val if k * every >= steps else 0.8,
            "train_loss": 0.3,
        }
        for k in range(1, 20 * 20 + 1)
    ]
    return {
        "task": "convergence_scale",
        "model": point.model,
        "label": "MLP",
        "strategy": point.strategy,
        "world_size": point.world_size,
        "seed": point.seed,
        "batch_size": 16,
        "global_batch": 16 * point.world_size,
        "lr_multiplier": point.lr_multiplier,
        "damping": point.damping,
        "lr": 0.0125 * point.world_size * point.lr_multiplier,
        "target": 0.85,
        "target_high": 0.95,
        "steps_per_epoch": spe,
        "eval_every_steps": every,
        "steps": 20 * spe,
        "epochs": 20.0,
        "final_acc": val,
        "final_val_acc": val,
        "curve": json.dumps(curve),
        "fidelity_cosine": "{}",
        "step_s": 0.01,
        "seconds": 10.0,
        "replicas_identical": True,
        "pred_iteration_s": pred_s,
        "pred_hardware": "v100_ib100",
        "pred_chosen": "",
        "cpu": "CPU X",
        "cpu_capability": "AVX2",
        "cpus": 2,
        "time": f"2026-01-01T00:00:{point.seed:02d}",
        "stage": point.stage,
        "error": "",
    }


def _study_rows(dp_steps: Callable[[int], float]) -> pd.DataFrame:
    """Rows of the whole (small) study, made by driving the protocol to its end: the best
    learning rate is x2 for SGD and x1 for K-FAC, the best damping 0.003; K-FAC's steps
    to target are 600 at P=4 and 300 at P=16 (dp_kfac's: ``dp_steps(seed)`` at P=16),
    SGD's twice as many, each K-FAC step 1.5x SGD's price."""
    from experiments.bench.tuning import pending, plan_study

    node = cs.study_node(_STUDY)
    rows: list[dict[str, Any]] = []
    for _ in range(40):
        _, plans = plan_study(node, rows)
        todo = pending(plans)
        if not todo:
            return pd.DataFrame(rows)
        for pt in todo:
            best = 2.0 if pt.strategy == "none" else 1.0
            val = 0.96 - 0.02 * math.log2(pt.lr_multiplier / best) ** 2 + 0.0001 * pt.seed
            if pt.damping == pt.damping:
                val -= 0.01 * math.log10(pt.damping / 0.003) ** 2
            steps = 600 if pt.world_size == 4 else 300
            if pt.strategy == "dp_kfac" and pt.world_size == 16:
                steps = dp_steps(pt.seed)
            if pt.strategy == "none":
                steps *= 2
            rows.append(_row(pt, val, steps, 0.001 if pt.strategy == "none" else 0.0015))
    raise AssertionError("the protocol did not finish")


def test_the_page_answers_first_from_the_protocols_choices(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Synthetic rows of a finished study: the page's first lines are the paired verdict and
    the time to target against SGD, every figure recomputed from the rows."""
    monkeypatch.setattr(cs, "study_node", lambda overrides=(): _compose_node(_STUDY))
    rows = _study_rows(lambda seed: 300 + 5 * seed)  # within 2% of d_kfac's 300
    paths = tables.write_table("convergence_scale", rows, tmp_path)
    cells = pd.read_csv(paths["cells"]).set_index(["strategy", "P"])
    assert (
        cells.loc[("none", 4), "lr_multiplier"],
        cells.loc[("dp_kfac", 4), "lr_multiplier"],
    ) == (2.0, 1.0)
    assert cells.loc[("dp_kfac", 4), "damping"] == 0.003  # tuned at P=4 ...
    assert cells.loc[("dp_kfac", 16), "damping"] == 0.003  # ... and used at P=16
    dp16 = cells.loc[("dp_kfac", 16)]
    assert dp16["seeds"] == 4 and dp16["pairs"] == 4
    assert dp16["steps_ratio"] == pytest.approx((300 + 7.5) / 300, abs=0.01)
    assert dp16["steps_verdict"] == "equivalent" and dp16["acc_verdict"] == "equivalent"
    # Time to target: half SGD's steps at 1.5x its step price -> 0.75x its time; break-even 2x.
    assert cells.loc[("d_kfac", 4), "break_even"] == pytest.approx(2.0)
    assert cells.loc[("d_kfac", 4), "time_ratio_vs_sgd"] == pytest.approx(0.75)
    md = paths["md"].read_text().split("\n")
    answer = md[2 : md.index("![convergence_scale](convergence_scale.png)")]
    assert 1 <= len([x for x in answer if x]) <= 5
    assert answer[0].startswith("**mnist1d_mlp, dp_kfac against d_kfac**")
    assert "P=16: steps equivalent (1.02×" in answer[0]
    assert "dp_kfac beats SGD" in answer[1] and "break-even 2.00×" in answer[1]
    for line in md:
        if line.startswith("| configuration"):
            assert line.count("|") - 1 <= 8  # at most 8 columns
    decisions = pd.read_csv(paths["decisions"])
    assert set(decisions["stage"]) >= {"lr", "damping", "final"}
    assert decisions["reason"].notna().all()
    runs = pd.read_csv(paths["csv"])
    assert len(runs) == len(rows) and set(runs["stage"]) >= {
        "lr",
        "damping",
        "final",
        "paired seeds",
    }
    assert paths["png"].exists()
    line = cs.headline(pd.read_csv(paths["cells"]))
    assert line is not None and "steps equivalent" in line


def _compose_node(overrides: list[str]) -> dict[str, Any]:
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(_compose(*overrides).convergence_scale, resolve=True)
    assert isinstance(node, dict)
    return node


def test_a_late_dp_kfac_is_worse_and_a_noisy_one_inconclusive(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(cs, "study_node", lambda overrides=(): _compose_node(_STUDY))
    late = tables.write_table(
        "convergence_scale", _study_rows(lambda seed: 450 + seed), tmp_path / "a"
    )
    dp16 = pd.read_csv(late["cells"]).set_index(["strategy", "P"]).loc[("dp_kfac", 16)]
    assert dp16["steps_verdict"] == "worse" and dp16["steps_ratio_low"] > 1.25
    noisy = tables.write_table(
        "convergence_scale", _study_rows(lambda seed: [200, 420, 260, 380][seed]), tmp_path / "b"
    )
    dp16 = pd.read_csv(noisy["cells"]).set_index(["strategy", "P"]).loc[("dp_kfac", 16)]
    assert dp16["steps_verdict"] == "inconclusive"


def test_a_page_before_any_choice_says_so(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(cs, "study_node", lambda overrides=(): _compose_node(_STUDY))
    rows = _study_rows(lambda seed: 300).iloc[:2]  # two screening runs only
    paths = tables.write_table("convergence_scale", rows, tmp_path)
    md = paths["md"].read_text()
    assert "No answer yet" in md.split("\n")[2]
    assert "in progress" in md
    line = cs.headline(pd.read_csv(paths["cells"]))
    assert line is not None and "in progress: 2 runs so far, 0 of 1 cells" in line
    empty = tables.write_table("convergence_scale", rows.iloc[:0], tmp_path / "none")
    assert "No run of the tuning protocol yet" in empty["md"].read_text()


def test_the_driver_runs_the_protocol_to_its_end(tmp_path: Path) -> None:
    """``python -m experiments.bench.tune`` in-process on 400 generated samples, one epoch:
    a reduced protocol at P=2 for SGD and dp_kfac; every run is appended as it ends, and
    a second driver on the same rows finds nothing left to do."""
    from experiments.bench import tune

    rows = tmp_path / "rows.csv"
    args = [
        "--rows",
        str(rows),
        "--workdir",
        str(tmp_path / "work"),
        "convergence_scale.study.experiments=[mnist1d_mlp]",
        "convergence_scale.study.world_sizes=[2]",
        "convergence_scale.study.strategies=[none,dp_kfac]",
        "convergence_scale.tuning.damping_at=[2]",
        "convergence_scale.tuning.damping=[0.01,0.03]",
        "convergence_scale.tuning.max_points=3",
        "convergence_scale.tuning.finalists=1",
        "convergence_scale.tuning.final_seeds=2",
        "convergence_scale.tuning.paired={}",
        "convergence_scale.tuning.chance=0.0",
        "convergence_scale.tuning.chance_margin=0.0",
        "convergence_scale.evals_per_epoch=4",
        'convergence_scale.overrides=["data.fake=true","trainer.max_epochs=1","data.val_fraction=0.1"]',
        "convergence_scale.fidelity_every=0",
    ]
    assert tune.main(args) == 0
    done = pd.read_csv(rows)
    assert (done["error"].isna() | (done["error"] == "")).all()
    assert set(done["strategy"]) == {"none", "dp_kfac"}
    assert done.loc[done["strategy"] == "none", "damping"].isna().all()
    kfac = done[done["strategy"] == "dp_kfac"]
    assert set(kfac["damping"]) >= {0.01, 0.03}  # damping searched
    assert (done["eval_every_steps"] >= 1).all() and set(done["stage"]) >= {"lr", "final"}
    for _, g in done.groupby("strategy"):
        assert set(g["seed"]) == {0, 1}  # the finalist ran its seeds
    before = len(done)
    assert tune.main([*args, "--max-runs", "1"]) == 0
    assert len(pd.read_csv(rows)) == before  # nothing left


def test_a_seed_gives_every_method_the_same_model_and_data(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """What pairs the seeds: with one seed, SGD, dp_kfac and d_kfac start from the same
    parameters and see the same batches on every rank, bitwise (recorded at the training
    step itself, P=2 threads)."""
    from experiments import trainer
    from experiments.train import run

    seen: dict[str, dict[int, list[torch.Tensor]]] = {}
    real = trainer.Trainer.train_step

    def recording(self: Any, batches: list[Any]) -> Any:
        mine = seen[current].setdefault(self.env.rank, [])
        if not mine:
            mine += [p.detach().clone() for p in self.model.parameters()]
        mine += [t.clone() for b in batches for t in b]
        return real(self, batches)

    monkeypatch.setattr(trainer.Trainer, "train_step", recording)
    for current in ("none", "dp_kfac", "d_kfac"):
        seen[current] = {}
        overrides = 'convergence_scale.overrides=["data.fake=true","trainer.max_steps=3"]'
        cfg = _compose(f"strategy={current}", "world_size=2", "seed=7", overrides)
        run(cs.training_config(cfg, tmp_path / current))
    for rank in (0, 1):
        reference = seen["none"][rank]
        assert len(reference) > 4
        for other in ("dp_kfac", "d_kfac"):
            assert all(torch.equal(a, b) for a, b in zip(reference, seen[other][rank], strict=True))
    assert not torch.equal(seen["none"][0][-1], seen["none"][1][-1])  # ranks see their own shards


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
    row = pd.DataFrame(
        [{"curve": json.dumps(curve), "target": 0.95, "target_high": 0.96, "steps_to_target": 20.0}]
    )
    fixed = cs.with_steps_to_target(row)
    assert (fixed.at[0, "steps_to_target"], fixed.at[0, "epochs_to_target"]) == (60.0, 6.0)
    assert fixed.at[0, "steps_to_high"] == 60.0


def test_the_machine_columns_name_the_cpu_and_torchs_kernels() -> None:
    """What tells two machines' bitwise-different runs apart is in every row."""
    from experiments.bench.machine import machine

    where = machine()
    assert where["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert where["cpu"] and where["cpus"] == os.cpu_count()
    assert where["torch"] == torch.__version__


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
    real = placement.choose_options

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs["world_size"])
        return real(*args, **kwargs)

    monkeypatch.setattr(placement, "choose_options", counted)
    placement._RESOLVED.clear()
    _trained(tmp_path, "grouped_auto", 4, steps=2)
    assert calls == [4]


def test_a_study_in_progress_keeps_one_column_per_heading(tmp_path: Path) -> None:
    """The committed rows (a study under way: some cells chosen, others still running) give
    main tables of at most 8 columns, each heading once (a chosen and an unchosen row once
    made two "steps to target" columns)."""
    raw = Path(__file__).resolve().parents[1] / "results" / "raw" / "convergence_scale.csv"
    md = tables.write_table("convergence_scale", pd.read_csv(raw), tmp_path)["md"].read_text()
    headers = [line for line in md.split("\n") if line.startswith("| configuration")]
    assert headers
    for line in headers:
        names = [c.strip() for c in line.strip("|").split("|")]
        assert len(names) <= 8 and len(names) == len(set(names)), line
