"""Hydra entry point: ``python -m experiments.train [overrides]``.

Composes ``conf/config.yaml`` (default ``experiment=digits_cnn``), validates it,
joins the process group torchrun describes (if any), builds data, model,
optimizer, LR schedule and K-FAC preconditioner from the config's ``_target_``
nodes (the ``strategy`` node through
:func:`experiments.preconditioning.build_preconditioner`) and hands them to the
:class:`~experiments.trainer.Trainer`.

Under ``torchrun --nproc_per_node=N -m experiments.train ...`` every rank runs
this; logging, the progress bar, W&B and checkpoints are rank 0's. With
``launcher=threads launcher.world_size=N`` one process runs N ranks, a thread
each, over an in-process group (:mod:`experiments.threads`). When torchrun
restarts the ranks (``--max-restarts``), the run folder is the same (named after
the rendezvous id) and ``trainer.resume=auto`` continues from its last checkpoint.
"""

from __future__ import annotations

import copy
import logging
import os
import random
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from experiments import network as network_lib
from experiments.config import ExperimentError, first_line, launcher_name, validate
from experiments.data.loading import DataModule
from experiments.distributed import (
    DistEnv,
    available_cores,
    distributed_context,
    threads_per_rank,
    wrap_ddp,
)
from experiments.hf_loop import fit_with_hf_trainer
from experiments.loggers import NullLogger
from experiments.preconditioning import strategy_name, uses_preconditioner
from experiments.schedules import build_step_schedules
from experiments.trainer import Trainer, total_steps

log = logging.getLogger(__name__)


def _instantiate(
    node: DictConfig | dict[str, Any],
    group: str,
    *call_args: Any,
    call_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """``hydra.utils.instantiate`` (then a call of the partial) with the group named in errors.

    A constructor's ``TypeError`` (e.g. ``optimizer=adamw`` left with an SGD-only
    key by a preset) would otherwise surface as a long Hydra traceback; this keeps
    its first line and says which config group to look at.

    Args:
        node: The group's config node.
        group: The group name, for the message.
        *call_args: When given, the instantiated ``_partial_`` is called with them.
        call_kwargs: Keyword arguments of that call (objects Hydra should not see:
            its ``instantiate`` would merge them into the config).
        **kwargs: Extra keyword arguments for ``instantiate``.
    """
    try:
        built = instantiate(node, **kwargs)
        if call_args or call_kwargs:
            return built(*call_args, **(call_kwargs or {}))
        return built
    except (InstantiationException, TypeError, ValueError) as exc:
        cause = exc.__cause__ if isinstance(exc, InstantiationException) and exc.__cause__ else exc
        if isinstance(cause, ExperimentError):
            raise cause from None
        log.debug("building %s failed", group, exc_info=True)
        raise ExperimentError(
            f"cannot build {group} ({node.get('_target_')}): {first_line(cause)}"
        ) from None


def _wrap_model(model: nn.Module, cfg: DictConfig, env: DistEnv) -> nn.Module:
    """DistributedDataParallel when gradients need averaging by it.

    A K-FAC preconditioner averages gradients itself (and accounts for the traffic)
    unless ``trainer.ddp`` asks for DDP; the first-order baseline has nobody else
    to do it, so it always gets DDP when there is more than one rank. So does an
    fp16 run: its loss scaler decides whether to skip a step from the unscaled
    gradients, which must already be averaged, or the ranks would disagree.
    """
    if not env.distributed:
        return model
    fp16 = str(cfg.trainer.get("precision", 32)) == "fp16"
    if uses_preconditioner(cfg.strategy) and not cfg.trainer.ddp and not fp16:
        return model
    return wrap_ddp(model, env.device)


def _output_dir(cfg: DictConfig, env: DistEnv) -> Path:
    """Rank 0's run folder, shared with every rank.

    Each rank's Hydra picks a time-stamped folder of its own; ranks that start in
    different seconds would disagree, so rank 0's choice is the one used.
    """
    return Path(env.broadcast_object(str(cfg.output_dir) if env.is_main else None))


def _precision(cfg: DictConfig, env: DistEnv) -> tuple[torch.dtype | None, Any]:
    """The autocast dtype and the loss scaler of ``trainer.precision``.

    Returns:
        (None, None) for 32; (bfloat16, None) for bf16, whose range needs no loss
        scaling; (float16, a ``torch.amp.GradScaler`` of the run's device) for fp16.
    """
    precision = str(cfg.trainer.get("precision", 32))
    if precision == "bf16":
        return torch.bfloat16, None
    if precision == "fp16":
        return torch.float16, torch.amp.GradScaler(env.device.type)
    return None, None


def _build_preconditioner(
    cfg: DictConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps_per_epoch: int,
    scaler: Any,
) -> Any:
    """The ``strategy`` node's preconditioner, with what only the run knows.

    Schedule nodes among its values (``strategy.damping: {_target_: ...}``) are
    completed with ``steps_per_epoch`` (:func:`experiments.schedules.build_step_schedules`);
    the kl_clip learning rate is the optimizer's current one; the micro-batches per
    step and the fp16 loss scaler come from the trainer settings. These are passed
    to the instantiated partial, not through Hydra, which would turn the objects
    into config nodes.
    """
    try:
        schedules = build_step_schedules(cfg.strategy, steps_per_epoch)
    except ValueError as err:
        raise ExperimentError(f"cannot build strategy.{err}") from None
    node = OmegaConf.to_container(cfg.strategy, resolve=True)
    assert isinstance(node, dict)
    for key in schedules:
        node.pop(key)
    return _instantiate(
        node,
        "strategy",
        call_kwargs={
            "model": model,
            # kl_clip needs the lr actually applied, which the schedule changes.
            "lr": lambda _step: optimizer.param_groups[0]["lr"],
            "accumulation_steps": int(cfg.trainer.get("accumulate_grad_batches", 1)),
            "grad_scaler": scaler,
            **schedules,
        },
        _partial_=True,
    )


def _check_restartable(cfg: DictConfig) -> None:
    """Refuse an elastic run whose restarts could not find its checkpoints.

    torchrun ``--max-restarts=N`` starts every rank again after a failure, and
    ``trainer.resume=auto`` continues from ``<run dir>/checkpoints/last.pt``. The
    run dir is named after the rendezvous id (``DPKFAC_RUN_ID``, see
    ``experiments/__init__.py``); under the static rendezvous (``--master-port``)
    there is none, and a time-stamped folder would differ on every attempt.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    resume = cfg.trainer.get("resume")
    if restarts == 0 or os.environ.get("DPKFAC_RUN_ID") or resume != "auto":
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        return
    given = [*hydra_cfg.overrides.hydra, *hydra_cfg.overrides.task]
    if any(o.lstrip("+~").startswith(("hydra.run.dir=", "output_dir=")) for o in given):
        return
    raise ExperimentError(
        f"torchrun --max-restarts={restarts} restarts every rank, and a restarted run resumes "
        "from <run dir>/checkpoints/last.pt, but this run's folder is named by its start time: "
        "pass --rdzv-id=ID (or --standalone), or hydra.run.dir=DIR"
    )


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def summary_line(result: dict[str, Any], output_dir: Path) -> str:
    """The run's last line: strategy, world size, final metric, wall time and folder."""
    metric = result.get("primary_metric", "")
    value = result.get(metric)
    shown = f"{metric} {value:.4f}" if isinstance(value, float) else f"{metric} {value}"
    return (
        f"done: strategy {result.get('strategy')}, world size {result.get('world_size')}, "
        f"{shown}, {result.get('steps')} steps in {result.get('wall_time_s', 0.0):.1f} s, "
        f"output {output_dir}"
    )


def _sweep_group() -> str | None:
    """The W&B group of a sweep's runs: the sweep's folder name (None outside a sweep)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    sweep = Path(hydra_cfg.sweep.dir)
    return f"{sweep.parent.name}/{sweep.name}"


def _job_identity() -> str | None:
    """This Hydra job's number and overrides (None outside a Hydra app, as in tests)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    return f"job {hydra_cfg.job.get('num', 0)}: {' '.join(hydra_cfg.overrides.task)}"


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run one experiment from a composed config; returns the final metrics.

    Tests call this with a config from ``hydra.compose``; the command line goes
    through :func:`main`. With ``launcher=threads`` every rank runs here, one
    thread each (:func:`_run_threads`); otherwise this process is one rank.

    Raises:
        ExperimentError: A bad value, missing data or an unusable checkpoint.
    """
    validate(cfg)
    threaded = launcher_name(cfg) == "threads"
    network = network_lib.from_config(cfg.get("network"))
    if network is not None and "WORLD_SIZE" not in os.environ:
        return _run_on_network(cfg, network, threaded)
    previous = torch.get_num_threads()
    torch.set_num_threads(
        threads_per_rank(cfg.trainer.get("threads", "auto"), 1 if threaded else None)
    )
    try:
        if threaded:
            return _run_threads(cfg)
        with distributed_context(
            cfg.trainer.device, cfg.trainer.dist_timeout_s, job=_job_identity()
        ) as env:
            if not env.is_main:
                logging.getLogger().setLevel(logging.WARNING)
            return _run_rank(cfg, env)
    finally:
        torch.set_num_threads(previous)  # a caller's own setting (tests, notebooks)


def _run_on_network(
    cfg: DictConfig, network: network_lib.Network, threaded: bool
) -> dict[str, Any]:
    """``network=emulated``: ``network.world_size`` ranks, a node each; rank 0's result.

    The ranks are those torchrun would start on a cluster of that many nodes (the
    benchmark's launcher, :func:`experiments.bench.launch.launch`, one elastic agent per
    node), each running :func:`run` on this config, resolved here so that every rank
    writes to this run's folder. The host's cores are shared out among the ranks.

    Raises:
        ExperimentError: ``launcher=threads`` (its ranks share one process, so no network
            lies between them), a world size that fills fewer than two nodes, or
            (:class:`experiments.network.NetworkUnavailable`) a host that cannot build it.
    """
    from experiments.bench.launch import launch

    if threaded:
        raise ExperimentError(
            "network=emulated with launcher=threads: threads of one process share no network; "
            "use launcher=torchrun (the default)"
        )
    world_size = cfg.network.get("world_size")
    if not isinstance(world_size, int) or isinstance(world_size, bool):
        raise ExperimentError(
            f"invalid value network.world_size={world_size!r}: expected a positive integer"
        )
    network.nodes(world_size)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    threads = max(1, available_cores() // world_size)
    log.info("training on %s, %d rank(s), %d thread(s) each", network.label, world_size, threads)
    # The ranks unpickle their function by module name, which is not ``__main__`` there.
    from experiments import train as importable

    spec = {"config": resolved}
    result: dict[str, Any] = launch(
        importable._network_rank, spec, world_size, threads=threads, network=network
    )[0]
    assert isinstance(resolved, dict)
    log.info("%s", summary_line(result, Path(resolved["output_dir"])))
    return result


def _network_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank of ``network=emulated`` (started by the elastic agent of its node)."""
    return run(OmegaConf.create(spec["config"]))


def _run_threads(cfg: DictConfig) -> dict[str, Any]:
    """``launcher=threads``: every rank a thread of this process; rank 0's result.

    Each rank gets its own copy of the config and runs :func:`_run_rank`, the
    body a torchrun rank runs, over the in-process group of
    :mod:`experiments.threads` (which also keeps other ranks' logging below
    WARNING quiet, and gives each rank its own random streams).

    Raises:
        ExperimentError: Started under torchrun, or a rank's own ExperimentError.
        RankFailed: A rank raised anything else (names the first rank that did).
    """
    from experiments.threads import RankFailed, launch

    if "WORLD_SIZE" in os.environ or torch.distributed.is_initialized():
        raise ExperimentError(
            "launcher=threads runs every rank in this process: start it with "
            "python -m experiments.train, not under torchrun or in a process group"
        )

    def rank_main(rank: int, world_size: int) -> dict[str, Any]:
        env = DistEnv(rank, world_size, rank, torch.device("cpu"))
        return _run_rank(copy.deepcopy(cfg), env)

    try:
        results = launch(
            rank_main, int(cfg.launcher.world_size), timeout_s=float(cfg.trainer.dist_timeout_s)
        )
    except RankFailed as failure:
        if isinstance(failure.error, ExperimentError):
            raise failure.error from None
        raise
    return results[0]


@dataclass
class Components:
    """What a run trains, whichever loop trains it: data, model, optimizer, schedule.

    Attributes:
        data: The set-up data module.
        model: The model on the run's device, not wrapped in DDP (each loop wraps it).
        optimizer: The first-order optimizer over the model's parameters.
        scheduler: The per-step learning-rate schedule.
        steps_per_epoch: Optimizer steps of an epoch (``trainer.accumulate_grad_batches``
            micro-batches each).
    """

    data: DataModule
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    steps_per_epoch: int


def build_components(cfg: DictConfig, env: DistEnv, scratch: Path) -> Components:
    """Data, model, optimizer and schedule of ``cfg``, seeded as a run seeds them.

    One function for the project loop, ``trainer.loop=hf`` and the integration tests'
    accelerate and Lightning loops, so that every loop starts from the same weights on the
    same data and can be compared with the others update for update.

    Args:
        cfg: The composed (validated) configuration.
        env: This process's place in the run.
        scratch: A private folder for fake data and caches, alive while the data is used.

    Raises:
        ExperimentError: Missing data, an epoch shorter than one step, or a group that
            cannot be built.
    """
    _seed(cfg.seed)
    data: DataModule = _instantiate(cfg.data, "data")
    data.setup(env, scratch)
    accumulate = int(cfg.trainer.get("accumulate_grad_batches", 1))
    steps_per_epoch = data.steps_per_epoch(env, accumulate)
    batches = data.steps_per_epoch(env)
    if batches and not steps_per_epoch:
        raise ExperimentError(
            f"{data.name}: an epoch has {batches} batch(es) of data.batch_size="
            f"{data.batch_size} per rank, fewer than trainer.accumulate_grad_batches="
            f"{accumulate}"
        )
    # Same seed on every rank: identical initial replicas without a broadcast.
    model = _instantiate(cfg.model, "model", **data.model_kwargs()).to(env.device)
    lr = cfg.optimizer.lr * (env.world_size if cfg.trainer.scale_lr else 1)
    optimizer = _instantiate(cfg.optimizer, "optimizer", model.parameters(), lr=lr)
    scheduler = _instantiate(
        cfg.scheduler,
        "scheduler",
        optimizer,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps(cfg.trainer, steps_per_epoch),
    )
    return Components(data, model, optimizer, scheduler, steps_per_epoch)


def _run_rank(cfg: DictConfig, env: DistEnv) -> dict[str, Any]:
    """One rank of a run, in a joined process group (or alone): build everything, train."""
    with tempfile.TemporaryDirectory(prefix="dpkfac-") as scratch:
        output_dir = _output_dir(cfg, env)
        parts = build_components(cfg, env, Path(scratch))
        accumulate = int(cfg.trainer.get("accumulate_grad_batches", 1))
        hf_loop = cfg.trainer.get("loop", "project") == "hf"
        log.info(
            "strategy %s, %d rank(s), precision %s, %d micro-batch(es) per step, "
            "%d thread(s) per rank of %d core(s)%s",
            strategy_name(cfg.strategy),
            env.world_size,
            cfg.trainer.get("precision", 32),
            accumulate,
            torch.get_num_threads(),
            available_cores(),
            ", Hugging Face Trainer with dpkfac's KFACCallback" if hf_loop else "",
        )
        if hf_loop:
            result = fit_with_hf_trainer(cfg, env, parts, output_dir)
            if env.is_main:
                log.info("%s", summary_line(result, output_dir))
            return result
        autocast_dtype, scaler = _precision(cfg, env)
        model = _wrap_model(parts.model, cfg, env)  # Hugging Face Trainer wraps its own
        preconditioner = None
        if uses_preconditioner(cfg.strategy):
            preconditioner = _build_preconditioner(
                cfg, model, parts.optimizer, parts.steps_per_epoch, scaler
            )
            log.info("%r", preconditioner)
            log.info("gradients: %s", preconditioner.gradient_path)
        # From here on, ranks draw from streams of their own (dropout, ...).
        _seed(cfg.seed + env.rank)

        logger = NullLogger()
        if env.is_main:
            # A partial, so the resolved config is not itself searched for `_target_`s.
            extra = {}
            if not cfg.logger.get("group") and (group := _sweep_group()):
                extra["group"] = group  # the runs of a sweep, together in W&B
            logger = _instantiate(cfg.logger, "logger", _partial_=True)(
                name=cfg.name,
                dir=str(output_dir),
                run_config=OmegaConf.to_container(cfg, resolve=True),
                **extra,
            )
        try:
            trainer = Trainer(
                cfg=cfg,
                env=env,
                data=parts.data,
                model=model,
                optimizer=parts.optimizer,
                scheduler=parts.scheduler,
                preconditioner=preconditioner,
                logger=logger,
                output_dir=output_dir,
                scaler=scaler,
                autocast_dtype=autocast_dtype,
            )
            result = trainer.fit()
        finally:
            logger.finish()
        if env.is_main:
            log.info("%s", summary_line(result, output_dir))
        return result


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float:
    """Command-line entry; returns the primary metric (for Hydra sweepers)."""
    try:
        _check_restartable(cfg)
        result = run(cfg)
    except ExperimentError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    return float(result[result["primary_metric"]])


if __name__ == "__main__":
    main()
