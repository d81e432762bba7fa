"""The ``convergence`` table's runs: the training entry point, once per rank.

The paper's convergence claims (DP-KFAC reaches the accuracy of D-KFAC and
SGD) are checked on the one real data set that needs no download:
scikit-learn's 8x8 digits. Nothing is re-implemented here: the benchmark
composes the training config of the ``digits_cnn`` preset with the job's
strategy config (:func:`training_config`, the preset's own learning rate,
damping, schedule and epochs), and every rank the launcher starts calls
:func:`experiments.train.run` on it, exactly as under
``torchrun -m experiments.train``. The per-epoch test accuracy comes from the
``metrics.json`` the trainer writes (its evaluation history).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig


def training_config(cfg: DictConfig, output_dir: Path, *study: str) -> DictConfig:
    """The training config of a ``convergence`` or ``convergence_scale`` job, not yet validated.

    ``experiment=<node.experiment> strategy=<this job's strategy config>`` (``node`` the
    task's own, ``cfg.convergence`` or ``cfg.convergence_scale``) with the preset's own
    values; only what belongs to the job (seed, timeout, threads per rank, output folder,
    no tracker or progress bar, never resuming an earlier job's checkpoints in the same
    folder), then ``study`` (what the task fixes) and ``node.overrides`` are added.
    """
    from hydra.errors import HydraException

    from experiments.config import ExperimentError, compose_config, first_line
    from experiments.preconditioning import strategy_name

    node = cfg[cfg.task]
    overrides = [
        f"experiment={node.experiment}",
        f"strategy={strategy_name(cfg.strategy)}",
        "logger=none",
        "trainer.progress_bar=false",
        "trainer.resume=null",
        f"trainer.dist_timeout_s={cfg.timeout_s}",
        f"trainer.threads={int(cfg.threads)}",
        f"seed={int(cfg.seed)}",
        f"output_dir={output_dir}",
        *study,
        *node.overrides,
    ]
    try:
        return compose_config("config", overrides)
    except HydraException as err:
        first = first_line(err)
        raise ExperimentError(f"cannot compose the {cfg.task} training config: {first}") from None


def run_convergence(spec: dict[str, Any]) -> dict[str, Any]:
    """Train with ``spec["train_config"]`` (whose ``trainer.threads`` is the job's) on this rank.

    Returns ``rank``, ``result`` (what :func:`experiments.train.run` returned) and, on
    rank 0, ``history`` (the trainer's evaluations, from ``metrics.json``).
    """
    from omegaconf import OmegaConf

    from experiments.train import run

    cfg = OmegaConf.create(spec["train_config"])
    result = run(cfg)
    rank = int(os.environ.get("RANK", "0"))
    metrics = Path(cfg.output_dir) / "metrics.json"
    history = json.loads(metrics.read_text())["history"] if rank == 0 else None
    return {"rank": rank, "result": result, "history": history}


def curve(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table's accuracy curve from the trainer's evaluation history, one point per
    evaluation: ``epoch``, ``test_acc`` (top-1), ``train_loss`` (mean over the steps since
    the previous evaluation) and ``seconds`` (wall time of the run so far)."""
    return [
        {
            "epoch": round(float(h["epoch"]), 4),
            "test_acc": float(h["accuracy"]),
            "train_loss": float(h.get("train_loss", float("nan"))),
            "seconds": float(h.get("wall_time_s", float("nan"))),
        }
        for h in history
        if "accuracy" in h
    ]
