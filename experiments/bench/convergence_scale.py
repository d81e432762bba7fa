"""The ``convergence_scale`` table: steps to a target accuracy as P grows, and their cost.

The DP-KFAC paper says DP-KFAC keeps D-KFAC's convergence. Its factors come
from one rank's batch (1/P of the global one), so that claim can only fail at
large P. This module runs the check with the real training code
(``experiments.train.run``) under the in-process launcher (``launcher=threads``),
so P = 1 ... 256 ranks fit on one small machine, and turns the runs into
``results/convergence_scale.{csv,md,png}``.

One benchmark job (``python -m experiments.bench task=convergence_scale``) is
one training run: an experiment preset, a strategy config, ``world_size``
ranks, a learning-rate multiplier, a damping and a seed. Which jobs run is the
tuning protocol's decision (:mod:`experiments.bench.tuning`, driven by
:mod:`experiments.bench.tune`), the same for every configuration, SGD included.
What a job fixes, and why:

* **Per-rank batch** ``convergence_scale.batch_size`` (16): the global batch
  grows with P, as in a data-parallel job that adds GPUs, which is where the
  owner's share of the batch (what its factors see) shrinks.
* **Learning-rate rule**: linear scaling from the preset's learning rate at its
  batch (:func:`learning_rate`) times the protocol's multiplier.
* **Evaluations** ``evals_per_epoch`` times an epoch, so that steps to a target
  are resolved to a few percent, not to an epoch.
* **The fidelity probe** (``strategy.fidelity_every``): the owner's
  preconditioned gradient from its own batch's factors against the one from
  factors averaged over all ranks, recorded by :class:`ScaleLogger`.
* **grouped_auto** chooses its (k, f) for ``convergence_scale.hardware``, the
  hardware whose step time is predicted (:func:`predicted_iteration`, for time
  to target), not for the in-process group, whose "links" are a thread hand-over.

The table half turns the runs into ``results/convergence_scale.*``: the
protocol's choices per cell, paired comparisons of dp_kfac and d_kfac with
bootstrap intervals and verdicts (:mod:`experiments.bench.intervals`), and time
to target against SGD, answer first.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from itertools import takewhile
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import DictConfig

from experiments.bench.fidelity import RecordingLogger
from experiments.config import plain
from experiments.preconditioning import strategy_name, uses_preconditioner

log = logging.getLogger(__name__)

TASK = "convergence_scale"
#: What :class:`ScaleLogger` writes in the run folder.
RECORD = "convergence_scale.jsonl"
#: P at and below which the measured CPU time per step is reported (the ranks of a
#: threads run take turns on one process: above a few ranks the figure says little).
MEASURED_MAX_P = 4
#: The first-order baseline and the pair the takeaway compares.
SGD, REFERENCE, BASELINE = "none", "dp_kfac", "d_kfac"


# ------------------------------------------------------------------ the job
class ScaleLogger(RecordingLogger):
    """Rank 0's logger in a job: appends step times and fidelity values to a JSON-lines file.

    The trainer logs ``train/step_time_s`` (mean over a logging interval) and
    ``fidelity/<layer>/{cosine,rel_error}`` (at probe steps); nothing else is
    kept. It replaces W&B as ``logger._target_`` like the :class:`RecordingLogger` it extends.
    """

    record = RECORD

    def lines(self, metrics: Mapping[str, float], step: int) -> list[dict[str, Any]]:
        """This call's step time, if any, then its fidelity lines."""
        seconds = metrics.get("train/step_time_s")
        times = [] if seconds is None else [{"step": step, "step_time_s": float(seconds)}]
        return times + super().lines(metrics, step)


def base_lr_and_batch(node: DictConfig | Mapping[str, Any]) -> tuple[float, int]:
    """The learning rate and batch the rule scales from: ``base_lr`` and ``base_batch``, or
    where null the experiment preset's own ``optimizer.lr`` and ``data.batch_size``."""
    lr, batch = node.get("base_lr"), node.get("base_batch")
    if lr is None or batch is None:
        from experiments.config import compose_config

        preset = compose_config("config", [f"experiment={node['experiment']}"])
        lr = preset.optimizer.lr if lr is None else lr
        batch = preset.data.batch_size if batch is None else batch
    return float(lr), int(batch)


def learning_rate(node: DictConfig | Mapping[str, Any], world_size: int) -> float:
    """The job's learning rate: linear scaling from :func:`base_lr_and_batch`, times the
    grid's multiplier: ``base_lr * (batch_size * world_size / base_batch) * lr_multiplier``."""
    base_lr, base_batch = base_lr_and_batch(node)
    global_batch = int(node["batch_size"]) * int(world_size)
    return base_lr * global_batch / base_batch * float(node["lr_multiplier"])


def targets_of(node: DictConfig | Mapping[str, Any], experiment: str) -> tuple[float, float]:
    """The experiment's two targets, fixed in the config before any run: one every method
    reaches at every P (steps to it are the study's measure) and one near the best final
    accuracy (a single value: both the same)."""
    value = plain(node["targets"][experiment])
    pair = [float(v) for v in (value if isinstance(value, list) else [value, value])]
    if len(pair) != 2 or not 0 < pair[0] <= pair[1] <= 1:
        raise ValueError(f"convergence_scale.targets.{experiment} must be [low, high]: {value}")
    return pair[0], pair[1]


def skip_reason(cfg: DictConfig) -> str | None:
    """Why this job is not run (None: run it): an experiment stops at the P its data allows
    (``max_world_size``: experiment -> P)."""
    node = cfg.convergence_scale
    p, experiment = int(cfg.world_size), str(node.experiment)
    limit = (node.get("max_world_size") or {}).get(experiment)
    if limit is not None and p > int(limit):
        return f"{experiment} runs up to P={limit}"
    return None


def training_config(
    cfg: DictConfig, output_dir: Path, eval_every_steps: int | None = None
) -> DictConfig:
    """The training config of this job (:func:`experiments.bench.convergence.training_config`)
    with what the study fixes: per-rank batch, :func:`learning_rate`, the damping
    (``convergence_scale.damping``; null: the preset's), evaluations every
    ``eval_every_steps`` steps besides every epoch, P threads on the CPU, the fidelity probe,
    :class:`ScaleLogger`, no checkpoints, the replica check on."""
    from experiments.bench import convergence
    from experiments.config import validate

    node, p = cfg.convergence_scale, int(cfg.world_size)
    every = [] if eval_every_steps is None else [f"trainer.eval_every_steps={eval_every_steps}"]
    train_cfg = convergence.training_config(
        cfg,
        output_dir,
        "launcher=threads",
        f"launcher.world_size={p}",
        f"data.batch_size={int(node.batch_size)}",
        f"optimizer.lr={learning_rate(node, p)!r}",
        "trainer.scale_lr=false",
        f"logger._target_={ScaleLogger.__module__}.{ScaleLogger.__name__}",
        "trainer.check_replicas=true",
        "trainer.checkpoint_every_steps=null",
        "trainer.device=cpu",
        *every,
    )
    if uses_preconditioner(train_cfg.strategy):
        train_cfg.strategy.fidelity_every = int(node.fidelity_every)
        if node.get("damping") is not None:
            train_cfg.strategy.damping = float(node.damping)
        if "hardware" in train_cfg.strategy and train_cfg.strategy.hardware is None:
            train_cfg.strategy.hardware = str(node.hardware)
    validate(train_cfg)
    return train_cfg


def model_and_input(train_cfg: DictConfig) -> tuple[Any, Any, int]:
    """The job's model (as training builds it), one input of its data and the optimizer
    steps of an epoch at the job's P, from its data module set up on one rank: only it
    knows the model's arguments, the input's shape and the training split's size."""
    import torch
    from hydra.utils import instantiate

    from experiments.distributed import DistEnv

    data = instantiate(train_cfg.data)
    with tempfile.TemporaryDirectory(prefix="dpkfac-shapes-") as scratch:
        env = DistEnv(0, 1, 0, torch.device("cpu"))
        data.setup(env, Path(scratch))
        x = next(iter(data.eval_loader(env)))[0][:1]
        p = int(train_cfg.launcher.world_size)
        steps = data.steps_per_epoch(DistEnv(0, p, 0, torch.device("cpu")))
        return instantiate(train_cfg.model, **data.model_kwargs()), x, steps


def predicted_iteration(
    train_cfg: DictConfig, world_size: int, hardware: str, model: Any, example: Any
) -> dict[str, Any]:
    """The cost model's seconds per step of this job's model, batch and strategy at P ranks.

    Shapes from the model at the per-rank batch, the strategy config's options with the
    preset's update intervals (``iteration_avg`` averages over them); SGD is plain data
    parallelism. Returns ``pred_iteration_s``, ``pred_hardware`` and ``pred_chosen``
    (what an ``auto`` option resolved to, e.g. grouped's k and f; "" if none).
    """
    from dpkfac.costmodel import PRESETS, predict, shapes_from_model
    from dpkfac.options import KFACOptions
    from experiments.preconditioning import preconditioner_kwargs, split_options

    batch = int(train_cfg.data.batch_size)
    options = preconditioner_kwargs(train_cfg.strategy)
    skip = (options or {}).get("skip_layers", [])
    shapes = shapes_from_model(model, example, batch, skip_layers=skip, ready_order=True)
    name: str | None = None  # SGD: no strategy, no options
    values: dict[str, Any] = {}
    kfac: KFACOptions | None = None
    if options is not None:
        name, common, values = split_options({k: plain(v) for k, v in options.items()})
        # Left out of the price: the fidelity probe (a measurement aid, not the algorithm)
        # and schedules of the step (damping's changes nothing priced; an interval's would
        # be priced as every step).
        common = {
            k: v
            for k, v in common.items()
            if k not in ("fidelity_every", "fidelity_layers")
            and not (isinstance(v, dict) and "_target_" in v)
        }
        steps = {k: int(common.get(k) or 1) for k in ("factor_update_steps", "inv_update_steps")}
        kfac = KFACOptions(**(common | steps))
    hw = PRESETS[hardware]
    prediction = predict(
        shapes, strategy=name, world_size=world_size, hardware=hw, kfac=kfac, options=values
    )
    picked = [
        f"{k}={getattr(prediction.options, k)}"
        for k in ("factor_group_size", "grad_worker_fraction")
        if values.get(k) == "auto" and hasattr(prediction.options, k)
    ]
    return {
        "pred_iteration_s": prediction.iteration_avg,
        "pred_hardware": hardware,
        "pred_chosen": ", ".join(picked),
    }


def reached(curve: Sequence[Mapping[str, Any]], target: float) -> tuple[float, float]:
    """(steps, epochs) of the evaluation from which the test accuracy stays at or above
    ``target`` to the end of the run (NaN: the run ends below it).

    Not the first crossing: where training plateaus near the target (the MNIST-1D CNN
    at P=4 sits at 0.92-0.96 until its learning-rate drop), the first evaluation above
    it is decided by evaluation noise, and a run that crosses once and falls back for
    six epochs has not reached it in any sense a user would time.
    """
    # NaN (a diverged run) is below the target.
    held = list(takewhile(lambda point: float(point["test_acc"]) >= target, reversed(curve)))
    hit = held[-1] if held else {"step": math.nan, "epoch": math.nan}
    return float(hit["step"]), float(hit["epoch"])


def _records(path: Path) -> tuple[list[float], list[dict[str, Any]]]:
    """Step times and fidelity entries from :class:`ScaleLogger`'s file."""
    entries = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    times = [float(e["step_time_s"]) for e in entries if "step_time_s" in e]
    return times, [e for e in entries if "step_time_s" not in e and "cosine" in e]


def layer_kinds(model: Any) -> dict[str, str]:
    """Module class name of every named module of a model (``Linear``, ``Conv2d``)."""
    return {name: type(m).__name__ for name, m in model.named_modules()}


def fidelity_by_kind(probes: Sequence[Mapping[str, Any]], kinds: Mapping[str, str]) -> dict:
    """Mean probe cosine per layer kind over a run (every probe of every layer of that kind;
    a skipped probe, NaN, counts for nothing)."""
    values: dict[str, list[float]] = {}
    for p in probes:
        values.setdefault(kinds.get(str(p["layer"]), "?"), []).append(float(p["cosine"]))
    return {kind: _mean_std(v)[0] for kind, v in sorted(values.items())}


def run_job(cfg: DictConfig, output_dir: Path) -> list[dict[str, Any]]:
    """Train this grid point (every rank a thread of this process); its one row, or none.

    Raises:
        ExperimentError: a value the checks reject.
    """

    from experiments.bench.machine import machine
    from experiments.train import run

    reason = skip_reason(cfg)
    if reason is not None:
        log.info("convergence_scale: skipped (%s)", reason)
        return []
    node, p, seed = cfg.convergence_scale, int(cfg.world_size), int(cfg.seed)
    strategy = strategy_name(cfg.strategy)
    train_dir = output_dir / "train"
    model, example, steps_per_epoch = model_and_input(training_config(cfg, train_dir))
    evals = node.get("evals_per_epoch")
    every = max(1, steps_per_epoch // int(evals)) if evals else None
    train_cfg = training_config(cfg, train_dir, every)  # its trainer.threads sets the pool
    lr = float(train_cfg.optimizer.lr)
    log.info(
        f"{TASK}: {node.experiment} {strategy} P={p} lr {lr:.4g} (x{node.lr_multiplier}) "
        f"seed {seed}"
    )
    started = time.perf_counter()
    result = run(train_cfg)
    seconds = time.perf_counter() - started
    history = json.loads((train_dir / "metrics.json").read_text())["history"]
    target, high = targets_of(node, str(node.experiment))
    times, probes = _records(train_dir / RECORD)
    predicted = predicted_iteration(train_cfg, p, str(node.hardware), model, example)
    kfac = plain(train_cfg.strategy) if uses_preconditioner(train_cfg.strategy) else None
    base_lr, base_batch = base_lr_and_batch(node)
    batch = int(node.batch_size)
    curve = [
        {
            "step": int(h["step"]),
            "epoch": round(float(h["epoch"]), 4),
            "test_acc": float(h["accuracy"]),
            "val_acc": float(h.get("val_accuracy", math.nan)),
            "train_loss": float(h.get("train_loss", math.nan)),
        }
        for h in history
        if "accuracy" in h
    ]
    steps, epochs = reached(curve, target)
    row = {
        "task": TASK,
        "model": str(node.experiment),
        "label": f"{train_cfg.model._target_.rsplit('.', 1)[-1]} ({node.experiment} preset)",
        "strategy": strategy,
        "run_as": strategy,  # a stand-in names the configuration that trained
        "world_size": p,
        "seed": seed,
        "batch_size": batch,
        "global_batch": batch * p,
        "lr_multiplier": float(node.lr_multiplier),
        "lr": lr,
        "damping": float(train_cfg.strategy.damping) if kfac is not None else math.nan,
        "eval_every_steps": every or 0,
        "lr_rule": f"lr = {base_lr} x (batch {batch} x P / {base_batch}) x multiplier",
        "target": target,
        "target_high": high,
        "steps_per_epoch": round(result["steps"] / result["epochs"]) if result["epochs"] else 0,
        "steps": int(result["steps"]),
        "epochs": float(result["epochs"]),
        "final_acc": float(result.get("accuracy", math.nan)),
        "final_val_acc": float(result.get("val_accuracy", math.nan)),
        "steps_to_target": steps,
        "epochs_to_target": epochs,
        "curve": json.dumps(curve),
        "fidelity_every": int(node.fidelity_every) if kfac is not None else 0,
        "fidelity_probes": len(probes),
        "fidelity_cosine": json.dumps(fidelity_by_kind(probes, layer_kinds(model))),
        # Median over logging intervals: an interval that held an evaluation is slower.
        "step_s": statistics.median(times) if times else math.nan,
        "seconds": seconds,
        # The trainer compares every rank's parameters bitwise at the end and fails otherwise.
        "replicas_identical": bool(train_cfg.trainer.check_replicas) and p > 1,
        "kfac_options": json.dumps(kfac, default=str),
        "threads": int(cfg.threads),
        **machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **predicted,
        "error": "",
    }
    return [row]


# ---------------------------------------------------------------- the table
def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    finite = [float(v) for v in values if v == v]
    if not finite:
        return math.nan, math.nan
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0


CELL = ["model", "strategy", "world_size"]
#: A run of the study: its cell, learning-rate multiplier, damping and seed.
POINT = [*CELL, "lr_multiplier", "damping", "seed"]


def study_node(overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The study's settings (``convergence_scale`` of the table preset), as plain values."""
    from omegaconf import OmegaConf

    from experiments.config import compose_config

    cfg = compose_config("benchmark", ["table=convergence_scale", *overrides])
    node = OmegaConf.to_container(cfg.convergence_scale, resolve=True)
    assert isinstance(node, dict)
    return node


def with_steps_to_target(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs with steps and epochs to both targets recomputed from each run's curve by
    :func:`reached`, so rows merged from older sweeps follow today's definition."""
    high = runs["target_high"] if "target_high" in runs else runs["target"]
    rows = zip(runs["curve"], runs["target"], high, strict=True)
    hits = [
        (*reached(json.loads(c), float(t)), reached(json.loads(c), float(h))[0]) for c, t, h in rows
    ]
    frame = pd.DataFrame(hits, index=runs.index, columns=["s", "e", "h"])
    return runs.assign(
        steps_to_target=frame["s"],
        epochs_to_target=frame["e"],
        steps_to_high=frame["h"],
        target_high=high,
    )


def study_runs(df: pd.DataFrame) -> pd.DataFrame:
    """The protocol's successful runs (rows with a damping column), the latest of each point."""
    from experiments.bench.pages import ok_rows

    if df.empty or "damping" not in df:
        return df[:0]
    runs = ok_rows(df.assign(error=df["error"].fillna("")), TASK)
    runs = runs[runs["curve"].notna()].copy()
    runs["damping"] = runs["damping"].astype(float)
    order = runs.sort_values("time", kind="stable") if "time" in runs else runs
    key = order.assign(_d=order["damping"].fillna(-1.0).round(12))
    latest = order.loc[
        key.drop_duplicates([*CELL, "lr_multiplier", "_d", "seed"], keep="last").index
    ]
    return with_steps_to_target(latest.sort_index()) if len(latest) else latest


def _at(
    runs: pd.DataFrame, model: str, strategy: str, p: int, point: tuple[float, float]
) -> pd.DataFrame:
    lr, damping = point
    mine = runs[
        (runs["model"] == model) & (runs["strategy"] == strategy) & (runs["world_size"] == p)
    ]
    mine = mine[mine["lr_multiplier"].round(12) == round(lr, 12)]
    if damping == damping:
        return mine[mine["damping"].round(12) == round(damping, 12)]
    return mine[mine["damping"].isna()]


def _plateaued(cell: pd.DataFrame, fraction: float, tolerance: float) -> bool | None:
    """Whether the mean validation accuracy over the cell's seeds moved by less than
    ``tolerance`` over the last ``fraction`` of the evaluations (None: too few)."""
    curves = [pd.DataFrame(json.loads(c)).set_index("step")["val_acc"] for c in cell["curve"]]
    mean = pd.concat(curves, axis=1).mean(axis=1).sort_index()
    if len(mean) < 5:
        return None
    tail = mean.iloc[int(len(mean) * (1 - fraction)) :]
    return bool(tail.max() - tail.min() < tolerance)


def _resolution(cell: pd.DataFrame) -> float:
    """The worst (largest) evaluation interval over steps to target among the cell's seeds."""
    every = cell["eval_every_steps"].astype(float) if "eval_every_steps" in cell else None
    if every is None:
        return math.nan
    interval = every.where(every > 0, cell["steps_per_epoch"].astype(float))
    ratio = interval / cell["steps_to_target"].astype(float)
    return float(ratio.max()) if ratio.notna().any() else math.nan


def cells_frame(runs: pd.DataFrame, node: Mapping[str, Any]) -> pd.DataFrame:
    """One row per cell of the study that has runs: its choice under the protocol (or what
    it waits for), and at the chosen point over its seeds: steps to both targets (mean,
    std, min, max over the seeds that reached them), final test accuracy, plateau,
    resolution, and the cost model's time per step and to target. Where paired seeds
    decide the claim, dp_kfac's row also holds its paired comparison with d_kfac
    (:func:`paired_columns`), and where SGD reached the target, its time against SGD's."""
    from experiments.bench.plots import in_order
    from experiments.bench.tuning import plan_study

    if runs.empty:
        return pd.DataFrame()
    _, plans = plan_study(node, runs.to_dict("records"))
    plateau = node.get("plateau") or {"fraction": 0.2, "tolerance": 0.005}
    have = set(map(tuple, runs[CELL].drop_duplicates().to_numpy().tolist()))
    rows = []
    for plan in plans:
        if (plan.model, plan.strategy, plan.world_size) not in have and not plan.stand_in_for:
            continue
        entry: dict[str, Any] = {
            "model": plan.model,
            "strategy": plan.strategy,
            "P": plan.world_size,
            "run_as": plan.stand_in_for,
            "status": "chosen" if plan.chosen else ("failed" if plan.failed else "in progress"),
            "notes": "; ".join(
                dict.fromkeys([*plan.notes, *([plan.failed] if plan.failed else [])])
            ),
            "runs": int(
                (
                    (runs["model"] == plan.model)
                    & (runs["strategy"] == plan.strategy)
                    & (runs["world_size"] == plan.world_size)
                ).sum()
            ),
        }
        if plan.chosen is not None:
            source = plan.stand_in_for or plan.strategy
            cell = _at(runs, plan.model, source, plan.world_size, plan.chosen)
            own = _at(runs, plan.model, plan.strategy, plan.world_size, plan.chosen)
            done = plan.done
            entry.update(_cell_values(cell, own if len(own) else cell, plateau))
            entry["status"] = "chosen" if done else "chosen, seeds running"
        rows.append(entry)
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    # A cell not chosen yet has none of the chosen point's figures: their columns are NaN.
    values = _cell_values(runs.iloc[:1], runs.iloc[:1], plateau)
    frame = frame.reindex(columns=[*frame.columns, *(k for k in values if k not in frame)])
    frame = paired_columns(frame, runs, plans, node)
    return in_order(time_columns(frame), ["model", "P", "strategy"])


def _cell_values(
    cell: pd.DataFrame, own: pd.DataFrame, plateau: Mapping[str, float]
) -> dict[str, Any]:
    """The chosen point's figures over its seeds (``own``: this configuration's own runs,
    whose step the cost model prices; the same as ``cell`` but for a stand-in)."""
    hit = cell["steps_to_target"].astype(float).dropna().tolist()
    high = cell["steps_to_high"].astype(float).dropna().tolist()
    s_mean, s_std = _mean_std(hit)
    a_mean, a_std = _mean_std(list(cell["final_acc"]))
    pred = float(own["pred_iteration_s"].astype(float).mean())
    first = cell.iloc[0]
    from experiments.bench.pages import machines

    return {
        "global_batch": int(first["global_batch"]),
        "target": float(first["target"]),
        "target_high": float(first["target_high"]),
        "lr": float(first["lr"]),
        "lr_multiplier": float(first["lr_multiplier"]),
        "damping": float(first["damping"]),
        "seeds": len(cell),
        "val_acc": float(cell["final_val_acc"].mean()),
        "reached": len(hit),
        "steps_to_target": s_mean,
        "steps_std": s_std,
        "steps_min": min(hit) if hit else math.nan,
        "steps_max": max(hit) if hit else math.nan,
        "reached_high": len(high),
        "steps_to_high": _mean_std(high)[0],
        "steps_per_epoch": int(first["steps_per_epoch"]),
        "final_acc": a_mean,
        "final_acc_std": a_std,
        "plateaued": _plateaued(cell, float(plateau["fraction"]), float(plateau["tolerance"])),
        "resolution": _resolution(cell),
        "replicas_identical": bool(cell["replicas_identical"].astype(bool).all()),
        "pred_hardware": str(own["pred_hardware"].iloc[0]),
        "pred_iteration_ms": 1e3 * pred,
        "pred_time_to_target_s": s_mean * pred if len(hit) == len(cell) else math.nan,
        "machines": "; ".join(machines(cell).index),
    }


def paired_columns(
    cells: pd.DataFrame, runs: pd.DataFrame, plans: Sequence[Any], node: Mapping[str, Any]
) -> pd.DataFrame:
    """dp_kfac's rows with its paired comparison against d_kfac at the paired cells.

    Seeds pair the runs: both methods' runs of one seed start from the same model and see
    the same data. Over the seeds both ran at their chosen points, a paired bootstrap
    gives 95% intervals of the ratio of mean steps to target (seeds where both reached
    it) and of the mean difference in final test accuracy; the verdicts compare them
    with the margins fixed in ``convergence_scale.verdict``.
    """
    from experiments.bench.intervals import (
        mean_difference,
        paired_bootstrap,
        ratio_of_means,
        verdict,
    )

    margins = node.get("verdict") or {}
    tuning = node.get("tuning") or {}
    chosen = {
        (p.model, p.strategy, p.world_size): (p.stand_in_for or p.strategy, p.chosen) for p in plans
    }
    out = cells.copy()
    for i, row in cells[cells["strategy"] == REFERENCE].iterrows():
        model, p = row["model"], int(row["P"])
        if p not in (tuning.get("paired") or {}).get(model, ()):
            continue
        mine, theirs = chosen.get((model, REFERENCE, p)), chosen.get((model, BASELINE, p))
        if not mine or not theirs or mine[1] is None or theirs[1] is None:
            continue
        a = _at(runs, model, mine[0], p, mine[1]).set_index("seed")
        b = _at(runs, model, theirs[0], p, theirs[1]).set_index("seed")
        seeds = sorted(set(a.index) & set(b.index))
        if len(seeds) < 2:
            continue
        a, b = a.loc[seeds], b.loc[seeds]
        both = [
            s
            for s in seeds
            if a.at[s, "steps_to_target"] == a.at[s, "steps_to_target"]
            and b.at[s, "steps_to_target"] == b.at[s, "steps_to_target"]
        ]
        resamples, confidence = (
            int(margins.get("resamples", 10_000)),
            float(margins.get("confidence", 0.95)),
        )
        acc = paired_bootstrap(
            a["final_acc"].to_numpy(),
            b["final_acc"].to_numpy(),
            mean_difference,
            resamples,
            confidence,
        )
        band = float(margins.get("final_acc", 0.01))
        out.loc[i, ["pairs", "acc_diff", "acc_diff_low", "acc_diff_high"]] = [
            len(seeds),
            acc.value,
            acc.low,
            acc.high,
        ]
        out.loc[i, "acc_verdict"] = verdict(acc, (-band, band), lower_is_better=False)
        out.loc[i, "pairs_reached"] = len(both)
        if len(both) >= 2:
            steps = paired_bootstrap(
                a.loc[both, "steps_to_target"].to_numpy(),
                b.loc[both, "steps_to_target"].to_numpy(),
                ratio_of_means,
                resamples,
                confidence,
            )
            lo, hi = (float(x) for x in margins.get("steps_ratio", (0.8, 1.25)))
            out.loc[i, ["steps_ratio", "steps_ratio_low", "steps_ratio_high"]] = [
                steps.value,
                steps.low,
                steps.high,
            ]
            out.loc[i, "steps_verdict"] = (
                verdict(steps, (lo, hi), lower_is_better=True)
                if len(both) == len(seeds)
                else "inconclusive"  # a seed missed the target
            )
    return out


def time_columns(cells: pd.DataFrame) -> pd.DataFrame:
    """Per K-FAC cell chosen where SGD's is too and both reached the target in every seed:
    SGD's steps, the break-even (the ratio of a K-FAC step's cost to SGD's below which its
    fewer steps pay: SGD's steps over its own) and its predicted time to target over SGD's."""
    out = cells.copy()
    sgd = cells[(cells["strategy"] == SGD)].set_index(["model", "P"])
    for i, row in cells.iterrows():
        key = (row["model"], row["P"])
        if row["strategy"] == SGD or key not in sgd.index or "reached" not in cells:
            continue
        base = sgd.loc[key]
        if (
            not (row["reached"] == row["seeds"] and base["reached"] == base["seeds"])
            or row["seeds"] != row["seeds"]
        ):
            continue
        break_even = base["steps_to_target"] / row["steps_to_target"]
        cost = row["pred_iteration_ms"] / base["pred_iteration_ms"]
        out.loc[i, ["sgd_steps", "break_even", "step_cost_ratio", "time_ratio_vs_sgd"]] = [
            base["steps_to_target"],
            break_even,
            cost,
            cost / break_even,
        ]
    return out


def _has(row: Mapping[str, Any], key: str) -> bool:
    value = row.get(key)
    return value is not None and value == value and value != ""


def takeaway(cells: pd.DataFrame) -> list[str]:
    """The page's answer, at most one line per model and one on time: dp_kfac against d_kfac
    at the paired cells (verdicts and intervals), and K-FAC against SGD in time to target."""
    if cells.empty:
        return []
    lines = []
    for model, g in cells.groupby("model", sort=False):
        verdicts = (
            g[(g["strategy"] == REFERENCE) & g.get("steps_verdict", pd.Series(dtype=str)).notna()]
            if "steps_verdict" in g
            else g[:0]
        )
        if len(verdicts):
            parts = [
                f"P={int(r['P'])}: steps {r['steps_verdict']} ({r['steps_ratio']:.2f}× "
                f"[{r['steps_ratio_low']:.2f}, {r['steps_ratio_high']:.2f}]), accuracy "
                f"{r['acc_verdict']} ({r['acc_diff']:+.3f} [{r['acc_diff_low']:+.3f}, "
                f"{r['acc_diff_high']:+.3f}])"
                f", {int(r['pairs'])} paired seeds"
                for _, r in verdicts.iterrows()
            ]
            target = float(verdicts["target"].iloc[0])
            lines.append(
                f"**{model}, dp_kfac against d_kfac** (steps to {target:.2f}, 95% intervals): "
                + "; ".join(parts)
                + "."
            )
        timed = (
            g[g.get("time_ratio_vs_sgd", pd.Series(index=g.index, dtype=float)).notna()]
            if "time_ratio_vs_sgd" in g
            else g[:0]
        )
        timed = timed[timed["strategy"] == REFERENCE]
        if len(timed):
            faster = timed[timed["time_ratio_vs_sgd"] < 1]
            verdict = (
                "beats"
                if len(faster) == len(timed)
                else ("never beats" if faster.empty else "sometimes beats")
            )
            parts = [
                f"P={int(r['P'])} {r['time_ratio_vs_sgd']:.2f}× SGD's time (break-even "
                f"{r['break_even']:.2f}×, "
                f"its step {r['step_cost_ratio']:.2f}×)"
                for _, r in timed.iterrows()
            ]
            lines.append(
                f"**{model}, time to target:** dp_kfac {verdict} SGD (steps measured × seconds "
                "per step "
                f"predicted on `{timed['pred_hardware'].iloc[0]}`): " + "; ".join(parts) + "."
            )
    return lines[:5]


def headline(cells: pd.DataFrame) -> str | None:
    """The README's line on convergence as P grows: the page's answer, or while the study
    runs, how far it is (None: no run yet)."""
    if cells.empty:
        return None
    head = "- **Convergence as P grows** (every method tuned by one protocol; "
    head += "`results/convergence_scale.md`): "
    lines = takeaway(cells)
    chosen = int(cells["status"].astype(str).str.startswith("chosen").sum())
    if lines:
        # While the study runs, its answer so far is said to be one, on the cells it has.
        status = (
            ""
            if chosen == len(cells)
            else f"so far ({int(cells['runs'].sum())} runs, {chosen} of {len(cells)} cells "
            "with a chosen point, the rest in progress): "
        )
        return head + status + " ".join(line.replace("**", "") for line in lines)
    return (
        f"{head}in progress: {int(cells['runs'].sum())} runs so far, {chosen} of {len(cells)} "
        "cells with a chosen point, no paired verdict or time to target yet. The earlier "
        "fixed-grid study is withdrawn: its grids were extended unequally and K-FAC's damping "
        "was never tuned."
    )


def figure(cells: pd.DataFrame) -> Any:
    """Per model: steps to target against P (mean, whiskers min–max over seeds) and final test
    accuracy against P (mean ± std). Every configuration has its own marker and dash and a
    small offset in P, so coinciding ones stay visible; a cell that missed the target in
    some seed is drawn hollow with "k/n" beside it, one that missed in every seed as an x at
    the top of the panel."""
    from matplotlib.lines import Line2D

    from experiments.bench import plots

    chosen = (
        cells[cells.get("seeds", pd.Series(index=cells.index, dtype=float)).notna()]
        if "seeds" in cells
        else cells[:0]
    )
    models = list(dict.fromkeys(chosen["model"]))
    fig, axes = plots._figure(max(len(models), 1), 2, (11, 3.6 * max(len(models), 1)))
    strategies = plots.ordered(list(chosen["strategy"])) if len(chosen) else []
    looks = plots.curve_looks(strategies)
    if not models:
        axes[0][0].text(0.5, 0.5, "no cell chosen yet", ha="center", transform=axes[0][0].transAxes)
    for row, model in zip(axes, models, strict=False):
        mine = chosen[chosen["model"] == model]
        steps_ax, acc_ax = row
        for k, s in enumerate(strategies):
            line = mine[mine["strategy"] == s].sort_values("P")
            if line.empty:
                continue
            shift = 2 ** ((k - (len(strategies) - 1) / 2) * 0.06)
            x = line["P"].astype(float) * shift
            full = line["reached"] == line["seeds"]
            some = (line["reached"] > 0) & ~full
            y = line["steps_to_target"].astype(float)
            err = [y - line["steps_min"], line["steps_max"] - y]
            look = {k2: v for k2, v in looks[s].items() if k2 not in ("markerfacecolor",)}
            steps_ax.errorbar(
                x[full | some],
                y[full | some],
                yerr=[e[full | some] for e in err],
                capsize=3,
                **look,
            )
            if some.any():
                steps_ax.scatter(
                    x[some],
                    y[some],
                    facecolors="none",
                    edgecolors=look.get("color"),
                    s=60,
                    zorder=3,
                )
                for xi, yi, r in zip(x[some], y[some], line[some].itertuples(), strict=True):
                    steps_ax.annotate(
                        f"{r.reached}/{r.seeds}",
                        (xi, yi),
                        fontsize=7,
                        xytext=(3, 3),
                        textcoords="offset points",
                    )
            missed = line["reached"] == 0
            if missed.any():
                steps_ax.scatter(
                    x[missed],
                    [1.0] * int(missed.sum()),
                    marker="x",
                    color=look.get("color"),
                    transform=steps_ax.get_xaxis_transform(),
                    clip_on=False,
                    s=50,
                )
            acc_ax.errorbar(x, line["final_acc"], yerr=line["final_acc_std"], capsize=3, **look)
        target = float(mine["target"].iloc[0])
        steps_ax.set_xscale("log", base=2)
        steps_ax.set(
            yscale="log",
            title=f"{model}: steps to {target:.2f} test accuracy",
            xlabel="P (ranks; per-rank batch fixed)",
            ylabel="steps (whiskers: seed range)",
        )
        acc_ax.set_xscale("log", base=2)
        acc_ax.set(
            title=f"{model}: final test accuracy (± std over seeds)",
            xlabel="P",
            ylabel="test accuracy",
        )
    handles = [Line2D([], [], label=s, **looks[s]) for s in strategies]
    handles.append(
        Line2D(
            [],
            [],
            marker="x",
            linestyle="none",
            color="0.3",
            label="missed the target (every seed)",
        )
    )
    plots._strategy_legend(fig, handles)
    return fig


def _pm(mean: float, std: float, digits: int) -> str:
    return "–" if mean != mean else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _steps_cell(r: Any) -> str:
    if r.seeds != r.seeds:
        return "–"
    if r.reached == 0:
        return f"missed (0/{int(r.seeds)})"
    text = f"{r.steps_to_target:.0f} ({r.steps_min:.0f}–{r.steps_max:.0f})"
    return text + (f", {int(r.reached)}/{int(r.seeds)} reached" if r.reached < r.seeds else "")


def _cell_notes(r: Any) -> str:
    notes = [str(r.notes)] if isinstance(r.notes, str) and r.notes else []
    if r.status != "chosen":
        notes.insert(0, str(r.status))
    if getattr(r, "plateaued", None) is False:
        notes.append("not plateaued")
    resolution = getattr(r, "resolution", math.nan)
    if resolution == resolution and resolution > 0.05:
        notes.append(f"steps resolved to {100 * resolution:.0f}%")
    return "; ".join(notes)


def _markdown_frame(cells: pd.DataFrame) -> pd.DataFrame:
    """One model's main table (8 columns; the rest is in ``convergence_scale_cells.csv``).
    Stand-ins are left out here: one line under the table names them."""
    rows = []
    for r in cells[cells["run_as"].fillna("") == ""].itertuples():
        chosen = r.seeds == r.seeds
        point = "–"
        if chosen:
            point = f"{r.lr:.4g} (×{r.lr_multiplier:g})" + (
                "" if r.damping != r.damping else f", {r.damping:g}"
            )
        rows.append(
            {
                "configuration": r.strategy,
                "P": int(r.P),
                "lr (×), damping": point,
                "seeds": int(r.seeds) if chosen else int(r.runs),
                "steps to target": _steps_cell(r),
                "steps to high target": (
                    "–"
                    if not chosen
                    else (
                        f"{r.steps_to_high:.0f}"
                        if r.reached_high == r.seeds
                        else f"{int(r.reached_high)}/{int(r.seeds)} reached"
                    )
                ),
                "final test acc": _pm(r.final_acc, r.final_acc_std, 4) if chosen else "–",
                "notes": _cell_notes(r),
            }
        )
    return pd.DataFrame(rows)


def _paired_table(cells: pd.DataFrame) -> pd.DataFrame:
    from experiments.bench.intervals import Interval

    if "steps_verdict" not in cells and "acc_verdict" not in cells:
        return pd.DataFrame()
    rows = []
    for r in cells[
        (cells["strategy"] == REFERENCE)
        & cells.get("acc_verdict", pd.Series(index=cells.index)).notna()
    ].itertuples():
        has_steps = isinstance(getattr(r, "steps_verdict", None), str)
        rows.append(
            {
                "model": r.model,
                "P": int(r.P),
                "paired seeds": f"{int(r.pairs)} ({int(r.pairs_reached)} both reached)",
                "steps dp/d [95% CI]": (
                    Interval(r.steps_ratio, r.steps_ratio_low, r.steps_ratio_high, r.pairs).text()
                    if has_steps
                    else "–"
                ),
                "steps": r.steps_verdict if has_steps else "–",
                "final acc dp − d [95% CI]": Interval(
                    r.acc_diff, r.acc_diff_low, r.acc_diff_high, r.pairs
                ).text(4, signed=True),
                "accuracy": r.acc_verdict,
            }
        )
    return pd.DataFrame(rows)


def _time_table(cells: pd.DataFrame) -> pd.DataFrame:
    if "time_ratio_vs_sgd" not in cells:
        return pd.DataFrame()
    rows = []
    for r in cells[cells["time_ratio_vs_sgd"].notna()].itertuples():
        rows.append(
            {
                "model": r.model,
                "configuration": r.strategy,
                "P": int(r.P),
                "steps (SGD's)": f"{r.steps_to_target:.0f} ({r.sgd_steps:.0f})",
                "break-even step cost": f"{r.break_even:.2f}×",
                "predicted step cost": f"{r.step_cost_ratio:.2f}×",
                "time to target": f"{r.time_ratio_vs_sgd:.2f}× SGD's",
            }
        )
    return pd.DataFrame(rows)


def protocol_lines(node: Mapping[str, Any]) -> list[str]:
    """The protocol in three lines, from the settings the study ran with."""
    t = node["tuning"]
    v = node.get("verdict") or {}
    return [
        "- **Learning rate**, every configuration alike: multipliers "
        f"{', '.join(f'×{x:g}' for x in t['lr_start'])} "
        f"on seed 0, extended by ×{t['lr_factor']:g} towards the best until it is interior (or "
        "the next point "
        "diverged, which the cell notes).",
        f"- **Damping** (K-FAC) at P={', '.join(str(p) for p in t['damping_at'])}: "
        f"{', '.join(f'{d:g}' for d in t['damping'])} "
        "(extended along the 1-3 series) at that lr, then the lr again; other P use the nearest "
        "tuned P's.",
        f"- **Choice**: the {t['finalists']} best points run {t['final_seeds']} seeds, the best "
        "mean validation "
        f"accuracy wins; dp_kfac and d_kfac then run {t['paired_seeds']} paired seeds at the "
        "claim's cells, judged "
        f"against margins fixed beforehand (steps ratio in {v.get('steps_ratio')}, accuracy "
        f"within ±{v.get('final_acc')}).",
    ]


def decisions_frame(runs: pd.DataFrame, node: Mapping[str, Any]) -> pd.DataFrame:
    """Every decision the protocol made, cell by cell, with its reason."""
    from experiments.bench.tuning import plan_study

    if runs.empty:
        return pd.DataFrame()
    _, plans = plan_study(node, runs.to_dict("records"))
    return pd.DataFrame([d for p in plans for d in p.decisions])


#: Columns of ``convergence_scale.csv``: every run, with the stage the protocol ran it for.
_RUNS = [
    "model",
    "strategy",
    "world_size",
    "global_batch",
    "lr_multiplier",
    "lr",
    "damping",
    "seed",
    "stage",
    "final_val_acc",
    "final_acc",
    "steps_to_target",
    "steps_to_high",
    "epochs_to_target",
    "eval_every_steps",
    "steps",
    "epochs",
    "fidelity_cosine",
    "step_s",
    "pred_iteration_s",
    "replicas_identical",
    "seconds",
    "cpu",
    "cpu_capability",
    "cpus",
    "time",
]


def write_convergence_scale(df: pd.DataFrame, out: Path) -> dict[str, Path]:
    """``results/convergence_scale.*``: every run (CSV), the protocol's decisions (CSV), the
    cells (CSV and md, answer first) and the figure."""
    from experiments.bench.pages import footer, to_markdown, write_page

    node = study_node()
    runs = study_runs(df)
    paths = {"csv": out / "convergence_scale.csv"}
    runs.reindex(columns=[c for c in _RUNS if c in runs]).to_csv(paths["csv"], index=False)
    title = "# Convergence as P grows: steps to a target accuracy, every method tuned alike"
    if runs.empty:
        md = [
            title,
            "",
            "No run of the tuning protocol yet (`python -m experiments.bench.tune`).",
            "",
            *protocol_lines(node),
        ]
        paths["md"] = write_page(out / "convergence_scale.md", md + footer(df))
        return paths
    cells = cells_frame(runs, node)
    paths["cells"] = out / "convergence_scale_cells.csv"
    cells.to_csv(paths["cells"], index=False)
    paths["decisions"] = out / "convergence_scale_decisions.csv"
    decisions_frame(runs, node).to_csv(paths["decisions"], index=False)
    answer = takeaway(cells) or [
        "No answer yet: the paired cells (dp_kfac and d_kfac at their chosen points) have not run; "
        f"{len(runs)} run(s) so far, {int((cells['status'] == 'chosen').sum())} of {len(cells)} "
        "cells chosen."
    ]
    md = [title, "", *answer, "", "![convergence_scale](convergence_scale.png)"]
    paired, timed = _paired_table(cells), _time_table(cells)
    if len(paired):
        md += [
            "",
            "## dp_kfac against d_kfac: paired seeds, 95% bootstrap intervals",
            "",
            to_markdown(paired),
        ]
    if len(timed):
        md += [
            "",
            "## Time to target against SGD (steps measured × step time predicted)",
            "",
            to_markdown(timed),
        ]
    for model, g in cells.groupby("model", sort=False):
        md += ["", f"## {model}", "", to_markdown(_markdown_frame(g))]
        stand = g[g["run_as"].fillna("") != ""]
        if len(stand):
            pairs = ", ".join(
                f"{r.strategy} = {r.run_as} at P={int(r.P)}" for r in stand.itertuples()
            )
            md += [
                "",
                f"Same step, bitwise (checked at the twin's chosen point): {pairs}; their rows "
                "are their twins'.",
            ]
    first = runs.iloc[0]
    targets = ", ".join(
        f"{m} {t:.2f} and {h:.2f}"
        for m, t, h in runs.groupby("model", sort=False)[["target", "target_high"]]
        .first()
        .itertuples()
    )
    md += [
        "",
        "## Method",
        "",
        *protocol_lines(node),
        "",
        "Every rank a thread of one process (`launcher=threads`); per-rank batch "
        f"{int(first['batch_size'])} (the global "
        f"batch grows with P); {node.get('evals_per_epoch')} evaluations per epoch. Targets "
        "(fixed before the runs): "
        f"{targets}; steps to a target: the evaluation from which the test accuracy stays at or "
        "above it to the end "
        "of the run. Whiskers and ranges: min–max over seeds. The learning rate and damping are "
        "chosen on the "
        "validation split, never on the test set; every run is in `convergence_scale.csv` and "
        "every decision, with "
        "its reason, in `convergence_scale_decisions.csv`.",
        "",
        _machines_line(runs),
    ]
    md += footer(df)
    paths["md"] = write_page(out / "convergence_scale.md", md)
    from experiments.bench import plots

    paths["png"] = plots.save(figure(cells), out / "convergence_scale.png")
    return paths


def _machines_line(runs: pd.DataFrame) -> str:
    """Which machines the runs came from (one line): a bitwise comparison holds on one only."""
    from experiments.bench.pages import machines

    found = machines(runs)
    named = "; ".join(f"{n} on {label}" for label, n in found.items())
    several = (
        " **The runs come from more than one machine**: runs on two machines are alike, not "
        "bitwise equal."
        if len(found) > 1
        else ""
    )
    return f"Machines: {named or 'not recorded'}.{several}"
