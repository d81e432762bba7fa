"""accelerate with ``dpkfac.integrations.accelerate.prepare``: the project's own trainer's updates
with the standard ``accelerator.accumulate`` loop (``pre.step()`` on every micro-batch,
problem 3), and a bitwise resume through ``save_state``/``load_state``.

The reference is the project's trainer on the case of tests/integration_cases.py. One process
here; tests/test_integration_distributed.py runs two under torchrun.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator
from integration_cases import (
    CLIP,
    STEPS,
    TOLERANCE,
    K,
    cls_model,
    compose_case,
    max_difference,
    params_of,
    same,
)

from dpkfac.integrations import accelerate as kfac_accelerate
from experiments.distributed import DistEnv
from experiments.hf_loop import kfac_options
from experiments.train import build_components


def accelerate_run(
    env: DistEnv, *, save_at: int | None = None, folder: Path | None = None, resume: bool = False
) -> dict[str, Any]:
    """The accelerate loop as its docs write it, on the case's components, K-FAC through
    ``prepare``; the loader is every rank's project batches, which accelerate deals out."""
    cfg = compose_case()
    with tempfile.TemporaryDirectory() as scratch:
        parts = build_components(cfg, env, Path(scratch))
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=K)
        loader = parts.data.round_robin_train_loader(env, int(cfg.seed), K)
        model, opt, loader = accelerator.prepare(parts.model, parts.optimizer, loader)
        options = kfac_options(cfg, parts.steps_per_epoch)
        assert options is not None
        pre = kfac_accelerate.prepare(accelerator, model, optimizer=opt, **options)
        # Not prepared (accelerate would step it once per process); checkpointed beside K-FAC.
        accelerator.register_for_checkpointing(parts.scheduler)
        if resume:
            assert folder is not None
            accelerator.load_state(str(folder))
        step = pre.steps
        epoch, position = divmod(step, parts.steps_per_epoch)
        while step < STEPS:
            loader.set_epoch(epoch)
            batches = accelerator.skip_first_batches(loader, position * K) if position else loader
            for batch in batches:
                with accelerator.accumulate(model):
                    accelerator.backward(model(**batch).loss)
                    pre.step()  # a no-op until the last micro-batch
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(model.parameters(), CLIP)
                    opt.step()
                    opt.zero_grad()
                if accelerator.sync_gradients:
                    parts.scheduler.step()
                    step += 1
                    if step == save_at:
                        assert folder is not None
                        accelerator.save_state(str(folder))
                    if step == STEPS:
                        break
            epoch, position = epoch + 1, 0
        return {"params": params_of(parts.model), "pre_steps": pre.steps, "ddp": pre.ddp}


def test_accelerate_loop_equals_the_project_trainer_and_resumes_bitwise(
    project_reference: dict[str, torch.Tensor], tmp_path: Path, single_thread: None
) -> None:
    with warnings.catch_warnings():
        # pre.step() on every micro-batch: the skipped calls say nothing, the others neither.
        warnings.simplefilter("error", RuntimeWarning)
        full = accelerate_run(DistEnv(), save_at=2, folder=tmp_path / "state")
        resumed = accelerate_run(DistEnv(), folder=tmp_path / "state", resume=True)
    assert full["pre_steps"] == STEPS  # not STEPS * K
    assert max_difference(full["params"], project_reference) <= TOLERANCE
    assert same(resumed["params"], full["params"])


def test_accelerate_prepare_refuses_what_the_accelerator_decides() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=K)
    model = cls_model()
    with pytest.raises(ValueError, match=r"\['accumulation_steps'\]"):
        kfac_accelerate.prepare(accelerator, model, accumulation_steps=K)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"\['lr'\]"):
        kfac_accelerate.prepare(accelerator, model, optimizer=opt, lr=0.1)
    # fp16: accelerate makes its loss scaler on a GPU only; the refusal reads the attribute.
    accelerator.scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"refuses fp16.*bf16"):
        kfac_accelerate.prepare(accelerator, model, optimizer=opt)
