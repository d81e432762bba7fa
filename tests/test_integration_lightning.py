"""Lightning with ``KFACCallback``: the project's own loop's updates with accumulation, clipping
and a scheduler, and a bitwise resume from a Lightning checkpoint (float64).

One process here; tests/test_integration_distributed.py runs ``strategy="ddp"`` on two.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import lightning.pytorch as pl
from integration_cases import (
    BATCH,
    KFAC,
    ClassificationRows,
    batches,
    cls_model,
    max_difference,
    optimizer_and_schedule,
    params_of,
    reference_run,
)
from lightning.pytorch.callbacks import ModelCheckpoint

from dpkfac.integrations.lightning import KFACCallback

STEPS, K, CLIP = 4, 2, 0.5
ROWS = STEPS * K * BATCH  # one epoch: the checkpoint at step 2 is mid-epoch
TOLERANCE = 1e-10


class ResumableBatches:
    """Sequential batches that Lightning can checkpoint mid-epoch (``state_dict``): a plain
    DataLoader restarts its epoch on resume, and Lightning resumed from an epoch's last
    checkpoint runs one extra micro-batch as a step (dpkfac warns there: 1 backward pass
    for accumulation_steps=2)."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.batches = list(itertools.islice(batches(ClassificationRows(ROWS)), STEPS * K))
        self.batches = self.batches[rank::world_size]
        self.position = self.start = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        start, self.start = self.start, 0
        for i in range(start, len(self.batches)):
            self.position = i + 1
            yield self.batches[i]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = state["position"]


class Classifier(pl.LightningModule):
    """The tiny BERT classifier, its loss the model's own, SGD with a per-step schedule."""

    def __init__(self) -> None:
        super().__init__()
        self.model = cls_model()

    def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> Any:
        opt, sched = optimizer_and_schedule(self.model, STEPS)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def lightning_trainer(
    steps: int, callback: KFACCallback, folder: Path | None = None, **extra: Any
) -> pl.Trainer:
    """With ``folder``, a checkpoint every 2 steps (``epoch=0-step=2.ckpt``, ...)."""
    every = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=-1)
    saver = [every] if folder else []
    return pl.Trainer(
        accelerator="cpu",
        max_steps=steps,
        accumulate_grad_batches=K,
        gradient_clip_val=CLIP,
        callbacks=[callback, *saver],
        logger=False,
        enable_checkpointing=folder is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        **extra,
    )


def test_lightning_matches_the_project_loop_and_resumes_bitwise(tmp_path: Path) -> None:
    reference = reference_run(
        cls_model(), ClassificationRows(ROWS), steps=STEPS, accumulation=K, max_grad_norm=CLIP
    )
    module, callback = Classifier(), KFACCallback(**KFAC)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        lightning_trainer(STEPS, callback, tmp_path, devices=1).fit(module, ResumableBatches())
    assert callback.pre is not None and callback.pre.steps == STEPS
    assert callback.pre.options.accumulation_steps == K
    assert max_difference(params_of(module.model), reference["params"]) < TOLERANCE
    # Saved at step 2, resumed to step 4: the same bits.
    path = tmp_path / "epoch=0-step=2.ckpt"
    assert "preconditioner" in torch.load(path, weights_only=False)["callbacks"][callback.state_key]
    resumed, resumed_cb = Classifier(), KFACCallback(**KFAC)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trainer = lightning_trainer(STEPS, resumed_cb, devices=1)
        trainer.fit(resumed, ResumableBatches(), ckpt_path=path)
    assert resumed_cb.pre is not None and resumed_cb.pre.steps == STEPS
    for name, value in params_of(resumed.model).items():
        assert torch.equal(value, params_of(module.model)[name]), name


def test_lightning_resumed_at_an_epochs_end_is_warned_about(tmp_path: Path) -> None:
    """Lightning 2.6 resumed (with a plain DataLoader) from a checkpoint written at an epoch's
    last step runs one more micro-batch of the old epoch as a whole optimizer step: the core
    names it."""
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    callback = KFACCallback(**KFAC)
    epochs = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    rows = ClassificationRows(2 * K * BATCH)  # one epoch = 2 optimizer steps
    short = DataLoader(rows, batch_size=BATCH, shuffle=False, collate_fn=default_data_collator)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        accumulate_grad_batches=K,
        callbacks=[callback, epochs],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(), short)
    resumed = lightning_trainer(STEPS, KFACCallback(**KFAC), devices=1)
    partial = r"after 1 backward pass\(es\), but accumulation_steps=2"
    with pytest.warns(RuntimeWarning, match=partial):
        resumed.fit(Classifier(), short, ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
