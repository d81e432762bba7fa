"""The benchmark's configs (the training side's tree), its checks, and real tiny runs.

The sweep goes through the real command line (Hydra multirun, the elastic
launcher starting two gloo ranks, every strategy config interleaved in one
job, the table callback), then the bytes, calls and wire bytes the ranks
counted are compared with the cost model's prediction, which must be exact.
No wall time is asserted.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from experiments.bench.run import compose_config, job_spec
from experiments.bench.tables import load_rows
from experiments.bench.workloads import build, row_model
from experiments.config import TABLE_TASKS, TABLES, ExperimentError
from experiments.preconditioning import uses_preconditioner

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
BENCHMARK_MODELS = ["bert_base", "bert_large", "mlp", "resnet110", "resnet32", "resnet50"]
BENCHMARK_MODELS += ["transformer"]


def _compose(*overrides: str):
    return compose_config("benchmark", overrides)


def _spec(*overrides: str) -> dict:
    return job_spec(_compose(*overrides), overrides)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _cli(*args: str, timeout: int = 240, probes: bool = False) -> subprocess.CompletedProcess:
    """``python -m experiments.bench ARGS``; without the job's probes unless a test reads them
    (they take seconds a job, most of a tiny model's)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "experiments.bench", *args, f"probes={str(probes).lower()}"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_one_tree() -> None:
    assert (CONF / "benchmark.yaml").exists() and not (CONF / "bench").exists()
    assert set(_options("workload")) == set(BENCHMARK_MODELS)
    assert set(BENCHMARK_MODELS) <= set(_options("model"))


@pytest.mark.parametrize("model", _options("workload"))
def test_every_model_config_composes_and_builds(model: str) -> None:
    cfg = _compose(f"model={model}")
    assert cfg.workload.name == model and cfg.workload.label
    assert cfg.workload.batch._target_.startswith("experiments.bench.workloads.")
    spec = job_spec(cfg)
    with torch.device("meta"):
        bench = build(spec["model"]["config"], spec["model"]["batch"])
    assert bench.batch_size == cfg.workload.batch.batch_size
    assert sum(p.numel() for p in bench.model.parameters()) > 0


@pytest.mark.parametrize("model", _options("workload"))
def test_benchmark_models_are_the_training_networks(model: str, compose) -> None:
    """``model=NAME`` is the same network in both entry points (the workload only resizes it)."""
    bench, train = _compose(f"model={model}").model, compose(f"model={model}", "~experiment").model
    assert bench._target_ == train._target_
    assert set(bench) == set(train)


@pytest.mark.parametrize("strategy", _options("strategy"))
def test_strategy_selects_the_training_arguments(strategy: str, compose) -> None:
    """``strategy=NAME`` gives the benchmark the preconditioner arguments training gets."""
    bench = _compose(f"strategy={strategy}").strategy
    assert bench == compose(f"strategy={strategy}", "~experiment").strategy
    assert bench.name == strategy


@pytest.mark.parametrize("table", _options("table"))
def test_every_table_preset_composes(table: str) -> None:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("benchmark", [f"table={table}"], return_hydra_config=True)
    assert cfg.table_name == table
    if cfg.task in TABLE_TASKS:  # one job that writes its table itself
        assert cfg.task == table and "table" not in cfg.hydra.callbacks
        return
    if TABLES[table].command:  # a driver of its own plans the runs (the convergence study)
        assert cfg.task == table and "table" not in cfg.hydra.callbacks
        assert TABLES[table].recipe.startswith("python -m experiments.bench.")
        return
    params = cfg.hydra.sweeper.params
    assert cfg.hydra.callbacks.table.table == table
    for name in [*(cfg.get("strategies") or []), *str(params.get("strategy", "")).split(",")]:
        assert not name or name in _options("strategy")
    for name in str(params.get("model", "")).split(","):
        assert not name or name in _options("workload")


@pytest.mark.parametrize("setting", _options("setting"))
def test_every_setting_composes(setting: str) -> None:
    spec = _spec(f"setting={setting}", "model=mlp")
    assert spec["setting"]["name"] == setting


def test_ablation_preset_states_every_switch() -> None:
    """The ablation's configs, in its order, each with its switches explicit (no defaults)."""
    spec = _spec("table=ablation", "model=resnet32", "setting=practical")
    kfac = {m["name"]: m["kfac"] for m in spec["strategies"]}
    assert list(kfac) == [
        "none",
        "d_kfac_eager",
        "d_kfac_triangle",
        "d_kfac_lazy",
        "spd_kfac",
        "kaisa_comm_opt",
        "kaisa_mem_opt",
        "dp_kfac",
        "dp_kfac_overlap",
        "dp_kfac_owner",
        "dp_kfac_owner_overlap",
        "dp_kfac_owner_ready",
        "grouped_local_decomp",
        "grouped_auto",
    ]
    assert kfac["none"] is None
    switches = ("triangle", "placement", "lazy_factor_sync")
    for name, want in (
        ("d_kfac_eager", (False, "lpt", False)),
        ("d_kfac_triangle", (True, "lpt", False)),
        ("d_kfac_lazy", (True, "lpt", True)),
    ):
        assert kfac[name]["strategy"] == "d_kfac"
        assert tuple(kfac[name][k] for k in switches) == want, name
    assert kfac["kaisa_comm_opt"]["grad_worker_fraction"] == "comm_opt"
    assert kfac["kaisa_mem_opt"]["grad_worker_fraction"] == "mem_opt"
    assert kfac["dp_kfac_owner"]["grad_reduction"] == "owner"
    assert kfac["dp_kfac_overlap"]["overlap"] is True
    owner_overlap = kfac["dp_kfac_owner_overlap"]
    assert (owner_overlap["grad_reduction"], owner_overlap["overlap"]) == ("owner", True)
    assert owner_overlap["drain"] == "last"
    ready = kfac["dp_kfac_owner_ready"]
    assert (ready["grad_reduction"], ready["overlap"], ready["drain"]) == ("owner", True, "ready")
    assert (
        kfac["grouped_local_decomp"]["factor_group_size"],
        kfac["grouped_local_decomp"]["grad_worker_fraction"],
    ) == (1, 1.0)
    assert kfac["grouped_auto"]["factor_group_size"] == "auto"
    assert spec["interleaved"] and spec["isolate_comm"] and spec["world_size"] == 2
    assert (spec["factor_update_steps"], spec["inv_update_steps"]) == (10, 100)


def test_probes_are_on_unless_turned_off() -> None:
    assert _spec()["probes"] is True
    assert _spec("probes=false")["probes"] is False


def test_workload_sets_what_k_fac_sees() -> None:
    """Sequence models average positions; only the Transformer's vocabulary layers are skipped."""
    spec = _spec("model=transformer")
    (member,) = spec["strategies"]
    assert member["kfac"]["weight_sharing"] == "reduce"
    assert member["kfac"]["skip_layers"] == ["embed", "generator"]
    # The command line still wins over the workload.
    spec = _spec("model=transformer", "strategy.weight_sharing=expand")
    assert spec["strategies"][0]["kfac"]["weight_sharing"] == "expand"


@pytest.mark.parametrize("strategy", _options("strategy"))
def test_practical_setting_measures_whole_cycles(strategy: str) -> None:
    spec = _spec(f"strategy={strategy}", "setting=practical", "steps=4", "warmup=2")
    cycle = 4 if spec["strategies"][0]["kfac"] is not None else 1  # plain twice a cycle
    assert spec["steps"] % cycle == 0 and spec["steps"] >= 4
    assert spec["warmup"] % cycle == 0 and spec["warmup"] >= 2
    assert (spec["factor_update_steps"], spec["inv_update_steps"]) == (10, 100)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("task=nope", "task='nope'"),
        ("world_size=0", "world_size=0"),
        ("steps=0", "steps=0"),
        ("strategy.assignment=random", "strategy.assignment='random'"),
        ("strategy.damping=-1", "strategy.damping=-1"),
        ("factor_kernels.reps=0", "factor_kernels.reps=0"),
        ("factor_kernels.threads=[]", "factor_kernels.threads=[]"),
        ("fidelity.every=0", "fidelity.every=0"),
        ("probes=sometimes", "probes='sometimes'"),
        ("trace=1", "trace=1"),
    ],
)
def test_bad_values_are_named(override: str, named: str) -> None:
    with pytest.raises(ExperimentError, match=f"^invalid value {re.escape(named)}"):
        _spec(override)


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["fidelity.runs=[digits_cnn,nope]"], "fidelity.runs=['digits_cnn', 'nope']"),
        (["fidelity.runs=[]"], "fidelity.runs=[]"),
        (["fidelity.steps.digits_cnn=0"], "fidelity.steps.digits_cnn=0"),
    ],
)
def test_bad_fidelity_runs_are_named(overrides: list[str], named: str) -> None:
    from experiments.bench.run import run_table_task

    with pytest.raises(ExperimentError, match=f"^invalid value {re.escape(named)}"):
        run_table_task(_compose("table=fidelity", *overrides))


def test_update_intervals_come_from_the_setting() -> None:
    """Strategy configs leave the intervals null; an explicit one must agree with the setting."""
    for name in _options("strategy"):
        node = _compose(f"strategy={name}").strategy
        assert node.get("factor_update_steps") is None, name
        assert node.get("inv_update_steps") is None, name
    spec = _spec(
        "setting=practical", "strategy.factor_update_steps=10", "strategy.inv_update_steps=100"
    )
    assert (spec["factor_update_steps"], spec["inv_update_steps"]) == (10, 100)
    assert "inv_update_steps" not in spec["strategies"][0]["kfac"]  # the setting's, as schedules
    assert _spec("setting=paper", "strategy.factor_update_steps=1")["factor_update_steps"] == 1
    # The training default (every step) set explicitly, as a common config would: refused.
    with pytest.raises(
        ExperimentError,
        match=re.escape(
            "invalid value strategy.factor_update_steps=1: the benchmark takes its update "
            "intervals from setting=practical, where setting.factor_update_steps=10; drop the "
            "strategy's value (leave it null) or ask for that interval through the setting "
            "(setting=<name> of conf/setting/ or setting.factor_update_steps=1)"
        ),
    ):
        _spec("setting=practical", "strategy.factor_update_steps=1")
    with pytest.raises(ExperimentError, match=r"^invalid value strategy\.inv_update_steps=5: "):
        _spec("strategies=[dp_kfac,d_kfac]", "strategy.inv_update_steps=5")
    # Asking through the setting instead works.
    spec = _spec("setting.inv_update_steps=5")
    assert (spec["factor_update_steps"], spec["inv_update_steps"]) == (1, 5)
    # Only timing jobs take the setting's intervals.
    _spec("task=convergence", "setting=practical", "strategy.factor_update_steps=1")


def test_an_interval_schedule_contradicts_the_setting_too() -> None:
    from omegaconf import OmegaConf

    from experiments.config import check_update_intervals

    setting = OmegaConf.create({"name": "paper", "factor_update_steps": 1, "inv_update_steps": 1})
    schedule = {"_target_": "experiments.schedules.kfac_schedule", "base": 5, "gamma": 2}
    strategy = OmegaConf.create({"name": "x", "inv_update_steps": schedule})
    with pytest.raises(ExperimentError, match=r"strategy\.inv_update_steps=\{'_target_'"):
        check_update_intervals(strategy, setting)
    check_update_intervals(OmegaConf.create({"name": "x", "inv_update_steps": 1}), setting)


def test_cli_refuses_an_interval_the_setting_contradicts(tmp_path: Path) -> None:
    proc = _cli(
        "model=mlp",
        "setting=practical",
        "strategy.inv_update_steps=1",
        f"hydra.run.dir={tmp_path}",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: invalid value strategy.inv_update_steps=1: ")
    assert "setting=practical, where setting.inv_update_steps=100" in line
    assert not (tmp_path / "rows.json").exists()


def test_interleaved_strategies_come_from_the_strategy_group() -> None:
    spec = _spec("strategies=[none,dp_kfac_owner]", "setting=practical", "steps=1")
    names = [s["name"] for s in spec["strategies"]]
    assert names == ["none", "dp_kfac_owner"]
    assert spec["strategies"][0]["kfac"] is None
    assert spec["strategies"][1]["kfac"]["strategy"] == "dp_kfac"
    assert spec["strategies"][1]["kfac"]["grad_reduction"] == "owner"
    assert spec["steps"] == 4  # one whole cycle: decomposition, factor and two plain steps
    # Each entry is composed as the job would be with strategy=<entry>.
    single = _spec("strategy=dp_kfac_owner", "setting=practical", "steps=1")
    assert single["strategies"][0] == spec["strategies"][1]
    with pytest.raises(ExperimentError, match="strategy=nope"):
        _spec("strategies=[nope]")
    with pytest.raises(ExperimentError, match="task=timing only"):
        _spec("strategies=[none]", "task=convergence")


def test_convergence_runs_the_training_preset() -> None:
    """The convergence job trains the digits_cnn preset with its own values."""
    spec = _spec("task=convergence", "strategy=d_kfac")
    train = spec["train_config"]
    assert train["name"] == "digits_cnn"
    assert (train["optimizer"]["lr"], train["strategy"]["damping"]) == (0.02, 0.1)
    assert train["strategy"]["name"] == "d_kfac" and train["logger"]["_target_"].endswith(
        "NullLogger"
    )
    assert train["trainer"]["max_epochs"] == 10


def test_cli_rejects_a_bad_strategy_option_in_one_line(tmp_path: Path) -> None:
    proc = _cli("model=mlp", "strategy.assignment=random", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: invalid value strategy.assignment='random': ")
    assert "round_robin" in lines[0]
    assert not (tmp_path / "rows.json").exists()


@pytest.mark.distributed
def test_one_job_from_the_command_line(tmp_path: Path) -> None:
    """``python -m experiments.bench strategy=dp_kfac model=M world_size=2`` writes a row."""
    proc = _cli("strategy=dp_kfac", "model=mlp", "world_size=2", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads((tmp_path / "rows.json").read_text())
    assert row["error"] == "" and row["strategy"] == "dp_kfac" and row["world_size"] == 2
    options = json.loads(row["kfac_options"])
    assert options["strategy"] == "dp_kfac" and options["damping"] == 0.003
    assert row["bytes_factor_allreduce"] == 0 and row["bytes_precond_broadcast"] > 0
    bench = row_model(row)
    assert sum(p.numel() for p in bench.model.parameters()) == row["params"]
    assert "mlp dp_kfac P=2 paper: iteration" in proc.stdout


@pytest.mark.distributed
def test_convergence_job_trains_through_the_training_entry_point(tmp_path: Path) -> None:
    proc = _cli(
        "task=convergence",
        "strategy=dp_kfac_owner",
        "world_size=2",
        'convergence.overrides=["trainer.max_epochs=2"]',
        f"hydra.run.dir={tmp_path}",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads((tmp_path / "rows.json").read_text())
    assert row["error"] == "" and row["strategy"] == "dp_kfac_owner" and row["epochs"] == 2
    curve = json.loads(row["curve"])
    assert [p["epoch"] for p in curve] == [1.0, 2.0]
    assert row["final_acc"] == curve[-1]["test_acc"] > 0.5
    assert row["replicas_identical"]
    metrics = json.loads((tmp_path / "train" / "metrics.json").read_text())
    assert metrics["final"]["strategy"] == "dp_kfac_owner"
    assert metrics["final"]["world_size"] == 2


@pytest.mark.distributed
def test_tiny_sweep_at_world_size_2_matches_cost_model_bytes(tmp_path: Path) -> None:
    from dpkfac.costmodel import PRESETS
    from experiments.bench.predict import byte_mismatches, predict_row

    sweep, results = tmp_path / "sweep", tmp_path / "results"
    proc = _cli(
        "-m",
        "model=mlp",
        "strategies=[none,dp_kfac,dp_kfac_owner,d_kfac,spd_kfac]",
        "world_size=2",
        "warmup=3",
        "steps=3",
        "isolate_comm=true",
        f"hydra.sweep.dir={sweep}",
        f"results_dir={results}",
        "+hydra.callbacks.table={_target_:experiments.bench.tables.TableCallback,"
        "table:second_order_update}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = load_rows([sweep])
    assert list(rows["strategy"]) == ["none", "dp_kfac", "dp_kfac_owner", "d_kfac", "spd_kfac"]
    for row in rows.to_dict("records"):
        assert row["error"] == "", row["error"]
        assert row["world_size"] == 2 and row["backend"] == "gloo"
        assert row["measured_steps"] == 3
        prediction = predict_row(row, PRESETS["cpu_gloo_local"])
        assert byte_mismatches(row, prediction) == []
        assert prediction.memory_max == row["mem_kfac"]
        # Isolated communication: a timed barrier before each phase's collectives; SGD is
        # DDP, whose all-reduces run inside the backward pass and are never isolated.
        sgd = row["strategy"] == "none"
        assert row["isolate_comm"] and (row["comm_sync_s"] == 0 if sgd else row["comm_sync_s"] > 0)
        if sgd:
            assert row["bytes_grad_allreduce"] == 4 * row["params"]  # DDP's buckets: each once
            # Its pass again without reductions, after the step's record (whose tally still
            # holds the gradients: DDP's buckets).
            assert 0 < row["fwd_bwd_local_s"] < row["iteration_s"]
            assert row["mem_process_gradients"] == 4 * row["params"]
        else:
            assert math.isnan(row["fwd_bwd_local_s"])  # only DDP SGD runs it
        assert set(json.loads(row["least_wait"])) >= {"grad_comm", "precond_comm"}
    by = rows.set_index("strategy")
    assert by.loc["dp_kfac", "bytes_factor_allreduce"] == 0
    assert by.loc["spd_kfac", "bytes_factor_allreduce"] > 0
    assert by.loc["none", "bytes_second_order"] == 0 and by["interleaved"].all()
    assert json.loads(by.loc["none", "kfac_options"]) is None
    assert (results / "second_order_update.md").exists()
    assert (results / "raw" / "second_order_update.csv").exists()


def test_fidelity_preset_dispatches_to_its_runs(tmp_path: Path, monkeypatch) -> None:
    """``table=fidelity``: the node's runs and steps, world_size ranks, the job's strategy."""
    from experiments.bench import fidelity
    from experiments.bench.run import run_table_task

    calls = []

    def fake_run(name, overrides, *, nproc, steps, every, strategy, out, timeout):
        calls.append((name, nproc, steps, every, strategy, timeout))
        layer = {"digits_cnn": "features.0", "resnet20_fake_cifar": "fc"}[name]
        return [
            {"run": name, "world_size": nproc, "strategy": strategy, "step": s, "layer": layer}
            | {"cosine": 0.9, "rel_error": 0.1}
            for s in (1, 3)
        ]

    monkeypatch.setattr(fidelity, "train_run", fake_run)
    cfg = _compose("table=fidelity", "strategy=dp_kfac_owner", f"results_dir={tmp_path}")
    assert cfg.task == "fidelity"
    paths = run_table_task(cfg)
    assert calls == [
        ("digits_cnn", 2, 200, 2, "dp_kfac_owner", 600.0),
        ("resnet20_fake_cifar", 2, 60, 2, "dp_kfac_owner", 600.0),
    ]
    assert paths == {
        "csv": tmp_path / "fidelity.csv",
        "png": tmp_path / "fidelity.png",
        "md": tmp_path / "fidelity.md",
    }
    assert paths["md"].read_text().split("\n")[2].startswith("**Takeaway.** At P=2")
    lines = paths["csv"].read_text().splitlines()
    assert lines[0] == ",".join(fidelity.FIELDS) and len(lines) == 5
    # The fake runs name no machine: their machine cells stay empty.
    assert lines[1] == "digits_cnn,2,dp_kfac_owner,1,features.0,0.9,0.1" + "," * 6
    assert paths["png"].stat().st_size > 0
    # The node's keys are the old script's options.
    calls.clear()
    cfg = _compose(
        "table=fidelity",
        "fidelity.runs=[resnet20_fake_cifar]",
        "fidelity.steps.resnet20_fake_cifar=8",
        "fidelity.every=4",
        "world_size=3",
        f"results_dir={tmp_path}",
    )
    run_table_task(cfg)
    assert calls == [("resnet20_fake_cifar", 3, 8, 4, "dp_kfac", 600.0)]


def test_factor_kernels_preset_prints_and_keeps_its_report(tmp_path: Path) -> None:
    """``table=factor_kernels``, tiny: the report is printed and kept in results_dir."""
    proc = _cli(
        "table=factor_kernels",
        "factor_kernels.batch=2",
        "factor_kernels.reps=1",
        "factor_kernels.threads=[1]",
        f"results_dir={tmp_path}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = (tmp_path / "factor_kernels.txt").read_text()
    assert report.startswith("== 1 thread(s), batch 2, float32, median of 1 (ms) ==\n")
    assert "\nlinear 64->10 " in report and "totals over all layers (ms):" in report
    assert "  A+G auto_bf16 " in report and report.rstrip().endswith("x)")
    assert report.strip() in proc.stdout


@pytest.mark.distributed
def test_fidelity_preset_from_the_command_line(tmp_path: Path) -> None:
    """``table=fidelity``, tiny: a real probed digits_cnn run on two ranks."""
    proc = _cli(
        "table=fidelity",
        "fidelity.runs=[digits_cnn]",
        "fidelity.steps.digits_cnn=4",
        f"results_dir={tmp_path}",
        f"hydra.run.dir={tmp_path / 'run'}",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp_path / "fidelity.csv").read_text().splitlines()
    assert lines[0] == "run,world_size,strategy,step,layer,cosine,rel_error," + (
        "cpus,cpu,cpu_isa,cpu_capability,torch,time"
    )
    # A real run names its machine (experiments.bench.machine), which the page then names.
    rows = pd.read_csv(tmp_path / "fidelity.csv")
    assert rows["cpu"].notna().all() and (rows["cpus"] > 0).all()
    answer = (tmp_path / "fidelity.md").read_text().split("\n\n")[1]
    assert f"Measured on one machine: {rows['cpu'].iloc[0]}, " in answer
    # Probes at preconditioner steps 0 and 2, logged at optimizer steps 1 and 3.
    assert [line.split(",")[:4] for line in lines[1:]] == [
        ["digits_cnn", "2", "dp_kfac", "1"],
        ["digits_cnn", "2", "dp_kfac", "3"],
    ]
    assert (tmp_path / "fidelity.png").stat().st_size > 0
    assert "digits_cnn: 4 steps on 2 rank(s)" in proc.stdout


def test_uses_preconditioner_reads_the_config() -> None:
    assert not uses_preconditioner(_compose("strategy=none").strategy)
    assert uses_preconditioner(_compose("strategy=spd_kfac").strategy)
