"""Lightning with ``KFACCallback``: the project's own trainer's updates with accumulation,
clipping and a scheduler, in float32 and in fp16 (``precision="16-mixed"``, Lightning's loss
scaler), and a bitwise resume from a Lightning checkpoint.

The reference is the project's trainer on the case of tests/integration_cases.py. One process
here; tests/test_integration_distributed.py runs ``strategy="ddp"`` on two.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl
from integration_cases import (
    CLIP,
    STEPS,
    TOLERANCE,
    ClassificationRows,
    K,
    ProjectBatches,
    cls_model,
    compose_case,
    max_difference,
    params_of,
    same,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision

from dpkfac.integrations.lightning import KFACCallback
from experiments.distributed import DistEnv
from experiments.hf_loop import kfac_options
from experiments.train import Components, build_components


class ProjectModule(pl.LightningModule):
    """The case's model, loss (the project task's), optimizer and per-step schedule."""

    def __init__(self, parts: Components) -> None:
        super().__init__()
        self.model, self.parts = parts.model, parts
        self.task = parts.data.build_task()

    def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
        loss: torch.Tensor = self.task.training_loss(self.model, batch)
        return loss

    def configure_optimizers(self) -> Any:
        schedule = {"scheduler": self.parts.scheduler, "interval": "step"}
        return {"optimizer": self.parts.optimizer, "lr_scheduler": schedule}


def lightning_run(
    env: DistEnv,
    *,
    folder: Path | None = None,
    resume: Path | None = None,
    fp16: bool = False,
    **trainer: Any,
) -> dict[str, Any]:
    """The case under ``lightning.Trainer`` and ``KFACCallback``, each rank on its project
    batches; with ``folder``, a checkpoint every 2 steps (``...step=2.ckpt``, ...).

    ``fp16``: Lightning's fp16 plugin with a loss scaler, given as a plugin since
    ``precision="16-mixed"`` falls back to bf16 on a CPU.
    """
    cfg = compose_case(f"trainer.precision={'fp16' if fp16 else 32}")
    if fp16:
        trainer["plugins"] = [MixedPrecision("16-mixed", "cpu")]
    with tempfile.TemporaryDirectory() as scratch:
        parts = build_components(cfg, env, Path(scratch))
        options = kfac_options(cfg, parts.steps_per_epoch)
        assert options is not None
        callback = KFACCallback(**options)
        saver = [ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)]
        fit = pl.Trainer(
            accelerator="cpu",
            max_steps=STEPS,
            accumulate_grad_batches=K,
            gradient_clip_val=CLIP,
            callbacks=[callback, *(saver if folder else [])],
            use_distributed_sampler=False,  # each rank reads its own project batches
            logger=False,
            enable_checkpointing=folder is not None,
            enable_progress_bar=False,
            enable_model_summary=False,
            **trainer,
        )
        loader = parts.data.train_loader(env, int(cfg.seed))
        batches = ProjectBatches(loader, parts.data.batch_size, parts.steps_per_epoch * K)
        fit.fit(ProjectModule(parts), batches, ckpt_path=resume)
        assert callback.pre is not None
        return {
            "params": params_of(parts.model),
            "pre": callback.pre,
            "accumulation_steps": callback.pre.options.accumulation_steps,
        }


def test_lightning_equals_the_project_trainer_and_resumes_bitwise(
    project_reference: dict[str, torch.Tensor], tmp_path: Path, single_thread: None
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        full = lightning_run(DistEnv(), folder=tmp_path, devices=1)
        (checkpoint,) = tmp_path.glob("*step=2.ckpt")  # mid-epoch: 3 steps per epoch
        stored = torch.load(checkpoint, weights_only=False)["callbacks"]
        assert any("preconditioner" in state for state in stored.values())
        resumed = lightning_run(DistEnv(), resume=checkpoint, devices=1)
    assert full["pre"].steps == resumed["pre"].steps == STEPS
    assert full["accumulation_steps"] == K
    assert max_difference(full["params"], project_reference) <= TOLERANCE
    assert same(resumed["params"], full["params"])


def test_lightning_fp16_equals_the_project_trainers_fp16(
    project_fp16_reference: dict[str, torch.Tensor], single_thread: None
) -> None:
    """fp16 (``MixedPrecision("16-mixed")``) on the CPU: Lightning's GradScaler unscales before
    ``on_before_optimizer_step``; K-FAC, built with that scaler, builds G from unscaled
    gradients, and the run is the project loop's fp16 run."""
    run = lightning_run(DistEnv(), fp16=True, devices=1)
    assert run["pre"].grad_scaler is not None
    assert max_difference(run["params"], project_fp16_reference) <= TOLERANCE


class Classifier(pl.LightningModule):
    """The tiny BERT classifier, its loss the model's own, plain SGD."""

    def __init__(self) -> None:
        super().__init__()
        self.model = cls_model()

    def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
        loss: torch.Tensor = self.model(**batch).loss
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.model.parameters(), lr=0.05)


def test_lightning_resumed_at_an_epochs_end_is_warned_about(tmp_path: Path) -> None:
    """Lightning 2.6 resumed (with a plain DataLoader) from a checkpoint written at an epoch's
    last step runs one more micro-batch of the old epoch as a whole optimizer step: the core
    names it."""
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    def trainer(steps: int, callbacks: list[Any]) -> pl.Trainer:
        return pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            accumulate_grad_batches=K,
            callbacks=callbacks,
            default_root_dir=tmp_path,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    epochs = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    rows = ClassificationRows(2 * K * 4)  # one epoch = 2 optimizer steps of 2 batches of 4
    short = DataLoader(rows, batch_size=4, shuffle=False, collate_fn=default_data_collator)
    trainer(2, [KFACCallback(strategy="dp_kfac"), epochs]).fit(Classifier(), short)
    partial = r"after 1 backward pass\(es\), but accumulation_steps=2"
    with pytest.warns(RuntimeWarning, match=partial):
        trainer(4, [KFACCallback(strategy="dp_kfac")]).fit(
            Classifier(), short, ckpt_path=tmp_path / "epoch=0-step=2.ckpt"
        )
