"""``trainer.loop=hf``: a run through Hugging Face ``Trainer`` with dpkfac's ``KFACCallback``.

The baseline a user of Hugging Face would compare against (SQuAD BERT): the same data,
model, optimizer, schedule and K-FAC options as the project's own loop
(:class:`experiments.trainer.Trainer`), built by the same function
(:func:`experiments.train.build_components`), but the training loop, DDP wrapping,
accumulation, clipping (``trainer.max_grad_norm``), mixed precision and checkpoints are
Trainer's, and K-FAC comes in through :class:`dpkfac.integrations.huggingface.KFACCallback`
(docs/integrations.md). The model is scored afterwards by the project's task (F1/EM for
SQuAD), and ``metrics.json`` is written as the project's loop writes it. Checkpoints are
Trainer's, in ``<output_dir>/hf``; ``trainer.resume=auto`` continues from the newest there.

**The same updates as the project loop.** Trainer is given the project loop's batches: one
loader of every rank's batches in turn (:meth:`DataModule.round_robin_train_loader`), which
accelerate deals out to the ranks as Trainer's own loader would be, so each rank sees the
project loop's batches, epoch by epoch, and an epoch ends where the project loop's does
(no step of a partial accumulation). Where nothing random happens in training (no dropout)
the two loops then apply the same updates (tests/test_integration_huggingface.py). Dropout
is where they part: Trainer seeds every rank with the run's seed (``set_seed``) and draws
from that stream for its own bookkeeping, the project loop gives rank r the seed + r, so
their dropout masks differ and the runs agree in distribution, not update for update.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from experiments.config import ExperimentError, launcher_name
from experiments.distributed import DistEnv
from experiments.loggers import write_json
from experiments.preconditioning import preconditioner_kwargs, strategy_name
from experiments.schedules import build_step_schedules
from experiments.tasks.base import evaluate
from experiments.trainer import total_steps

if TYPE_CHECKING:
    from torch.utils.data import DataLoader
    from transformers import Trainer

    from dpkfac.integrations.huggingface import KFACCallback
    from experiments.train import Components

log = logging.getLogger(__name__)

#: The values of ``trainer.loop``.
LOOPS = ("project", "hf")


def kfac_options(cfg: DictConfig, steps_per_epoch: int) -> dict[str, Any] | None:
    """The strategy node's options for an integration (None: first order), schedules built;
    the learning rate, accumulation steps and loss scaler are the integration's to take
    from the framework."""
    options = preconditioner_kwargs(cfg.strategy)
    if options is None:
        return None
    options.update(build_step_schedules(cfg.strategy, steps_per_epoch))
    return options


@functools.cache
def _trainer_class() -> type[Trainer]:
    """``transformers.Trainer`` trained on a given loader (transformers imported here, when
    ``trainer.loop=hf`` runs, not when ``experiments.train`` is imported)."""
    from transformers import Trainer

    class ProjectOrderTrainer(Trainer):
        """Trainer whose training batches come from ``train_loader``, prepared by
        accelerate as Trainer prepares its own (``get_train_dataloader``, the method
        Trainer's documentation says to override for this)."""

        def __init__(self, *args: Any, train_loader: DataLoader, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.project_train_loader = train_loader

        def get_train_dataloader(self) -> DataLoader:
            loader: DataLoader = self.accelerator.prepare(self.project_train_loader)
            return loader

    return ProjectOrderTrainer


def hf_trainer(
    cfg: DictConfig, env: DistEnv, parts: Components, output_dir: Path
) -> tuple[Trainer, KFACCallback | None]:
    """The Trainer of ``trainer.loop=hf`` on ``parts`` (the model bare: Trainer wraps it),
    untrained, and its ``KFACCallback`` (None for first order)."""
    from transformers import TrainingArguments

    from dpkfac.integrations.huggingface import KFACCallback

    settings = cfg.trainer
    accumulate = int(settings.get("accumulate_grad_batches", 1))
    steps = total_steps(settings, parts.steps_per_epoch)
    options = kfac_options(cfg, parts.steps_per_epoch)
    callback = KFACCallback(**options) if options is not None else None
    precision = str(settings.get("precision", 32))
    clip = settings.get("max_grad_norm")
    args = TrainingArguments(
        output_dir=str(output_dir / "hf"),
        per_device_train_batch_size=parts.data.batch_size,
        gradient_accumulation_steps=accumulate,
        max_steps=steps,
        max_grad_norm=0.0 if clip is None else float(clip),  # 0: Trainer does not clip
        logging_steps=int(settings.log_every_steps),
        save_strategy="steps",
        save_steps=int(settings.checkpoint_every_steps or steps),
        save_total_limit=int(settings.keep_checkpoints),
        report_to=[],
        use_cpu=env.device.type == "cpu",
        seed=int(cfg.seed),
        dataloader_num_workers=parts.data.num_workers,
        disable_tqdm=not settings.progress_bar,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
    )
    trainer = _trainer_class()(
        model=parts.model,
        args=args,
        train_dataset=parts.data.train_dataset,
        optimizers=(parts.optimizer, parts.scheduler),
        callbacks=[callback] if callback is not None else [],
        train_loader=parts.data.round_robin_train_loader(env, int(cfg.seed), accumulate),
    )
    return trainer, callback


def fit_with_hf_trainer(
    cfg: DictConfig, env: DistEnv, parts: Components, output_dir: Path
) -> dict[str, Any]:
    """Train ``parts.model`` with Hugging Face Trainer (:func:`hf_trainer`); score it.

    Raises:
        ExperimentError: ``launcher=threads`` (Trainer runs one rank per process), or fp16
            on a CPU, where accelerate makes no loss scaler and Trainer would silently
            train in float32, not the fp16 run the project loop makes there.
    """
    from transformers.trainer_utils import get_last_checkpoint

    settings = cfg.trainer
    if env.distributed and launcher_name(cfg) == "threads":
        raise ExperimentError(
            "trainer.loop=hf runs one rank per process: start it with torchrun, not "
            "launcher=threads"
        )
    if str(settings.get("precision", 32)) == "fp16" and env.device.type == "cpu":
        raise ExperimentError(
            "trainer.loop=hf with trainer.precision=fp16 on a CPU: accelerate makes no loss "
            "scaler there and Hugging Face Trainer would train in float32; run on a GPU, use "
            "trainer.precision=bf16, or trainer.loop=project"
        )
    trainer, callback = hf_trainer(cfg, env, parts, output_dir)
    folder = output_dir / "hf"
    resume = settings.get("resume")
    if resume == "auto":
        resume = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    output = trainer.train(resume_from_checkpoint=resume)
    task = parts.data.build_task()
    metrics = evaluate(task, parts.model, parts.data.eval_loader(env), env)
    pre = callback.pre if callback is not None else None
    result = {
        **metrics,
        "train_loss": float(output.training_loss),
        "steps": int(trainer.state.global_step),
        "world_size": env.world_size,
        "strategy": strategy_name(cfg.strategy),
        "primary_metric": task.primary_metric,
        "loop": "hf",
        **({"gradient_path": pre.gradient_path} if pre is not None else {}),
    }
    if env.is_main:
        write_json(output_dir / "metrics.json", {"final": result, "history": []})
    return result
