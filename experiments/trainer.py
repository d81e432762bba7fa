"""The training loop: steps, evaluation, logging and checkpoints.

One iteration is ``loss.backward(); pre.step(); optimizer.step();
scheduler.step()``: the preconditioner averages the gradients (unless DDP
already did) and replaces them with the preconditioned ones before the
first-order optimizer applies momentum and weight decay. With
``trainer.accumulate_grad_batches=k`` the backward pass runs on k micro-batches
first (loss divided by k, DDP synchronising on the last one only); with
``trainer.precision=fp16`` the loss is scaled by a ``GradScaler`` and the
gradients unscaled before ``pre.step()``; with ``trainer.max_grad_norm`` the
preconditioned gradients are clipped before ``optimizer.step()``. Progress is counted in optimizer
steps; the epoch and the position inside it follow from the step, which is
what lets a resumed run continue bitwise.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from experiments.checkpoint import (
    FORMAT_VERSION,
    CheckpointDir,
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
    resume_path,
)
from experiments.data.loading import DataModule, epoch_sampler
from experiments.distributed import DistEnv, broadcast_buffers, check_replicas, unwrap
from experiments.loggers import NullLogger, fidelity_metrics, flatten_stats, write_json
from experiments.preconditioning import strategy_name
from experiments.tasks.base import evaluate_sets, to_device

log = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1
#: Test-only fault injection (see :meth:`Trainer._inject_fault`).
KILL_AT_STEP_ENV = "DPKFAC_TEST_KILL_AT_STEP"
KILL_RANK_ENV = "DPKFAC_TEST_KILL_RANK"


def total_steps(trainer_cfg: DictConfig, steps_per_epoch: int) -> int:
    """Steps of the whole run: ``max_steps`` when set, else ``max_epochs`` full epochs."""
    if trainer_cfg.max_steps is not None:
        return int(trainer_cfg.max_steps)
    return int(trainer_cfg.max_epochs) * steps_per_epoch


class Trainer:
    """Runs one experiment to the end (or continues one from a checkpoint).

    Args:
        cfg: The composed configuration (``trainer``, ``seed``, ``name`` are read).
        env: This process's place in the run.
        data: The set-up data module.
        model: The model, possibly wrapped in DistributedDataParallel.
        optimizer: The first-order optimizer.
        scheduler: The per-step LR scheduler.
        preconditioner: A ``dpkfac.KFACPreconditioner``, or None for first order.
        logger: The experiment tracker (a NullLogger on ranks other than 0).
        output_dir: Run folder for checkpoints and ``metrics.json``.
        scaler: The fp16 ``GradScaler`` (None otherwise); the preconditioner was
            given the same one.
        autocast_dtype: The ``torch.autocast`` dtype (None: float32 throughout).
    """

    def __init__(
        self,
        *,
        cfg: DictConfig,
        env: DistEnv,
        data: DataModule,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: LRScheduler,
        preconditioner: Any | None,
        logger: NullLogger,
        output_dir: Path,
        scaler: torch.amp.GradScaler | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        self.cfg = cfg
        self.settings = cfg.trainer
        self.env = env
        self.data = data
        self.task = data.build_task()
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.pre = preconditioner
        self.logger = logger
        self.output_dir = output_dir
        self.scaler = scaler
        self.autocast_dtype = autocast_dtype
        self.accumulate = int(self.settings.get("accumulate_grad_batches", 1))
        clip = self.settings.get("max_grad_norm")
        self.max_grad_norm = None if clip is None else float(clip)
        # The strategy config's name (``none`` for first order), as runs report it.
        self.strategy = strategy_name(cfg.strategy) if preconditioner is not None else "none"
        self.train_loader = data.train_loader(env, cfg.seed)
        self.eval_loader = data.eval_loader(env)
        # Scored beside the test set where the data has a validation split (val_<metric>).
        self.val_loader = data.val_loader(env)
        self.steps_per_epoch = data.steps_per_epoch(env, self.accumulate)
        # Examples of one optimizer step, over all ranks.
        self.samples_per_step = data.batch_size * self.accumulate * env.world_size
        self.total_steps = total_steps(self.settings, self.steps_per_epoch)
        self.checkpoints = CheckpointDir(output_dir / "checkpoints", self.settings.keep_checkpoints)
        self.step = 0
        self.history: list[dict[str, float]] = []
        # Bytes handed to K-FAC's collectives in the logging intervals already closed.
        self._kfac_bytes = 0
        self._kill_at = self._fault_step()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """``torch.autocast`` at the run's precision (a no-op context for float32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.env.device.type, dtype=self.autocast_dtype)

    # -- checkpoints ------------------------------------------------------------------

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint of the current step (rank 0 writes; all ranks must call).

        Every rank's RNG states are gathered into the file, since dropout and the
        like draw from per-rank streams; the preconditioner's state is a collective
        too (under dp-kfac each rank holds its own layers' factors).
        """
        broadcast_buffers(self.model, self.env)
        rng = self.env.gather_objects(capture_rng_state())
        pre_state = self.pre.state_dict() if self.pre is not None else None
        if not self.env.is_main:
            return None
        state = {
            "format": FORMAT_VERSION,
            "step": self.step,
            "world_size": self.env.world_size,
            "strategy": self.strategy,
            "model": unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "preconditioner": pre_state,
            "rng": rng,
            "history": self.history,
            "config": OmegaConf.to_yaml(self.cfg),
        }
        path = self.checkpoints.save(state, self.step)
        log.info("checkpoint written: %s", path)
        return path

    def restore(self, path: str | Path) -> None:
        """Continue from a checkpoint: every piece of state, then this rank's RNG.

        A checkpoint of another world size (an elastic restart with fewer or more
        workers) is continued with a warning instead of refused: the step count,
        model, optimizer, schedule and K-FAC factors carry over, but the data
        shards, the steps per epoch and the layer placement follow the new world
        size, and the per-rank RNG streams cannot be restored, so every rank is
        reseeded from (seed, rank, step). No bitwise guarantee then.
        """
        ckpt = load_checkpoint(path, self.env.world_size, self.strategy)
        saved_size = int(ckpt["world_size"])
        resized = saved_size != self.env.world_size
        if resized:
            log.warning(
                "resuming %s, written by %d rank(s), with %d: continuing without a bitwise "
                "guarantee (the per-rank RNG states cannot be restored for a different world "
                "size, so every rank is reseeded from seed, rank and step; data shards and "
                "steps per epoch follow the new world size; K-FAC layers are placed again)",
                path,
                saved_size,
                self.env.world_size,
            )
        unwrap(self.model).load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        base_lrs = list(getattr(self.scheduler, "base_lrs", []))
        self.scheduler.load_state_dict(ckpt["scheduler"])
        if resized and self.settings.scale_lr:
            self._rescale_lr(base_lrs)
        if self.scaler is not None and ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        if self.pre is not None:
            # load_state_dict moves the (CPU) tensors to each layer's device itself.
            self.pre.load_state_dict(ckpt["preconditioner"], allow_world_size_change=resized)
        self.step = int(ckpt["step"])
        self.history = list(ckpt.get("history", []))
        if resized:
            seed = hash((int(self.cfg.seed), self.env.rank, self.step)) & _SEED_MASK
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.manual_seed(seed)
        else:
            restore_rng_state(ckpt["rng"][self.env.rank])
        log.info("resumed from %s at step %d", path, self.step)

    def _rescale_lr(self, base_lrs: list[float]) -> None:
        """Keep this run's (world-size-scaled) base lr after loading another world size's state.

        The optimizer and scheduler states carry the old run's ``lr x P``; the
        linear scaling rule wants this run's P, at the schedule's current point.
        """
        lambdas = getattr(self.scheduler, "lr_lambdas", None)
        if not base_lrs or lambdas is None:
            return
        self.scheduler.base_lrs = base_lrs
        step = self.scheduler.last_epoch
        groups = self.optimizer.param_groups
        for group, base, factor in zip(groups, base_lrs, lambdas, strict=True):
            group["initial_lr"] = base
            group["lr"] = base * factor(step)
        log.warning("learning rate rescaled to this world size: %.6g", groups[0]["lr"])

    # -- loop -------------------------------------------------------------------------

    def train_step(self, batches: Sequence[Any]) -> torch.Tensor:
        """One optimizer step on ``accumulate_grad_batches`` micro-batches; returns the mean loss.

        Each micro-batch's loss is divided by their number, so the summed
        gradients are those of the whole batch; under DDP only the last backward
        pass all-reduces (``no_sync`` before). With fp16 the scaled gradients are
        unscaled before ``pre.step()`` (K-FAC and the KL clip see true values)
        and ``scaler.step`` skips the update when they overflowed; under the
        overlapped mode (``pre.takes_scaled_gradients``), where a rank holds
        unreduced gradients of the layers it does not own until ``pre.step()``
        has exchanged the updates, ``pre.step()`` comes first and ``scaler.step``
        unscales and decides on gradients every rank holds alike. With
        ``trainer.max_grad_norm`` the clip comes after ``pre.step()``: it bounds the
        preconditioned, unscaled update the optimizer applies (as Hugging Face
        Trainer's ``max_grad_norm`` does under dpkfac's ``KFACCallback``).
        """
        k = len(batches)
        ddp = isinstance(self.model, nn.parallel.DistributedDataParallel)
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        for i, batch in enumerate(batches):
            last = i == k - 1
            sync = contextlib.nullcontext() if last or not ddp else self.model.no_sync()
            with sync:
                with self._autocast():
                    loss = self.task.training_loss(self.model, to_device(batch, self.env.device))
                scaled = loss / k if k > 1 else loss
                if self.scaler is not None:
                    scaled = self.scaler.scale(scaled)
                scaled.backward()
            losses.append(loss.detach())
        scaled = self.pre is not None and self.pre.takes_scaled_gradients
        if self.scaler is not None and not scaled:
            self.scaler.unscale_(self.optimizer)
        if self.pre is not None:
            self.pre.step()
        if self.max_grad_norm is not None:
            if self.scaler is not None and scaled:
                # Every rank holds the same updates now: unscaled here (scaler.step does not
                # unscale twice), the clip bounds true values.
                self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        return losses[0] if k == 1 else torch.stack(losses).mean()

    def _fault_step(self) -> int | None:
        """The step after which this rank kills itself (tests of elastic restarts), or None.

        ``DPKFAC_TEST_KILL_AT_STEP=N`` makes rank ``DPKFAC_TEST_KILL_RANK``
        (default 1) end itself with SIGKILL right after optimizer step N, on
        torchrun's first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), so the
        restarted run goes through. Never set outside tests.
        """
        at = os.environ.get(KILL_AT_STEP_ENV)
        if not at or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return None
        if self.env.rank != int(os.environ.get(KILL_RANK_ENV, "1")):
            return None
        return int(at)

    def _inject_fault(self) -> None:
        if self._kill_at is not None and self.step == self._kill_at:
            log.warning(
                "test fault injection: killing rank %d after step %d", self.env.rank, self.step
            )
            os.kill(os.getpid(), signal.SIGKILL)

    def _log_training(self, loss_sum: torch.Tensor, count: int, seconds: float) -> float:
        loss = float(self.env.mean(loss_sum / count))
        metrics = {
            "train/loss": loss,
            "train/lr": self.optimizer.param_groups[0]["lr"],
            "train/epoch": self.step / self.steps_per_epoch,
            "train/step_time_s": seconds / count,
            "train/samples_per_s": count * self.samples_per_step / seconds,
        }
        if self.pre is not None:
            # Statistics of rank 0, per logging interval.
            self._kfac_bytes += _total_bytes(self.pre.comm_stats())
            metrics.update(flatten_stats("kfac/comm", self.pre.comm_stats()))
            metrics.update(flatten_stats("kfac/time_s", self.pre.timings()))
            metrics.update(flatten_stats("kfac/memory", self.pre.memory_usage()))
            self.pre.reset_stats()
        self.logger.log(metrics, step=self.step)
        return loss

    def _evaluate(
        self, train_loss: float = math.nan, seconds: float = math.nan
    ) -> dict[str, float]:
        """Score the model; the history entry also keeps the training side of the interval.

        The evaluation set's metrics keep their names (``accuracy``, the primary
        metric); a validation split's come as ``val_<name>`` beside them.

        Args:
            train_loss: Mean training loss (over ranks) since the previous evaluation.
            seconds: Wall-clock seconds of this run so far.
        """
        broadcast_buffers(self.model, self.env)
        loaders = [self.eval_loader, *([self.val_loader] if self.val_loader is not None else [])]
        with self._autocast():
            # Both sets in one round of collectives (one rendezvous of every rank, not two).
            metrics, *val = evaluate_sets(self.task, self.model, loaders, self.env)
        if val:
            metrics.update({f"val_{k}": v for k, v in val[0].items()})
        epoch = self.step / self.steps_per_epoch
        self.history.append(
            {
                "step": self.step,
                "epoch": epoch,
                **metrics,
                "train_loss": train_loss,
                "wall_time_s": seconds,
            }
        )
        self.logger.log({f"eval/{k}": v for k, v in metrics.items()}, step=self.step)
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if not k.endswith("examples"))
        log.info("epoch %.4g (step %d): test %s", epoch, self.step, shown)
        return metrics

    def _log_fidelity(self) -> None:
        """Log the curvature-fidelity probe's values when the step just taken ran it.

        ``fidelity/<layer>/cosine`` and ``fidelity/<layer>/rel_error`` at the
        logging step of that optimizer step; the values are the same on every
        rank, so only rank 0 reads them (the others' logger discards anyway).
        """
        every = getattr(getattr(self.pre, "options", None), "fidelity_every", 0)
        if not every or not self.env.is_main:
            return
        probed = self.pre.steps - 1  # the preconditioner's index of the step just taken
        if probed % every:
            return
        metrics = fidelity_metrics(self.pre.fidelity(), probed)
        if metrics:
            self.logger.log(metrics, step=self.step)

    def _due(self, every: int | None) -> bool:
        return every is not None and self.step % every == 0

    def fit(self) -> dict[str, Any]:
        """Train to ``total_steps``, evaluating and checkpointing on the way.

        Returns:
            The final evaluation metrics plus run facts (also in ``metrics.json``).
        """
        # Rank 0 decides (it writes the checkpoints), so all ranks agree on it.
        chosen = resume_path(self.settings.resume, self.output_dir) if self.env.is_main else None
        chosen = self.env.broadcast_object(str(chosen) if chosen is not None else None)
        if chosen is not None:
            self.restore(chosen)
        # from_pretrained() returns a model in eval mode: without this, dropout
        # and K-FAC's capture hooks (which skip eval-mode forwards) stay off.
        self.model.train()
        sampler = epoch_sampler(self.train_loader)
        start, started_at = self.step, time.perf_counter()
        final: dict[str, float] | None = None
        loss_sum = torch.zeros((), device=self.env.device)
        count, interval_start, last_loss = 0, time.perf_counter(), math.nan
        # Training loss since the last evaluation (for the history, e.g. per epoch).
        eval_loss_sum = torch.zeros((), device=self.env.device)
        eval_count = 0
        bar = tqdm(
            total=self.total_steps,
            initial=self.step,
            desc=self.cfg.name,
            disable=not (self.env.is_main and self.settings.progress_bar),
            dynamic_ncols=True,
        )
        with logging_redirect_tqdm():
            while self.step < self.total_steps:
                epoch, position = divmod(self.step, self.steps_per_epoch)
                sampler.set_epoch(epoch, position * self.data.batch_size * self.accumulate)
                batches = iter(self.train_loader)
                # steps_per_epoch whole groups of micro-batches; a trailing partial
                # group (batches % k) is left out of the epoch, like drop_last.
                for _ in range(self.steps_per_epoch - position):
                    loss = self.train_step([next(batches) for _ in range(self.accumulate)])
                    loss_sum += loss
                    eval_loss_sum += loss
                    self.step += 1
                    count += 1
                    eval_count += 1
                    bar.update(1)
                    self._log_fidelity()
                    if self._due(self.settings.log_every_steps):
                        last_loss = self._log_training(
                            loss_sum, count, time.perf_counter() - interval_start
                        )
                        bar.set_postfix(loss=f"{last_loss:.4f}")
                        loss_sum.zero_()
                        count, interval_start = 0, time.perf_counter()
                    done = self.step >= self.total_steps
                    epoch_end = self.step % self.steps_per_epoch == 0
                    epochs_done = self.step // self.steps_per_epoch
                    by_epoch = epoch_end and epochs_done % self.settings.eval_every_epochs == 0
                    if done or by_epoch or self._due(self.settings.get("eval_every_steps")):
                        train_loss = float(self.env.mean(eval_loss_sum / eval_count))
                        final = self._evaluate(train_loss, time.perf_counter() - started_at)
                        eval_loss_sum.zero_()
                        eval_count = 0
                    if done or self._due(self.settings.checkpoint_every_steps):
                        self.save_checkpoint()
                    self._inject_fault()
                    if done:
                        break
                del batches
        bar.close()
        if count:
            last_loss = self._log_training(loss_sum, count, time.perf_counter() - interval_start)
        if final is None:  # resumed from the final checkpoint: nothing left to train
            final = self._evaluate(seconds=time.perf_counter() - started_at)
        if self.settings.check_replicas:
            check_replicas(self.model, self.env)
        kfac: dict[str, float | str] = {}
        if self.pre is not None:
            done = max(1, self.step - start)
            total = self._kfac_bytes + _total_bytes(self.pre.comm_stats())
            memory = self.pre.memory_usage()
            kfac = {
                "kfac_bytes_per_step": total / done,
                "kfac_memory_mib": sum(memory.values()) / 2**20,
                "gradient_path": self.pre.gradient_path,
            }
        result = {
            **final,
            **kfac,
            "train_loss": last_loss,
            "steps": self.step,
            "steps_this_run": self.step - start,
            "epochs": self.step / self.steps_per_epoch,
            "wall_time_s": time.perf_counter() - started_at,
            "world_size": self.env.world_size,
            "threads_per_rank": torch.get_num_threads(),
            "strategy": self.strategy,
            "primary_metric": self.task.primary_metric,
        }
        if self.env.is_main:
            write_json(self.output_dir / "metrics.json", {"final": result, "history": self.history})
        return result


def _total_bytes(stats: dict[str, dict[str, int]]) -> int:
    """Bytes handed to collectives over every category of ``comm_stats()``."""
    return sum(entry["bytes"] for entry in stats.values())
