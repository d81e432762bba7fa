"""What the integrations share: the preconditioner built from a framework's settings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from dpkfac import KFACPreconditioner

#: The options a framework decides, with where each comes from (the user may not set them).
FRAMEWORK_OPTIONS = {
    "accumulation_steps": "the framework's gradient accumulation setting",
    "lr": "the optimizer's learning rate at each step (the scheduler's)",
    "grad_scaler": "the framework's fp16 loss scaler",
}


def check_options(kfac_options: dict[str, Any], framework: str, decided: tuple[str, ...]) -> None:
    """Refuse options the framework decides: two sources for one setting is how the
    accumulation steps and the KL clip's learning rate drifted apart from the trainer's."""
    given = [name for name in decided if name in kfac_options]
    if given:
        where = "; ".join(f"{name}: {FRAMEWORK_OPTIONS[name]}" for name in given)
        raise ValueError(
            f"dpkfac.integrations.{framework}: {given} are taken from the training framework "
            f"({where}); set them there, not in the K-FAC options"
        )


def follow_lr(optimizer: Optimizer) -> Callable[[int], float]:
    """The KL clip's learning rate: the first parameter group's, read at each ``step()``
    (which runs before ``optimizer.step()`` and the scheduler's step, so it is the lr that
    this update is applied with)."""

    def lr(step: int) -> float:
        return float(optimizer.param_groups[0]["lr"])

    return lr


def build(
    model: nn.Module,
    kfac_options: dict[str, Any],
    *,
    accumulation_steps: int,
    lr: Callable[[int], float] | float | None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> KFACPreconditioner:
    """The preconditioner on ``model`` with the framework's settings and the user's options
    (``grad_scaler``: the framework's fp16 loss scaler, which the framework unscales with
    before ``pre.step()``)."""
    options = dict(kfac_options)
    options["accumulation_steps"] = int(accumulation_steps)
    if lr is not None:
        options["lr"] = lr
    if grad_scaler is not None:
        options["grad_scaler"] = grad_scaler
    return KFACPreconditioner(model, **options)
