"""The ``convergence_scale`` table: steps to a target accuracy as P grows, and their cost.

The DP-KFAC paper says DP-KFAC keeps D-KFAC's convergence. Its factors come
from one rank's batch (1/P of the global one), so that claim can only fail at
large P. This module runs the check with the real training code
(``experiments.train.run``) under the in-process launcher (``launcher=threads``),
so P = 1 ... 256 ranks fit on one small machine, and turns the runs into
``results/convergence_scale.{csv,md,png}``.

One benchmark job (``python -m experiments.bench task=convergence_scale``) is
one training run: an experiment preset, a strategy config, ``world_size``
ranks, a learning-rate multiplier and a seed. What the job fixes, and why:

* **Per-rank batch** ``convergence_scale.batch_size`` (16): the global batch
  grows with P, as in a data-parallel job that adds GPUs, which is where the
  owner's share of the batch (what its factors see) shrinks.
* **Learning-rate rule**: linear scaling from the preset's learning rate at its
  batch (:func:`learning_rate`) times a small grid of multipliers;
  :func:`choose_lr` picks one per (model, configuration, P) on validation
  accuracy, never on the test set, and every grid point stays in the CSV.
* **The fidelity probe** (``strategy.fidelity_every``): the owner's
  preconditioned gradient from its own batch's factors against the one from
  factors averaged over all ranks, recorded by :class:`ScaleLogger`.
* **grouped_auto** chooses its (k, f) for ``convergence_scale.hardware``, the
  hardware whose step time is predicted (:func:`predicted_iteration`, for time
  to target), not for the in-process group, whose "links" are a thread hand-over.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
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
    """Why this grid point is not run (None: run it). A Hydra sweep is a full product; the
    preset keeps fewer seeds at large P (``seeds_at``: P -> seeds), stops an experiment
    at the P its data allows (``max_world_size``: experiment -> P) and trains a
    configuration that computes another's step (every K-FAC configuration on one rank,
    ``one_rank_kfac``; ``same_step`` above it) at one grid point (``same_step_check``),
    where :func:`with_same_step_stand_ins` checks it and fills the rest."""
    node = cfg.convergence_scale
    p, experiment = int(cfg.world_size), str(node.experiment)
    strategy = strategy_name(cfg.strategy)
    one_rank = node.get("one_rank_kfac") if strategy != SGD else None
    twin = one_rank if p == 1 else (node.get("same_step") or {}).get(strategy)
    check = node.get("same_step_check")
    point = (float(node.lr_multiplier), int(cfg.seed))
    if check is not None and twin and twin != strategy and point != (float(check.lr_multiplier), int(check.seed)):
        return (
            f"{strategy} computes {twin}'s step{' on one rank' if p == 1 else ''}: it trains at "
            f"x{check.lr_multiplier} seed {check.seed} only, and {twin}'s runs stand in where "
            f"that run equals {twin}'s"
        )
    limit = (node.get("max_world_size") or {}).get(experiment)
    if limit is not None and p > int(limit):
        return f"{experiment} runs up to P={limit}"
    seeds = (node.get("seeds_at") or {}).get(p)
    if seeds is not None and int(cfg.seed) >= int(seeds):
        return f"P={p} runs seeds 0..{int(seeds) - 1}"
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
    from dataclasses import fields

    from dpkfac.costmodel import PRESETS, predict, shapes_from_model
    from dpkfac.options import KFACOptions
    from experiments.preconditioning import preconditioner_kwargs

    batch = int(train_cfg.data.batch_size)
    options = preconditioner_kwargs(train_cfg.strategy)
    skip = (options or {}).get("skip_layers", [])
    shapes = shapes_from_model(model, example, batch, skip_layers=skip, ready_order=True)
    values = {k: plain(v) for k, v in (options or {}).items()}
    name = values.pop("strategy", None)  # None (SGD): no strategy, no options
    kfac: KFACOptions | None = None
    if options is not None:
        known = {f.name for f in fields(KFACOptions)}
        common = {k: values.pop(k) for k in list(values) if k in known}
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


def with_steps_to_target(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs with steps and epochs to target recomputed from each run's curve by
    :func:`reached`, so rows merged from older sweeps follow today's definition."""
    curves = zip(runs["curve"], runs["target"], strict=True)
    hits = pd.DataFrame([reached(json.loads(c), float(t)) for c, t in curves], index=runs.index)
    return runs.assign(steps_to_target=hits[0], epochs_to_target=hits[1])


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

    from experiments.bench.measure import machine
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


def choose_lr(runs: pd.DataFrame) -> pd.DataFrame:
    """Every run with ``chosen``: its multiplier is its cell's best on validation accuracy.

    Per (model, strategy config, P), among the multipliers run with the most
    seeds (a grid run in parts screens every multiplier on seed 0 and adds seeds
    at the best: one lucky seed must not beat three averaged ones, and the extra
    seeds may overturn the screening, as when SGD's x0.5 at CNN P=64 trained in
    seed 0 and diverged in seeds 1 and 2), the one with the highest mean final
    validation accuracy over the seeds they share, the first in grid order on a
    tie; all their seeds where they share none. The test accuracy plays no
    part. A cell without validation accuracy gets no choice (``chosen`` false
    everywhere) rather than one made on the test set.
    """
    runs = runs.copy()
    runs["val_mean"] = runs.groupby([*CELL, "lr_multiplier"])["final_val_acc"].transform("mean")
    runs["chosen"] = False
    for _, cell in runs.groupby(CELL, sort=False):
        seeds = {m: set(g) for m, g in cell.groupby("lr_multiplier")["seed"]}
        most = max(map(len, seeds.values()))
        finalists = {m: s for m, s in seeds.items() if len(s) == most}
        shared = set.intersection(*finalists.values())
        judged = cell[cell["lr_multiplier"].isin(list(finalists))]
        judged = judged[judged["seed"].isin(shared)] if shared else judged
        means = judged.groupby("lr_multiplier", sort=True)["final_val_acc"].mean().dropna()
        if not means.empty:
            runs.loc[cell.index, "chosen"] = cell["lr_multiplier"] == means.idxmax()
    return runs


#: A grid point: one training run of the study.
POINT = [*CELL, "lr_multiplier", "seed"]


def latest_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """One run per grid point: the latest (by ``time``) where a point ran more than once.

    A point is run again to bring a cell onto one machine: runs on two machines are
    alike, not bitwise equal (:func:`experiments.bench.measure.machine`), and the
    same-step stand-ins compare runs bitwise. The earlier run stays in the raw CSV,
    and :func:`coverage` counts it.
    """
    order = runs.sort_values("time", kind="stable") if "time" in runs else runs
    return order.drop_duplicates(POINT, keep="last").sort_index()


def machines(runs: pd.DataFrame) -> str:
    """Which machines the real runs came from, and what that allows (one line)."""
    where = ["cpu", "cpu_capability"]
    known = runs.dropna(subset=where) if set(where) <= set(runs) else runs[:0]
    counts = known.groupby(where, sort=True).size() if len(known) else {}
    parts = [f"{n} on {cpu} ({kernels} kernels)" for (cpu, kernels), n in counts.items()]
    if unknown := len(runs) - len(known):
        parts.append(f"{unknown} from before the machine was recorded (earlier VMs)")
    return (
        f"Machines: {'; '.join(parts)}. A run repeated on another machine is alike, not "
        "bitwise equal (torch's CPU kernels differ by instruction set), so bitwise "
        "comparisons are made between runs of one machine."
    )


#: What a stand-in keeps of its own configuration: the cost model prices its own step.
PRICED = ("pred_iteration_s", "pred_hardware", "pred_chosen")


def _with_run_as(runs: pd.DataFrame) -> pd.DataFrame:
    """A copy of the runs whose ``run_as`` is filled (rows from before it existed are real)."""
    return runs.assign(run_as=runs.get("run_as", runs["strategy"]).fillna(runs["strategy"]))


def with_same_step_stand_ins(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs, plus stand-ins for a configuration whose runs are another's.

    Per (model, P), a K-FAC configuration X whose every real run equals another
    configuration R's run at the same (multiplier, seed) bitwise (curve and final
    accuracies), where R ran more grid points, takes R's runs for its missing points
    (``run_as`` R), priced as X's own step. The sweep trains such configurations at
    one point only (on one rank every K-FAC configuration, ``one_rank_kfac``; above
    it kaisa_mem_opt and grouped_auto, ``same_step``), but nothing here trusts those
    lists: a run that differs matches nothing, and its configuration keeps its own
    points only.
    """
    runs = _with_run_as(runs)
    real = runs[(runs["run_as"] == runs["strategy"]) & (runs["strategy"] != SGD)]
    same = ["curve", "final_acc", "final_val_acc"]
    points = runs.groupby(["model", "world_size", "strategy"])[["lr_multiplier", "seed"]]
    added = []
    for (model, p), group in real.groupby(["model", "world_size"], sort=False):
        by = {
            str(s): g.drop_duplicates(["lr_multiplier", "seed"]).set_index(
                ["lr_multiplier", "seed"]
            )
            for s, g in group.groupby("strategy", sort=False)
        }
        for x, mine in by.items():
            twins = [
                r
                for r, theirs in by.items()
                if len(theirs) > len(mine)
                and mine.index.isin(theirs.index).all()
                and theirs.loc[mine.index, same].equals(mine[same])
            ]
            if not twins:
                continue
            r = max(twins, key=lambda s: len(by[s]))
            own = {k: mine[k].iloc[0] for k in PRICED if k in mine}
            have = set(map(tuple, points.get_group((model, p, x)).to_numpy().tolist()))
            for (m, seed), source in by[r].iterrows():
                if (m, seed) not in have:  # R's run, marked, without a measured time
                    added.append(
                        {**source.to_dict(), "lr_multiplier": m, "seed": seed, "strategy": x}
                        | {"run_as": r, "step_s": math.nan, "seconds": math.nan, **own}
                    )
    return pd.concat([runs, pd.DataFrame(added)], ignore_index=True) if added else runs


def cells_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, configuration, P) at the chosen learning rate.

    Steps and epochs to target: mean and std over the seeds that reached it (``reached``
    of ``seeds``) and their min and max (the seed spread the takeaway uses); the time per
    step predicted, and measured at small P (the in-process step of all P ranks / P).
    """
    from experiments.bench.plots import in_order

    grids = runs.groupby(CELL, sort=False)["lr_multiplier"]
    rows = []
    for (model, strategy, p), cell in runs[runs["chosen"]].groupby(CELL, sort=False):
        grid = sorted(grids.get_group((model, strategy, p)).unique())
        m = float(cell["lr_multiplier"].iloc[0])
        hit = cell["steps_to_target"].astype(float).dropna().tolist()
        s_mean, s_std = _mean_std(hit)
        e_mean, e_std = _mean_std(list(cell["epochs_to_target"]))
        a_mean, a_std = _mean_std(list(cell["final_acc"]))
        kinds: dict[str, list[float]] = {}
        for value in cell["fidelity_cosine"]:
            for kind, c in (json.loads(value) if isinstance(value, str) and value else {}).items():
                kinds.setdefault(kind, []).append(float(c))
        replicas = bool(cell["replicas_identical"].astype(bool).all()) if p > 1 else None
        pred = float(cell["pred_iteration_s"].astype(float).mean())
        measured = (
            float(cell["step_s"].astype(float).median()) / p if p <= MEASURED_MAX_P else math.nan
        )
        entry = {
            "model": model,
            "strategy": strategy,
            "run_as": ", ".join(sorted(set(cell.get("run_as", [strategy])) - {strategy})),
            "P": int(p),
            "global_batch": int(cell["global_batch"].iloc[0]),
            "target": float(cell["target"].iloc[0]),
            "lr": float(cell["lr"].iloc[0]),
            "lr_multiplier": m,
            # A grid of one point is its own edge: nothing around it was tried.
            "lr_at_grid_edge": m in (grid[0], grid[-1]),
            "val_acc": float(cell["final_val_acc"].mean()),
            "seeds": len(cell),
            "stand_ins": int((cell["run_as"] != strategy).sum()) if "run_as" in cell else 0,
            "reached": len(hit),
            "steps_to_target": s_mean,
            "steps_std": s_std,
            "steps_min": min(hit) if hit else math.nan,
            "steps_max": max(hit) if hit else math.nan,
            "steps_per_epoch": int(cell["steps_per_epoch"].iloc[0]),
            "epochs_to_target": e_mean,
            "epochs_std": e_std,
            "final_acc": a_mean,
            "final_acc_std": a_std,
            **{f"cosine_{k}": _mean_std(v)[0] for k, v in sorted(kinds.items())},
            "replicas_identical": replicas,
            "pred_hardware": str(cell["pred_hardware"].iloc[0]),
            "pred_iteration_ms": 1e3 * pred,
            "pred_time_to_target_s": s_mean * pred if len(hit) == len(cell) else math.nan,
            "measured_ms_per_rank": 1e3 * measured,
            "measured_time_to_target_s": s_mean * measured if len(hit) == len(cell) else math.nan,
            "pred_chosen": str(cell["pred_chosen"].iloc[0] or "") if "pred_chosen" in cell else "",
        }
        rows.append(entry)
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    return in_order(frame, ["model", "P", "strategy"])


def _within(dp: pd.Series, d: pd.Series) -> bool | None:
    """Whether dp_kfac's steps to target sit in d_kfac's seed spread, widened by one
    evaluation (steps to target are only known to the evaluation interval, one epoch).
    None when neither reached the target in every seed (nothing to compare); False when
    d_kfac reached it in every seed and dp_kfac did not."""
    dp_all = bool(dp["reached"] == dp["seeds"])
    if d["reached"] < d["seeds"]:
        return True if dp_all else None
    slack = float(d["steps_per_epoch"])
    inside = d["steps_min"] - slack <= dp["steps_to_target"] <= d["steps_max"] + slack
    return dp_all and bool(inside)


def _compared(cells: pd.DataFrame) -> Iterator[tuple[str, pd.DataFrame, dict, list[int]]]:
    """Per model: its cells, them by (strategy, P), and the P where dp_kfac and d_kfac both ran."""
    if cells.empty:
        return
    for model, g in cells.groupby("model", sort=False):
        by = {(r["strategy"], int(r["P"])): r for _, r in g.iterrows()}
        sizes = sorted(p for s, p in by if s == REFERENCE and (BASELINE, p) in by)
        if sizes:
            yield str(model), g, by, sizes


def takeaway(cells: pd.DataFrame) -> list[str]:
    """The claim, computed: does dp_kfac stay within d_kfac's seed spread as P grows?"""
    lines = []
    for model, g, by, sizes in _compared(cells):
        verdicts = {p: _within(by[(REFERENCE, p)], by[(BASELINE, p)]) for p in sizes}
        outside = [p for p, v in verdicts.items() if v is False]
        within = [p for p, v in verdicts.items() if v is True]
        unknown = [p for p, v in verdicts.items() if v is None]
        target = float(g["target"].iloc[0])
        head = f"**Takeaway ({model}).** dp_kfac's steps to {target:.2f} test accuracy"
        if outside:
            dp, d = by[(REFERENCE, outside[0])], by[(BASELINE, outside[0])]
            text = (
                f"{head} leave d_kfac's seed spread (± one evaluation) from P={outside[0]} "
                f"(dp_kfac {_steps_text(dp)}, d_kfac {d['steps_min']:.0f}–{d['steps_max']:.0f}"
                f" over {int(d['seeds'])} seed(s))"
            )
            if len(outside) > 1:
                text += f"; outside at P={', '.join(str(p) for p in outside)}"
            if within:
                text += f"; within at P={', '.join(str(p) for p in within)}"
        elif within:
            text = (
                f"{head} stay within d_kfac's seed spread (± one evaluation) at every P "
                f"where both reached it ({', '.join(str(p) for p in within)})"
            )
        else:
            text = f"{head}: no P where d_kfac reached the target in every seed"
        if unknown:
            text += (
                f"; not comparable at P={', '.join(str(p) for p in unknown)} "
                "(d_kfac did not reach the target in every seed)"
            )
        lines += [text + ".", *_time_sentence(model, by, sizes)]
    return lines


def headline(cells: pd.DataFrame) -> str | None:
    """The README's line: per model, dp_kfac's and d_kfac's steps to target at the largest P
    both ran, with the seeds behind them (None: no such P yet)."""
    parts = []
    for model, _, by, sizes in _compared(cells):
        p = sizes[-1]
        dp, d = by[(REFERENCE, p)], by[(BASELINE, p)]
        parts.append(
            f"{model} at P={p} (global batch {int(dp['global_batch'])}, "
            f"{int(min(dp['seeds'], d['seeds']))} seed(s)): {REFERENCE} {_steps_text(dp)}, "
            f"{BASELINE} {_steps_text(d)} to {float(dp['target']):.2f}"
        )
    if not parts:
        return None
    return (
        "- **Convergence as P grows** (ranks as threads of one process, per-rank batch fixed; "
        f"`results/convergence_scale.md` says which cells have run): {'; '.join(parts)}."
    )


def _steps_text(r: Mapping[str, Any]) -> str:
    if r["reached"] < r["seeds"]:
        return f"reached in {int(r['reached'])} of {int(r['seeds'])} seed(s)"
    return f"{r['steps_to_target']:.0f} steps"


def _time_sentence(
    model: str, by: Mapping[tuple[str, int], Any], sizes: Sequence[int]
) -> list[str]:
    """Which factor wins for dp_kfac against SGD: fewer steps, or cheaper steps (predicted)."""
    parts = []
    for p in sizes:
        dp, sgd = by[(REFERENCE, p)], by.get((SGD, p))
        if sgd is None or dp["reached"] < dp["seeds"] or sgd["reached"] < sgd["seeds"]:
            continue
        fewer = sgd["steps_to_target"] / dp["steps_to_target"]
        dearer = dp["pred_iteration_ms"] / sgd["pred_iteration_ms"]
        winner = "neither wins"  # within 1% of each other: the ratios are rounded to 0.01
        if fewer > 1.01 * dearer:
            winner = "fewer steps win"
        elif fewer < 1 <= dearer:
            winner = "SGD's steps are fewer and cheaper"
        elif dearer > 1.01 * fewer:
            winner = "cheaper steps win"
        steps = f"{fewer:.2f}x fewer steps" if fewer >= 1 else f"{1 / fewer:.2f}x more steps"
        parts.append(
            f"P={p}: {steps}, each {dearer:.2f}x dearer, {winner} "
            f"({dearer / fewer:.2f}x SGD's time to target)"
        )
    sentence = (
        f"Time to target ({model}), dp_kfac against SGD, steps measured here x seconds per "
        f"step predicted on `{by[(REFERENCE, sizes[0])]['pred_hardware']}`: {'; '.join(parts)}."
    )
    return [sentence] if parts else []


def curves_frame(runs: pd.DataFrame) -> pd.DataFrame:
    """Test accuracy per evaluation of the chosen runs, averaged over seeds."""
    chosen = runs[runs["chosen"]].to_dict("records")
    frame = pd.DataFrame(
        [{k: r[k] for k in CELL} | c for r in chosen for c in json.loads(r["curve"])]
    )
    if frame.empty:
        return frame
    return frame.groupby([*CELL, "step"], as_index=False, sort=False).agg(
        test_acc=("test_acc", "mean"), val_acc=("val_acc", "mean"), epoch=("epoch", "first")
    )


def figure(curves: pd.DataFrame, cells: pd.DataFrame) -> Any:
    """Per model a row of panels: test accuracy against steps, one per P; steps to target vs P.

    Configurations that coincide (every K-FAC config at P=1) would hide one another:
    each gets its own marker and dash, as in the ``convergence`` figure.
    """
    from matplotlib.lines import Line2D

    from experiments.bench import plots

    models = list(dict.fromkeys(cells["model"]))
    sizes = sorted(cells["P"].unique())
    cols = len(sizes) + 1
    fig, axes = plots._figure(len(models), cols, (3.6 * cols, 3.2 * len(models)))
    strategies = plots.ordered(list(cells["strategy"]))
    looks = plots.curve_looks(strategies)
    for row, model in zip(axes, models, strict=True):
        mine = cells[cells["model"] == model]
        target = float(mine["target"].iloc[0])
        for ax, p in zip(row, sizes, strict=False):
            sub = curves[(curves["model"] == model) & (curves["world_size"] == p)]
            for s in plots.ordered(list(sub["strategy"])):
                line = sub[sub["strategy"] == s].sort_values("step")
                ax.plot(line["step"], line["test_acc"], **looks[s])
            ax.axhline(target, color="0.5", linestyle=":", linewidth=1)
            ax.set(title=f"{model}, P={p}", xlabel="optimizer step", ylabel="test accuracy")
        ax = row[-1]
        done = mine[mine["reached"] == mine["seeds"]]
        for s in plots.ordered(list(done["strategy"])):
            line = done[done["strategy"] == s]
            ax.errorbar(
                line["P"], line["steps_to_target"], yerr=line["steps_std"], capsize=3, **looks[s]
            )
        if done.empty:
            ax.text(0.5, 0.5, "target not reached", ha="center", transform=ax.transAxes)
        ax.set_xscale("log", base=2)
        ax.set(yscale="log", title=f"steps to {target:.2f} test accuracy")
        ax.set(xlabel="P (ranks; per-rank batch fixed)", ylabel="steps to target")
    plots._strategy_legend(fig, [Line2D([], [], label=s, **looks[s]) for s in strategies])
    return fig


#: Decimals of the markdown's numeric columns other than two.
_DIGITS = {"pred. ms/step": 3, "CPU s to target": 1, "cosine Linear": 3, "cosine Conv2d": 3}
#: Columns of ``convergence_scale.csv`` (``val_mean`` written as ``val_acc_mean_over_seeds``).
_GRID = [
    "model",
    "strategy",
    "run_as",
    "world_size",
    "global_batch",
    "lr_multiplier",
    "lr",
    "seed",
    "final_val_acc",
    "val_mean",
    "chosen",
    "final_acc",
    "steps_to_target",
    "epochs_to_target",
    "steps",
    "epochs",
    "fidelity_cosine",
    "step_s",
    "pred_iteration_s",
    "replicas_identical",
    "seconds",
]


def _pm(mean: float, std: float, digits: int) -> str:
    return "–" if mean != mean else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _markdown_frame(cells: pd.DataFrame) -> pd.DataFrame:
    """The markdown's main table of one model's cells, under its headers."""
    cosines = [c for c in cells.columns if c.startswith("cosine_")]
    rows = []
    for r in cells.itertuples():
        kind = "=" if r.stand_ins == r.seeds else "with"
        twin = f" ({kind} {r.run_as}'s runs)" if r.run_as else ""
        edge = ", grid edge" if r.lr_at_grid_edge else ""
        missed = f" ({r.reached}/{r.seeds} reached)" if r.reached < r.seeds else ""
        same = r.replicas_identical
        replicas = "–" if same is None or same != same else ("yes" if same else "NO")
        rows.append(
            {
                "configuration": r.strategy + twin,
                "P": r.P,
                "global batch": r.global_batch,
                "lr (chosen on val)": f"{r.lr:.4g} (x{r.lr_multiplier:g}{edge})",
                "seeds": r.seeds,
                "steps to target": _pm(r.steps_to_target, r.steps_std, 0) + missed,
                "epochs to target": _pm(r.epochs_to_target, r.epochs_std, 1),
                "final test acc": _pm(r.final_acc, r.final_acc_std, 4),
                "replicas bitwise": replicas,
                "pred. ms/step": r.pred_iteration_ms,
                "pred. s to target": r.pred_time_to_target_s,
                "CPU ms/step/rank": r.measured_ms_per_rank,
                "CPU s to target": r.measured_time_to_target_s,
                **{f"cosine {c.removeprefix('cosine_')}": getattr(r, c) for c in cosines},
            }
        )
    return pd.DataFrame(rows)


def _points(runs: pd.DataFrame) -> str:
    """One configuration's grid points: its multipliers and seeds, each multiplier's own seeds
    where they differ."""
    seeds = {
        m: ", ".join(str(int(x)) for x in sorted(s.unique()))
        for m, s in runs.groupby("lr_multiplier", sort=True)["seed"]
    }
    if len(set(seeds.values())) == 1:
        only = next(iter(seeds.values()))
        return f"multipliers {', '.join(f'{m:g}' for m in seeds)}; seeds {only}"
    return " ".join(f"x{m:g} (seeds {s})" for m, s in seeds.items())


def coverage(runs: pd.DataFrame, superseded: int = 0) -> list[str]:
    """What the table holds, per (model, P): each configuration's multipliers and seeds
    (configurations with the same points listed together), so a sweep run in parts (rows
    merged with ``tables convergence_scale --rows A B``) shows which grid points it covers;
    the machines the runs came from, and how many earlier runs of a point ran again
    (``superseded``, left out by :func:`latest_runs`)."""
    runs = _with_run_as(runs)
    real = runs[runs["run_as"] == runs["strategy"]]
    again = (
        f" {superseded} earlier run(s) of grid points that ran again are left out: a point "
        "keeps its latest run, and all are in `results/raw/convergence_scale.csv`."
        if superseded
        else ""
    )
    lines = [
        f"Grid points in this table: {len(real)} runs (cells not listed were not run).{again}",
        machines(real),
    ]
    stand_ins = runs[runs["run_as"] != runs["strategy"]]
    for (model, p, x, r), g in stand_ins.groupby(["model", "world_size", "strategy", "run_as"]):
        own = real[(real["model"] == model) & (real["world_size"] == p) & (real["strategy"] == x)]
        lines.append(
            f"{model}, P={int(p)}: {x}'s runs ({_points(own)}) equal {r}'s at the same points "
            f"bitwise (curve and final accuracies), so {r}'s runs stand for {len(g)} more of "
            f"{x}'s grid points (`run_as`)."
        )
    for (model, p), g in real.groupby(["model", "world_size"], sort=True):
        same: dict[str, list[str]] = {}
        for strategy, c in g.groupby("strategy", sort=True):
            same.setdefault(_points(c), []).append(str(strategy))
        parts = "; ".join(f"{', '.join(names)}: {points}" for points, names in same.items())
        lines.append(f"- {model}, P={int(p)} ({len(g)} runs): {parts}")
    return lines


def write_convergence_scale(df: pd.DataFrame, out: Path) -> dict[str, Path]:
    """``results/convergence_scale.*``: every grid point (CSV), chosen cells (md), figure."""
    from experiments.bench.pages import footer, ok_rows, to_markdown, with_takeaway, write_page

    runs = ok_rows(df, TASK)
    paths = {"csv": out / "convergence_scale.csv"}
    if runs.empty:
        pd.DataFrame().to_csv(paths["csv"], index=False)
        md = ["# Convergence as P grows (MNIST-1D)", "", "No successful runs."]
        paths["md"] = write_page(out / "convergence_scale.md", md + footer(df))
        return paths
    if "pred_chosen" in runs:  # empty in a CSV read back: NaN, which is truthy
        runs["pred_chosen"] = runs["pred_chosen"].fillna("")
    latest = latest_runs(runs)
    superseded = len(runs) - len(latest)
    runs = choose_lr(with_same_step_stand_ins(with_steps_to_target(latest)))
    grid = runs[_GRID].rename(columns={"val_mean": "val_acc_mean_over_seeds"})
    grid.to_csv(paths["csv"], index=False)
    cells = cells_frame(runs)
    paths["cells"] = out / "convergence_scale_cells.csv"
    cells.to_csv(paths["cells"], index=False)
    first = runs.iloc[0]
    per_model = runs.groupby("model", sort=False)
    rules = "; ".join(f"{rule} ({m})" for m, rule in per_model["lr_rule"].first().items())
    targets = ", ".join(f"{m} {t:.2f}" for m, t in per_model["target"].first().items())
    md = [
        "# Convergence as P grows: steps to a target accuracy, and their cost",
        "",
        "Every rank a thread of one process (`launcher=threads`), the training entry point's",
        f"own loop; per-rank batch {int(first['batch_size'])} (the global batch grows with P);",
        f"learning-rate rule: {rules}, the multiplier chosen per (model,",
        "configuration, P) on the validation split's final accuracy (mean over seeds), never",
        "on the test set (every grid point is in `convergence_scale.csv`; `grid edge`: the",
        "best multiplier is the grid's smallest or largest, or the only one run; the",
        "multipliers run with the most seeds are compared on the seeds they share, so one",
        "lucky seed cannot beat three, and extra seeds can overturn a seed-0 screening).",
        "Steps and epochs to target: the",
        "evaluation (one per epoch) from which the test accuracy stays at or above the target",
        "to the end of the run (not its first crossing, which noise decides where a run",
        "plateaus near the target), mean ± std",
        "over the seeds that reached it; the takeaway's spread is d_kfac's min–max over",
        "seeds widened by one evaluation interval. cosine: the fidelity probe (owner-local",
        "against all-ranks factors, on the owner; every strategy config measures it, only",
        "those that precondition with local factors apply the local one; 1 at P=1 by",
        "construction), mean per layer kind over the run's probes. pred.: the cost model's",
        "seconds per step (`dpkfac.costmodel.predict`, `iteration_avg`) on",
        f"`{first['pred_hardware']}` for the same model, per-rank batch and P, times the steps",
        "to target. CPU ms/step/rank: the measured in-process step of all P ranks divided by",
        f"P, at P ≤ {MEASURED_MAX_P} only ({first.get('cpus', '?')} CPU cores, shared with",
        "whatever else ran).",
        f"Targets: {targets}.",
        "",
        *coverage(runs, superseded),
    ]
    for model, g in cells.groupby("model", sort=False):
        md += ["", f"## {model}", "", to_markdown(_markdown_frame(g), _DIGITS)]
        for r in g[g["pred_chosen"].astype(bool)].itertuples():
            md.append(f"\n{r.strategy} at P={r.P}: the cost model chose {r.pred_chosen}.")
    md += footer(df)
    paths["md"] = write_page(out / "convergence_scale.md", with_takeaway(md, takeaway(cells)))
    from experiments.bench import plots

    paths["png"] = plots.save(figure(curves_frame(runs), cells), out / "convergence_scale.png")
    return paths
