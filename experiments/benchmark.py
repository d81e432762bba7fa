"""Hydra entry point: ``python -m experiments.benchmark [overrides]``.

Measures, for one model, strategy (or several, interleaved step by step:
``strategies=[sgd,dp-kfac,d-kfac]``), world size and update setting, the
seconds of every phase of an iteration (forward/backward, gradient
communication, factor computation and communication, decomposition and its
communication, preconditioning and its communication, the optimizer step),
the bytes of every collective category and the K-FAC memory of the busiest
rank, and writes one row per strategy (``rows.json`` in the job's output folder).

The job starts its own ``world_size`` local ranks through torch's elastic
launcher (:mod:`experiments.bench.launch`), so a Hydra multirun sweeps world
sizes without a shell loop::

    python -m experiments.benchmark model=resnet32 strategy=d-kfac world_size=2
    python -m experiments.benchmark -m model=resnet32,bert_base strategy=dp-kfac,d-kfac
    python -m experiments.benchmark -m table=second_order_update

Under ``torchrun --nproc_per_node=N -m experiments.benchmark world_size=N``
every rank measures itself and rank 0 writes the row. ``task=convergence``
trains the digits CNN instead (:mod:`experiments.bench.convergence`).
Configuration: ``conf/bench/benchmark.yaml`` and its groups under ``conf/bench``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from experiments.bench.aggregate import aggregate, kind_weights
from experiments.bench.measure import step_kinds

log = logging.getLogger(__name__)

TASKS = ("timing", "convergence")
CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "bench"


def job_spec(cfg: DictConfig) -> dict[str, Any]:
    """The plain, picklable description every rank receives.

    Raises:
        ValueError: an unknown task, a world size below 1 or too few steps.
    """
    if cfg.task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {cfg.task!r}")
    if int(cfg.world_size) < 1:
        raise ValueError(f"world_size must be >= 1, got {cfg.world_size}")
    if int(cfg.steps) < 1 or int(cfg.warmup) < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got {cfg.steps}, {cfg.warmup}")
    spec = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(spec, dict)
    spec.pop("hydra", None)
    if spec.get("strategies"):
        if spec["task"] != "timing":
            raise ValueError("strategies (interleaved measurement) is for task=timing only")
        spec["strategies"] = [strategy_config(name) for name in spec["strategies"]]
        spec["strategy"] = {"name": "+".join(s["name"] for s in spec["strategies"]), "kfac": {}}
    kinds = step_kinds(int(cfg.setting.factor_every), int(cfg.setting.inv_every))
    members = spec.get("strategies") or [spec["strategy"]]
    cycle = len(kinds) if any(s["kfac"] is not None for s in members) else 1
    # Whole cycles, so every step kind is measured equally often.
    spec["warmup"] = -(-int(cfg.warmup) // cycle) * cycle
    spec["steps"] = max(-(-int(cfg.steps) // cycle), 1) * cycle
    spec["factor_every"] = int(cfg.setting.factor_every)
    spec["inv_every"] = int(cfg.setting.inv_every)
    return spec


def strategy_config(name: str) -> dict[str, Any]:
    """One option of the ``strategy`` group (``conf/bench/strategy/<name>.yaml``) as a dict.

    Interleaved jobs measure several strategies, but a Hydra group selects
    one option; the others are read from the same files so both paths share
    one definition of every strategy.
    """
    path = CONF_DIR / "strategy" / f"{name}.yaml"
    if not path.exists():
        options = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ValueError(f"unknown strategy {name!r} in strategies; expected one of {options}")
    loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert isinstance(loaded, dict)
    return loaded


def _identity(spec: dict[str, Any]) -> dict[str, Any]:
    """Columns that say what was measured, where and when."""
    import torch

    kwargs = spec["model"]["kwargs"]
    return {
        "task": spec["task"],
        "model": spec["model"]["name"],
        "label": spec["model"]["label"],
        "strategy": spec["strategy"]["name"],
        "world_size": int(spec["world_size"]),
        "setting": spec["setting"]["name"],
        "factor_every": spec["setting"]["factor_every"],
        "inv_every": spec["setting"]["inv_every"],
        "batch_size": kwargs.get("batch_size"),
        "warmup": spec["warmup"],
        "steps": spec["steps"],
        "threads": spec["threads"],
        "isolate_comm": bool(spec.get("isolate_comm", False)),
        "cpus": os.cpu_count(),
        "compute_method": spec["kfac"]["compute_method"],
        "torch": torch.__version__,
        "host": socket.gethostname(),
        "cpu": platform.processor() or platform.machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def timing_rows(spec: dict[str, Any], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One benchmark row per strategy from every rank's timing results."""
    members = spec.get("strategies") or [spec["strategy"]]
    interleaved = len(members) > 1
    return [_timing_row(spec, s, results, interleaved) for s in members]


def _timing_row(
    spec: dict[str, Any],
    strategy: dict[str, Any],
    results: list[dict[str, Any]],
    interleaved: bool,
) -> dict[str, Any]:
    row = _identity(spec)
    row["strategy"] = strategy["name"]
    row["interleaved"] = interleaved
    first = results[0]["strategies"][strategy["name"]]
    row.update(
        device=results[0]["device"],
        backend=results[0]["backend"],
        kfac_layers=first["kfac_layers"],
        params=first["params"],
    )
    mine = [
        {"rank": r["rank"], "records": r["strategies"][strategy["name"]]["records"]}
        for r in results
    ]
    row.update(aggregate(mine, spec["factor_every"], spec["inv_every"]))
    row.update(
        model_kind=spec["model"]["kind"],
        model_kwargs=json.dumps(spec["model"]["kwargs"]),
        model_paper=json.dumps(spec["model"].get("paper") or {}),
        kfac_options=json.dumps(strategy["kfac"]),
        rank_timings=json.dumps(row["rank_timings"]),
        least_wait=json.dumps(row["least_wait"]),
        fusion_plan=json.dumps(first.get("fusion_plan")),
    )
    for key, value in list(row.items()):
        if isinstance(value, float) and key.startswith(("bytes_", "calls_", "wire_", "mem_")):
            row[key] = int(value) if value.is_integer() else value
    row["kind_weights"] = json.dumps(kind_weights(spec["factor_every"], spec["inv_every"]))
    row["error"] = ""
    return row


def convergence_rows(spec: dict[str, Any], results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run: the accuracy curve as JSON plus the final and best accuracy."""
    row = _identity(spec)
    row["model"], row["label"] = "digits_cnn", "DigitsCNN on sklearn digits"
    row["batch_size"] = spec["convergence"]["batch_size"]
    history = results[0]["epochs"]
    row.update(
        epochs=len(history),
        steps_per_epoch=results[0]["steps_per_epoch"],
        final_acc=history[-1]["test_acc"] if history else float("nan"),
        best_acc=max((h["test_acc"] for h in history), default=float("nan")),
        seconds=history[-1]["seconds"] if history else float("nan"),
        curve=json.dumps(history),
        replicas_identical=all(r["replicas_identical"] for r in results),
        error="",
    )
    return [row]


def run(cfg: DictConfig) -> list[dict[str, Any]]:
    """Run one job and return its rows (one per strategy measured)."""
    from experiments.bench.convergence import run_convergence
    from experiments.bench.launch import launch
    from experiments.bench.measure import run_rank

    spec = job_spec(cfg)
    fn, make_rows = (
        (run_rank, timing_rows) if spec["task"] == "timing" else (run_convergence, convergence_rows)
    )
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # ranks started by torchrun
        spec["world_size"] = int(os.environ["WORLD_SIZE"])
        spec["gather"] = True
        results = fn(spec)
        results = results if isinstance(results, list) else [results]
    else:
        results = launch(fn, spec, int(spec["world_size"]), threads=int(spec["threads"]))
    return make_rows(spec, results)


def write_rows(rows: list[dict[str, Any]], out_dir: Path, extra_csv: str | None = None) -> None:
    """``rows.json`` in the job folder, and optionally more lines of a CSV."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "rows.json").write_text(json.dumps(rows, indent=1, default=str))
    if extra_csv:
        import pandas as pd

        path = Path(extra_csv)
        path.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(path, mode="a", header=not path.exists(), index=False)


def _summary(row: dict[str, Any]) -> str:
    if row.get("task") == "convergence":
        return (
            f"{row['strategy']} P={row['world_size']}: final test accuracy "
            f"{row['final_acc']:.4f} after {row['epochs']} epochs ({row['seconds']:.1f} s)"
        )
    return (
        f"{row['model']} {row['strategy']} P={row['world_size']} {row['setting']}: "
        f"iteration {row['iteration_s'] * 1e3:.1f} ms, K-FAC compute {row['compute_s'] * 1e3:.1f}"
        f" ms, comm {row['comm_s'] * 1e3:.1f} ms, second-order bytes "
        f"{row['bytes_second_order']}, K-FAC memory {row['mem_kfac'] / 2**20:.2f} MiB"
    )


@hydra.main(config_path="../conf/bench", config_name="benchmark", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Measure one configuration and write its row; failures are recorded, not fatal.

    A failing job of a sweep (a rank crashing, a timeout) writes a row whose
    ``error`` column says why, so the rest of the sweep and the table still
    come out; the table writers list failed rows instead of dropping them.
    """
    from hydra.core.hydra_config import HydraConfig
    from torch.distributed.elastic.multiprocessing.api import SignalException

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        rows = run(cfg)
    except SignalException:  # the user stopped the sweep: do not go on to the next job
        raise
    except Exception as err:  # recorded in the row; the table shows it
        log.exception("benchmark job failed")
        names = cfg.get("strategies") or [cfg.strategy.name]
        message = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
        rows = [
            {
                "task": cfg.task,
                "model": cfg.model.name,
                "label": cfg.model.label,
                "strategy": name,
                "world_size": int(cfg.world_size),
                "setting": cfg.setting.name,
                "error": f"{type(err).__name__}: {message}".rstrip(": "),
            }
            for name in names
        ]
    if int(os.environ.get("RANK", "0")) == 0:
        write_rows(rows, out_dir, cfg.out)
        for row in rows:
            log.info(row["error"] or _summary(row))


if __name__ == "__main__":
    main()
