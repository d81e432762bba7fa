"""The benchmark's configs, and one real tiny sweep at world size 2.

The sweep goes through the real command line (Hydra multirun, the elastic
launcher starting two gloo ranks, every strategy interleaved in one job, the
table callback), then the bytes, calls
and wire bytes the ranks counted are compared with the cost model's
prediction, which must be exact. No wall time is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from experiments.bench.models import BUILDERS
from experiments.benchmark import job_spec
from experiments.tables import load_rows

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf" / "bench"


def _compose(*overrides: str):
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("benchmark", overrides=list(overrides))


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("model", _options("model"))
def test_every_model_config_composes(model: str) -> None:
    cfg = _compose(f"model={model}")
    assert cfg.model.kind in BUILDERS and cfg.model.name == model
    assert "batch_size" in cfg.model.kwargs


@pytest.mark.parametrize("table", _options("table"))
def test_every_table_preset_composes(table: str) -> None:
    cfg = _compose(f"table={table}")
    assert cfg.table_name == table


@pytest.mark.parametrize("strategy", _options("strategy"))
def test_practical_setting_measures_whole_cycles(strategy: str) -> None:
    spec = job_spec(_compose(f"strategy={strategy}", "setting=practical", "steps=4", "warmup=2"))
    cycle = 3 if spec["strategy"]["kfac"] is not None else 1
    assert spec["steps"] % cycle == 0 and spec["steps"] >= 4
    assert spec["warmup"] % cycle == 0 and spec["warmup"] >= 2
    assert (spec["factor_every"], spec["inv_every"]) == (10, 100)


def test_bad_task_is_rejected() -> None:
    with pytest.raises(ValueError, match="task"):
        job_spec(_compose("task=nope"))


@pytest.mark.distributed
def test_tiny_sweep_at_world_size_2_matches_cost_model_bytes(tmp_path: Path) -> None:
    from dpkfac.costmodel import PRESETS
    from experiments.bench.predict import byte_mismatches, predict_row

    sweep, results = tmp_path / "sweep", tmp_path / "results"
    cmd = [
        sys.executable,
        "-m",
        "experiments.benchmark",
        "-m",
        "model=mlp",
        "strategies=[sgd,dp-kfac,dp-kfac-owner,d-kfac,spd-kfac]",
        "world_size=2",
        "warmup=3",
        "steps=3",
        "isolate_comm=true",
        f"hydra.sweep.dir={sweep}",
        f"results_dir={results}",
        "+hydra.callbacks.table={_target_:experiments.tables.TableCallback,"
        "table:second_order_update}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = load_rows([sweep])
    assert list(rows["strategy"]) == ["sgd", "dp-kfac", "dp_kfac_owner", "d-kfac", "spd-kfac"]
    for row in rows.to_dict("records"):
        assert row["error"] == "", row["error"]
        assert row["world_size"] == 2 and row["backend"] == "gloo"
        assert row["measured_steps"] == 3
        prediction = predict_row(row, PRESETS["cpu_gloo_local"])
        assert byte_mismatches(row, prediction) == []
        assert prediction.memory_max == row["mem_kfac"]
        # Isolated communication: a timed barrier before each phase's collectives.
        assert row["isolate_comm"] and row["comm_sync_s"] > 0
        assert set(json.loads(row["least_wait"])) >= {"grad_comm", "precond_comm"}
    by = rows.set_index("strategy")
    assert by.loc["dp-kfac", "bytes_factor_allreduce"] == 0
    assert by.loc["spd-kfac", "bytes_factor_allreduce"] > 0
    assert by.loc["sgd", "bytes_second_order"] == 0 and by["interleaved"].all()
    assert (results / "second_order_update.md").exists()
    assert (results / "raw" / "second_order_update.csv").exists()


def test_interleaved_strategies_come_from_the_strategy_group() -> None:
    spec = job_spec(_compose("strategies=[sgd,dp-kfac-owner]", "setting=practical", "steps=1"))
    names = [s["name"] for s in spec["strategies"]]
    assert names == ["sgd", "dp_kfac_owner"]
    assert spec["strategies"][1]["kfac"]["grad_reduction"] == "owner"
    assert spec["steps"] == 3  # one whole cycle of decomposition, factor and plain steps
    with pytest.raises(ValueError, match="unknown strategy 'nope'"):
        job_spec(_compose("strategies=[nope]"))
