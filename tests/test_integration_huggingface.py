"""Hugging Face Trainer with ``KFACCallback``: the project's own trainer's updates, bitwise
resume, fp16, and each of issue 44's silent problems fixed.

The reference is the project's trainer on the case of tests/integration_cases.py; Trainer runs
it through ``experiments.train trainer.loop=hf`` (:mod:`experiments.hf_loop`). One process
here; tests/test_integration_distributed.py runs two under torchrun.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from integration_cases import (
    CLIP,
    STEPS,
    TOLERANCE,
    ClassificationRows,
    cls_model,
    compose_case,
    hf_params,
    max_difference,
    params_of,
    same,
    train_case,
)
from transformers import Trainer, TrainerCallback, TrainingArguments

from dpkfac.integrations.huggingface import STATE_FILE, KFACCallback
from experiments.distributed import DistEnv
from experiments.hf_loop import hf_trainer
from experiments.train import build_components

#: K-FAC options of the direct Trainer runs (factors every step, an active KL clip).
KFAC = {"strategy": "dp_kfac", "damping": 0.01, "kl_clip": 1e-4, "factor_decay": 0.9}


def test_trainer_loop_equals_the_project_trainer_and_resumes_bitwise(
    project_reference: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """``experiments.train trainer.loop=hf`` gives the project trainer's parameters: K-FAC
    before Trainer's clip (problem 1), accumulation from the arguments (4), the KL clip's lr
    following the schedule (7); K-FAC's state is in Trainer's checkpoints and a resume is
    bitwise (5)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no accumulation or order warning
        result = train_case(tmp_path / "run", "trainer.loop=hf")
    assert result["loop"] == "hf" and result["steps"] == STEPS
    # Scored by the project's task, recorded as the project loop records it.
    assert math.isfinite(result["f1"])
    assert json.loads((tmp_path / "run/metrics.json").read_text())["final"]["f1"] == result["f1"]
    straight = hf_params(tmp_path / "run")
    assert max_difference(straight, project_reference) <= TOLERANCE
    history = json.loads((tmp_path / "run/hf/checkpoint-4/trainer_state.json").read_text())
    norms = [entry["grad_norm"] for entry in history["log_history"] if "grad_norm" in entry]
    assert len(norms) == STEPS and min(norms) > CLIP  # the clip bound every step
    checkpoint = tmp_path / "run/hf/checkpoint-2"
    assert torch.load(checkpoint / STATE_FILE, weights_only=False)["steps"] == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        train_case(tmp_path / "resumed", "trainer.loop=hf", f"trainer.resume={checkpoint}")
    assert same(hf_params(tmp_path / "resumed"), straight)
    # A checkpoint written without the callback's state is refused, naming what is lost.
    os.remove(checkpoint / STATE_FILE)
    with pytest.raises(FileNotFoundError, match="K-FAC's factors and step count are lost"):
        train_case(tmp_path / "again", "trainer.loop=hf", f"trainer.resume={checkpoint}")


def _cpu_fp16(trainer: Trainer, **scaler: float) -> torch.amp.GradScaler:
    """Give Trainer's accelerator the fp16 machinery accelerate builds on a GPU.

    On a CPU ``fp16=True`` makes accelerate skip both (no loss scaler, no autocast: float32
    throughout), so the test sets what ``Accelerator.__init__`` sets on a GPU, a
    ``GradScaler`` and ``native_amp``, before ``train()`` prepares the model (autocast) and
    the optimizer (the scaler's step): Trainer's fp16 path then runs on the CPU as is.
    """
    accelerator = trainer.accelerator
    assert accelerator.mixed_precision == "fp16" and accelerator.scaler is None
    accelerator.scaler = torch.amp.GradScaler("cpu", **scaler)
    accelerator.native_amp = True
    return accelerator.scaler


def test_fp16_equals_the_project_trainers_fp16(
    project_fp16_reference: dict[str, torch.Tensor], tmp_path: Path, single_thread: None
) -> None:
    """fp16 (autocast, a GradScaler): Trainer's scaled backward, the unscale inside its clip
    (before which the callback preconditions) and ``scaler.step`` give the project loop's
    fp16 updates; K-FAC was built with Trainer's scaler (G from unscaled gradients)."""
    cfg = compose_case("trainer.precision=fp16")
    parts = build_components(cfg, DistEnv(), tmp_path / "scratch")
    trainer, callback = hf_trainer(cfg, DistEnv(), parts, tmp_path)
    scaler = _cpu_fp16(trainer)
    trainer.train()
    assert callback is not None and callback.pre is not None
    assert callback.pre.grad_scaler is scaler
    assert scaler.get_scale() == 2.0**16  # no step overflowed, in this run or the project's
    assert max_difference(params_of(parts.model), project_fp16_reference) <= TOLERANCE


class _Record(TrainerCallback):
    """The weights, K-FAC's running factors and the gradients' norm at each step."""

    def __init__(self, callback: KFACCallback) -> None:
        self.callback = callback
        self.steps: list[dict[str, Any]] = []
        self.norms: list[float] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        grads = [p.grad for p in kwargs["model"].parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.callback.pre is not None
        factors = [
            f.running for layer in self.callback.pre.layers.values() for f in layer.factors.values()
        ]
        self.steps.append({"weights": params_of(kwargs["model"]), "factors": factors})


def test_a_step_the_scaler_skips_keeps_the_weights_and_the_factors(
    tmp_path: Path, single_thread: None
) -> None:
    """fp16 whose first step overflows (a loss scale of 2**40): the scaler skips the update,
    and K-FAC, built with the scaler, skips the factor update with it; the next step (the
    scale backed off) trains."""
    cfg = compose_case("trainer.precision=fp16", "trainer.max_steps=2")
    parts = build_components(cfg, DistEnv(), tmp_path / "scratch")
    initial = params_of(parts.model)
    trainer, callback = hf_trainer(cfg, DistEnv(), parts, tmp_path)
    assert callback is not None
    _cpu_fp16(trainer, init_scale=2.0**40, backoff_factor=2.0**-30)
    record = _Record(callback)
    trainer.add_callback(record)
    trainer.train()
    skipped, trained = record.steps
    assert same(skipped["weights"], initial)
    assert all(f is None for f in skipped["factors"])  # no factor update yet
    assert all(f is not None for f in trained["factors"])
    assert max_difference(trained["weights"], initial) > 0


def _cls_trainer(
    out: Path, callback: KFACCallback, *extra: TrainerCallback, batch: int, accumulation: int
) -> Trainer:
    model = cls_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - 0.2 * s)
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        max_steps=STEPS,
        max_grad_norm=1e9,  # measured (and logged), never binding
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        train_sampling_strategy="sequential",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return Trainer(
        model=model,
        args=args,
        train_dataset=ClassificationRows(),
        optimizers=(optimizer, schedule),
        callbacks=[callback, *extra],
    )


def test_labels_loss_is_divided_and_the_logged_norm_is_the_preconditioned_one(
    tmp_path: Path,
) -> None:
    """Problem 6: a model that accepts loss kwargs, with ``labels`` in its batches, gets a
    loss Trainer would not divide by the accumulation steps. Under the callback it is, so 2
    micro-batches of 4 train as one batch of 8 (float64; accumulation equals the whole
    batch, tests/test_core_accumulation.py); and the ``grad_norm`` Trainer logs is the norm
    of the preconditioned gradient the optimizer receives (problem 1)."""
    whole_cb = KFACCallback(**KFAC)
    whole = _cls_trainer(tmp_path / "whole", whole_cb, batch=8, accumulation=1)
    whole.train()
    callback = KFACCallback(**KFAC)
    record = _Record(callback)
    trainer = _cls_trainer(tmp_path / "micro", callback, record, batch=4, accumulation=2)
    assert trainer.model_accepts_loss_kwargs  # plain Trainer would pass num_items_in_batch
    trainer.train()
    assert not trainer.model_accepts_loss_kwargs
    assert max_difference(params_of(trainer.model), params_of(whole.model)) < 1e-10
    logged = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    assert logged == pytest.approx(record.norms, rel=1e-9)
    assert callback.pre is not None and callback.pre.options.accumulation_steps == 2


def test_options_the_trainer_decides_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\['accumulation_steps'\].*gradient accumulation"):
        KFACCallback(accumulation_steps=2)
    with pytest.raises(ValueError, match=r"\['lr'\].*scheduler"):
        KFACCallback(lr=0.1)
    with pytest.raises(ValueError, match=r"\['grad_scaler'\].*loss scaler"):
        KFACCallback(grad_scaler=torch.amp.GradScaler("cpu"))


def test_the_module_imports_transformers_only_when_the_callback_is_used() -> None:
    """``dpkfac`` needs only torch: the module loads without transformers, and the callback
    made on first use is a ``TrainerCallback``, the same class every time."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import dpkfac.integrations.huggingface as h\n"
        "assert 'transformers' not in sys.modules, 'imported with the module'\n"
        "from dpkfac.integrations.huggingface import KFACCallback\n"
        "from transformers import TrainerCallback\n"
        "assert issubclass(KFACCallback, TrainerCallback) and h.KFACCallback is KFACCallback\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
