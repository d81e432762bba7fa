"""Learning-rate schedules of the presets, as per-step ``LambdaLR`` multipliers.

Each factory is a Hydra ``_partial_`` target: the config fixes its own
hyperparameters (in epochs or steps, as the papers state them) and the trainer
supplies the optimizer and the run's length, so one schedule config works for
any dataset size and world size. The trainer steps the scheduler once per
optimizer step; its state (the step count) is checkpointed.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def constant(optimizer: Optimizer, *, steps_per_epoch: int, total_steps: int) -> LambdaLR:
    """Keep the optimizer's learning rate."""
    del steps_per_epoch, total_steps
    return LambdaLR(optimizer, lambda step: 1.0)


def warmup_multistep(
    optimizer: Optimizer,
    *,
    steps_per_epoch: int,
    total_steps: int,
    warmup_epochs: float,
    milestones: Sequence[int],
    gamma: float,
) -> LambdaLR:
    """Linear warm-up to the base lr, then multiply by ``gamma`` at each milestone epoch.

    The warm-up of the large-batch recipe (Goyal et al. 2017) used by the CIFAR and
    ImageNet presets: the scaled lr (0.1 x P) is reached gradually, per step.

    Args:
        optimizer: The optimizer whose lr is scheduled.
        steps_per_epoch: Optimizer steps in one epoch.
        total_steps: Unused; part of the common signature.
        warmup_epochs: Length of the linear ramp, in epochs (0: none).
        milestones: Epochs at which the lr is multiplied by ``gamma``.
        gamma: The decay factor.
    """
    del total_steps
    warmup = warmup_epochs * steps_per_epoch
    bounds = sorted(m * steps_per_epoch for m in milestones)

    def factor(step: int) -> float:
        ramp = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        return ramp * gamma ** bisect.bisect_right(bounds, step)

    return LambdaLR(optimizer, factor)


def inverse_sqrt(
    optimizer: Optimizer, *, steps_per_epoch: int, total_steps: int, warmup_steps: int
) -> LambdaLR:
    """Linear warm-up to the base lr over ``warmup_steps``, then decay as 1/sqrt(step).

    The Transformer schedule (Vaswani et al. 2017) with the optimizer's lr as its
    peak, i.e. ``lr * min(s / w, sqrt(w / s))`` at step ``s`` (1-based).
    """
    del steps_per_epoch, total_steps

    def factor(step: int) -> float:
        s = step + 1
        return min(s / warmup_steps, math.sqrt(warmup_steps / s))

    return LambdaLR(optimizer, factor)


def linear_warmup_decay(
    optimizer: Optimizer, *, steps_per_epoch: int, total_steps: int, warmup_fraction: float
) -> LambdaLR:
    """Linear warm-up over a fraction of the run, then linear decay to zero.

    The BERT fine-tuning schedule (Devlin et al. 2019; Hugging Face ``run_squad``).
    """
    del steps_per_epoch
    warmup = int(warmup_fraction * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return LambdaLR(optimizer, factor)
