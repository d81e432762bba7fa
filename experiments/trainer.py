"""The training loop: steps, evaluation, logging and checkpoints.

One iteration is ``loss.backward(); pre.step(); optimizer.step();
scheduler.step()``: the preconditioner averages the gradients (unless DDP
already did) and replaces them with the preconditioned ones before the
first-order optimizer applies momentum and weight decay. Progress is counted
in optimizer steps; the epoch and the position inside it follow from the step,
which is what lets a resumed run continue bitwise.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

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
)
from experiments.data.loading import DataModule, epoch_sampler
from experiments.distributed import DistEnv, broadcast_buffers, check_replicas, unwrap
from experiments.loggers import NullLogger, flatten_stats, write_json
from experiments.preconditioning import strategy_name
from experiments.tasks.base import evaluate, to_device

log = logging.getLogger(__name__)


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
        # The strategy config's name (``none`` for first order), as runs report it.
        self.strategy = strategy_name(cfg.strategy) if preconditioner is not None else "none"
        self.train_loader = data.train_loader(env, cfg.seed)
        self.eval_loader = data.eval_loader(env)
        self.steps_per_epoch = data.steps_per_epoch(env)
        self.total_steps = total_steps(self.settings, self.steps_per_epoch)
        self.checkpoints = CheckpointDir(output_dir / "checkpoints", self.settings.keep_checkpoints)
        self.step = 0
        self.history: list[dict[str, float]] = []

    # -- checkpoints ------------------------------------------------------------------

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint of the current step (rank 0 writes; all ranks must call).

        Every rank's RNG states are gathered into the file, since dropout and the
        like draw from per-rank streams; the preconditioner's state is a collective
        too (under dp-kfac each rank holds its own layers' factors).
        """
        broadcast_buffers(self.model, self.env)
        rng = self.env.all_gather_objects(capture_rng_state())
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
            "preconditioner": pre_state,
            "rng": rng,
            "history": self.history,
            "config": OmegaConf.to_yaml(self.cfg),
        }
        path = self.checkpoints.save(state, self.step)
        log.info("checkpoint written: %s", path)
        return path

    def restore(self, path: str | Path) -> None:
        """Continue from a checkpoint: every piece of state, then this rank's RNG."""
        ckpt = load_checkpoint(path, self.env.world_size, self.strategy)
        unwrap(self.model).load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        if self.pre is not None:
            self.pre.load_state_dict(to_device(ckpt["preconditioner"], self.env.device))
        self.step = int(ckpt["step"])
        self.history = list(ckpt.get("history", []))
        restore_rng_state(ckpt["rng"][self.env.rank])
        log.info("resumed from %s at step %d", path, self.step)

    # -- loop -------------------------------------------------------------------------

    def train_step(self, batch: Any) -> torch.Tensor:
        """One optimizer step on ``batch``; returns the (detached) loss."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.task.training_loss(self.model, to_device(batch, self.env.device))
        loss.backward()
        if self.pre is not None:
            self.pre.step()
        self.optimizer.step()
        self.scheduler.step()
        return loss.detach()

    def _log_training(self, loss_sum: torch.Tensor, count: int, seconds: float) -> float:
        loss = float(self.env.mean(loss_sum / count))
        metrics = {
            "train/loss": loss,
            "train/lr": self.optimizer.param_groups[0]["lr"],
            "train/epoch": self.step / self.steps_per_epoch,
            "train/step_time_s": seconds / count,
            "train/samples_per_s": count * self.data.batch_size * self.env.world_size / seconds,
        }
        if self.pre is not None:
            # Statistics of rank 0, per logging interval.
            metrics.update(flatten_stats("kfac/comm", self.pre.comm_stats()))
            metrics.update(flatten_stats("kfac/time", self.pre.timings()))
            metrics.update(flatten_stats("kfac/memory", self.pre.memory_usage()))
            self.pre.reset_stats()
        self.logger.log(metrics, step=self.step)
        return loss

    def _evaluate(
        self, train_loss: float = math.nan, seconds: float = math.nan
    ) -> dict[str, float]:
        """Score the model; the history entry also keeps the training side of the interval.

        Args:
            train_loss: Mean training loss (over ranks) since the previous evaluation.
            seconds: Wall-clock seconds of this run so far.
        """
        broadcast_buffers(self.model, self.env)
        metrics = evaluate(self.task, self.model, self.eval_loader, self.env)
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
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "examples")
        log.info("epoch %.4g (step %d): test %s", epoch, self.step, shown)
        return metrics

    def _due(self, every: int | None) -> bool:
        return every is not None and self.step % every == 0

    def fit(self) -> dict[str, Any]:
        """Train to ``total_steps``, evaluating and checkpointing on the way.

        Returns:
            The final evaluation metrics plus run facts (also in ``metrics.json``).
        """
        if self.settings.resume:
            self.restore(self.settings.resume)
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
                sampler.set_epoch(epoch, position * self.data.batch_size)
                for batch in self.train_loader:
                    loss = self.train_step(batch)
                    loss_sum += loss
                    eval_loss_sum += loss
                    self.step += 1
                    count += 1
                    eval_count += 1
                    bar.update(1)
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
                    if done or (epoch_end and epochs_done % self.settings.eval_every_epochs == 0):
                        train_loss = float(self.env.mean(eval_loss_sum / eval_count))
                        final = self._evaluate(train_loss, time.perf_counter() - started_at)
                        eval_loss_sum.zero_()
                        eval_count = 0
                    if done or self._due(self.settings.checkpoint_every_steps):
                        self.save_checkpoint()
                    if done:
                        break
        bar.close()
        if count:
            last_loss = self._log_training(loss_sum, count, time.perf_counter() - interval_start)
        if final is None:  # resumed from the final checkpoint: nothing left to train
            final = self._evaluate(seconds=time.perf_counter() - started_at)
        if self.settings.check_replicas:
            check_replicas(self.model, self.env)
        result = {
            **final,
            "train_loss": last_loss,
            "steps": self.step,
            "steps_this_run": self.step - start,
            "epochs": self.step / self.steps_per_epoch,
            "wall_time_s": time.perf_counter() - started_at,
            "world_size": self.env.world_size,
            "strategy": self.strategy,
            "primary_metric": self.task.primary_metric,
        }
        if self.env.is_main:
            write_json(self.output_dir / "metrics.json", {"final": result, "history": self.history})
        return result
