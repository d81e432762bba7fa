"""Hugging Face Trainer with ``KFACCallback``: the project's own loop's updates, bitwise resume,
and each of issue 44's silent problems fixed (float64, 1e-10 against the reference loop).

One process here; tests/test_integration_distributed.py runs two under torchrun.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from integration_cases import (
    BATCH,
    KFAC,
    ClassificationRows,
    cls_model,
    max_difference,
    optimizer_and_schedule,
    params_of,
    qa_model,
    reference_run,
    squad_features,
)
from transformers import Trainer, TrainingArguments

from dpkfac.integrations.huggingface import STATE_FILE, KFACCallback

STEPS, K, CLIP = 4, 2, 0.5
TOLERANCE = 1e-10  # float64 throughout; the same operations in the same order


@pytest.fixture(scope="module")
def squad(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, int, int]:
    return squad_features(tmp_path_factory.mktemp("squad"))


def _trainer(
    model: torch.nn.Module,
    dataset: Any,
    out: Path,
    callback: KFACCallback,
    *,
    steps: int = STEPS,
    accumulation: int = K,
    max_grad_norm: float = CLIP,
) -> Trainer:
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=accumulation,
        max_steps=steps,
        max_grad_norm=max_grad_norm,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        use_cpu=True,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    return Trainer(
        model=model,
        args=args,
        train_dataset=dataset,
        optimizers=optimizer_and_schedule(model, steps),
        callbacks=[callback],
    )


def _grad_norms(trainer: Trainer) -> list[float]:
    return [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]


def test_trainer_matches_the_project_loop_and_resumes_bitwise(
    squad: tuple[Any, int, int], tmp_path: Path
) -> None:
    """Clipping after K-FAC (problem 1), accumulation read from the arguments (4), the KL
    clip's lr following the schedule (7), K-FAC state in checkpoints (5)."""
    dataset, vocab, pad = squad
    assert len(dataset) >= STEPS * K * BATCH
    reference = reference_run(
        qa_model(vocab, pad), dataset, steps=STEPS, accumulation=K, max_grad_norm=CLIP
    )
    callback = KFACCallback(**KFAC)
    model = qa_model(vocab, pad)
    trainer = _trainer(model, dataset, tmp_path / "run", callback)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no accumulation or order warning
        trainer.train()
    assert max_difference(params_of(model), reference["params"]) < TOLERANCE
    # Trainer logs the norm of the preconditioned gradient, the one it clipped.
    assert _grad_norms(trainer) == pytest.approx(reference["grad_norms"], rel=1e-9)
    assert min(reference["grad_norms"]) > CLIP  # the clip was active at every step
    pre = callback.pre
    assert pre is not None and pre.steps == STEPS
    assert pre.options.accumulation_steps == K
    # The KL clip reads the optimizer's (decayed) lr, not a number fixed at construction.
    assert pre.options.at("lr", 0) == trainer.optimizer.param_groups[0]["lr"] < 0.5 * 0.05
    # Saved with the checkpoint; a resumed run continues bitwise.
    checkpoint = tmp_path / "run" / "checkpoint-2"
    assert (checkpoint / STATE_FILE).is_file()
    resumed_cb = KFACCallback(**KFAC)
    resumed_model = qa_model(vocab, pad, seed=1)  # the checkpoint's weights replace these
    resumed = _trainer(resumed_model, dataset, tmp_path / "resumed", resumed_cb)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed_cb.pre is not None and resumed_cb.pre.steps == STEPS
    for name, value in params_of(resumed_model).items():
        assert torch.equal(value, params_of(model)[name]), name
    # A checkpoint written without the callback's state is refused, naming what is lost.
    os.remove(checkpoint / STATE_FILE)
    again = _trainer(qa_model(vocab, pad), dataset, tmp_path / "again", KFACCallback(**KFAC))
    with pytest.raises(FileNotFoundError, match="K-FAC's factors and step count are lost"):
        again.train(resume_from_checkpoint=str(checkpoint))


def test_loss_with_labels_is_divided_like_the_project_loop(tmp_path: Path) -> None:
    """Problem 6: a model that accepts loss kwargs, with ``labels`` in its batches, gets a
    loss Trainer would not divide by the accumulation steps; under the callback it is, so G
    (and the update) are those of the project's loop."""
    dataset = ClassificationRows()
    reference = reference_run(cls_model(), dataset, steps=STEPS, accumulation=K, max_grad_norm=1e9)
    callback = KFACCallback(**KFAC)
    model = cls_model()
    trainer = _trainer(model, dataset, tmp_path, callback, max_grad_norm=1e9)
    assert trainer.model_accepts_loss_kwargs  # plain Trainer would pass num_items_in_batch
    trainer.train()
    assert max_difference(params_of(model), reference["params"]) < TOLERANCE
    assert not trainer.model_accepts_loss_kwargs


def test_options_the_trainer_decides_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\['accumulation_steps'\].*gradient accumulation"):
        KFACCallback(accumulation_steps=2)
    with pytest.raises(ValueError, match=r"\['lr'\].*scheduler"):
        KFACCallback(lr=0.1)
