"""accelerate with ``dpkfac.integrations.accelerate.prepare``: the project's own loop's updates
with the standard ``accelerator.accumulate`` loop (``pre.step()`` on every micro-batch,
problem 3), and a bitwise resume through ``save_state``/``load_state`` (float64).

One process here; tests/test_integration_distributed.py runs two under torchrun.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator
from integration_cases import (
    KFAC,
    ClassificationRows,
    batches,
    cls_model,
    max_difference,
    optimizer_and_schedule,
    params_of,
    reference_run,
)

from dpkfac.integrations import accelerate as kfac_accelerate

STEPS, K, CLIP = 4, 2, 0.5
TOLERANCE = 1e-10


def accelerate_run(
    dataset: Any,
    *,
    steps: int = STEPS,
    save_at: int | None = None,
    resume: Path | None = None,
    folder: Path | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, Any]:
    """The accelerate loop as its docs write it, K-FAC through ``prepare``."""
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=K)
    model = cls_model()
    opt, sched = optimizer_and_schedule(model, steps)
    model, opt = accelerator.prepare(model, opt)
    pre = kfac_accelerate.prepare(accelerator, model, optimizer=opt, **KFAC)
    # Not prepared (accelerate would step it once per process); checkpointed beside K-FAC.
    accelerator.register_for_checkpointing(sched)
    start = 0
    if resume is not None:
        accelerator.load_state(str(resume))
        start = pre.steps
    data = batches(dataset, rank, world_size)
    for _ in range(start * K):
        next(data)
    for step in range(start, steps):
        for _ in range(K):
            with accelerator.accumulate(model):
                accelerator.backward(model(**next(data)).loss)
                pre.step()
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                opt.zero_grad()
        sched.step()
        if save_at is not None and step + 1 == save_at:
            assert folder is not None
            accelerator.save_state(str(folder))
    inner = accelerator.unwrap_model(model)
    return {"params": params_of(inner), "pre_steps": pre.steps, "ddp": pre.ddp}


def test_accelerate_loop_matches_the_project_loop_and_resumes_bitwise(tmp_path: Path) -> None:
    dataset = ClassificationRows()
    reference = reference_run(cls_model(), dataset, steps=STEPS, accumulation=K, max_grad_norm=CLIP)
    with warnings.catch_warnings():
        # pre.step() on every micro-batch: the skipped calls say nothing, the others neither.
        warnings.simplefilter("error", RuntimeWarning)
        full = accelerate_run(dataset, save_at=2, folder=tmp_path / "state")
        resumed = accelerate_run(dataset, resume=tmp_path / "state")
    assert full["pre_steps"] == STEPS  # not STEPS * K
    assert max_difference(full["params"], reference["params"]) < TOLERANCE
    for name, value in resumed["params"].items():
        assert torch.equal(value, full["params"][name]), name


def test_accelerate_prepare_refuses_what_the_accelerator_decides() -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=K)
    model = cls_model()
    with pytest.raises(ValueError, match=r"\['accumulation_steps'\]"):
        kfac_accelerate.prepare(accelerator, model, accumulation_steps=K)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"\['lr'\]"):
        kfac_accelerate.prepare(accelerator, model, optimizer=opt, lr=0.1)
