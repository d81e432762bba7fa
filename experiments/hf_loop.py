"""``trainer.loop=hf``: a run through Hugging Face ``Trainer`` with dpkfac's ``KFACCallback``.

The baseline a user of Hugging Face would compare against (SQuAD BERT): the same data,
model, optimizer, schedule and K-FAC options as the project's own loop
(:class:`experiments.trainer.Trainer`), but the training loop, DDP wrapping, accumulation and
checkpoints are Trainer's, and K-FAC comes in through
:class:`dpkfac.integrations.huggingface.KFACCallback` (docs/integrations.md). The model is
scored afterwards by the project's task (F1/EM for SQuAD), and ``metrics.json`` is written
as the project's loop writes it. Checkpoints are Trainer's, in ``<output_dir>/hf``;
``trainer.resume=auto`` continues from the newest there.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from experiments.config import ExperimentError, launcher_name
from experiments.data.loading import DataModule
from experiments.distributed import DistEnv
from experiments.loggers import write_json
from experiments.preconditioning import preconditioner_kwargs, strategy_name
from experiments.schedules import build_step_schedules
from experiments.tasks.base import evaluate
from experiments.trainer import total_steps

log = logging.getLogger(__name__)

#: The values of ``trainer.loop``.
LOOPS = ("project", "hf")


def kfac_options(cfg: DictConfig, steps_per_epoch: int) -> dict[str, Any] | None:
    """The strategy node's options for ``KFACCallback`` (None: first order), schedules built;
    the learning rate and accumulation steps are the callback's to take from Trainer."""
    options = preconditioner_kwargs(cfg.strategy)
    if options is None:
        return None
    options.update(build_step_schedules(cfg.strategy, steps_per_epoch))
    return options


def fit_with_hf_trainer(
    *,
    cfg: DictConfig,
    env: DistEnv,
    data: DataModule,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    output_dir: Path,
) -> dict[str, Any]:
    """Train ``model`` (bare: Trainer wraps it) with Hugging Face Trainer; score it."""
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint

    from dpkfac.integrations.huggingface import KFACCallback

    settings = cfg.trainer
    if env.distributed and launcher_name(cfg) == "threads":
        raise ExperimentError(
            "trainer.loop=hf runs one rank per process: start it with torchrun, not "
            "launcher=threads"
        )
    if str(settings.get("precision", 32)) == "fp16":
        raise ExperimentError(
            "trainer.loop=hf with trainer.precision=fp16: KFACCallback does not support a "
            "GradScaler yet; use trainer.precision=bf16 or trainer.loop=project"
        )
    accumulate = int(settings.get("accumulate_grad_batches", 1))
    steps_per_epoch = data.steps_per_epoch(env, accumulate)
    steps = total_steps(settings, steps_per_epoch)
    options = kfac_options(cfg, steps_per_epoch)
    callbacks = [KFACCallback(**options)] if options is not None else []
    folder = output_dir / "hf"
    args = TrainingArguments(
        output_dir=str(folder),
        per_device_train_batch_size=data.batch_size,
        gradient_accumulation_steps=accumulate,
        max_steps=steps,
        max_grad_norm=0.0,  # the project's loop does not clip either
        logging_steps=int(settings.log_every_steps),
        save_strategy="steps",
        save_steps=int(settings.checkpoint_every_steps or steps),
        save_total_limit=int(settings.keep_checkpoints),
        report_to=[],
        use_cpu=env.device.type == "cpu",
        seed=int(cfg.seed),
        dataloader_num_workers=data.num_workers,
        disable_tqdm=not settings.progress_bar,
        bf16=str(settings.get("precision", 32)) == "bf16",
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data.train_dataset,
        optimizers=(optimizer, scheduler),
        callbacks=callbacks,
    )
    resume = settings.get("resume")
    if resume == "auto":
        resume = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    output = trainer.train(resume_from_checkpoint=resume)
    task = data.build_task()
    metrics = evaluate(task, model, data.eval_loader(env), env)
    pre = callbacks[0].pre if callbacks else None
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
