"""Schedules of the presets: the learning rate, and K-FAC's hyperparameters.

Learning-rate schedules are per-step ``LambdaLR`` multipliers. Each factory is a
Hydra ``_partial_`` target: the config fixes its own hyperparameters (in epochs
or steps, as the papers state them) and the trainer supplies the optimizer and
the run's length, so one schedule config works for any dataset size and world
size. The trainer steps the scheduler once per optimizer step; its state (the
step count) is checkpointed.

K-FAC hyperparameters (``strategy.damping``, ``strategy.kl_clip``,
``strategy.factor_update_steps``, ``strategy.inv_update_steps``) take a
:func:`kfac_schedule` node instead of a number: a pure function of the
optimizer step, which the preconditioner evaluates at every step. The trainer
completes the node with ``steps_per_epoch`` like the LR schedules, and nothing
needs checkpointing (the preconditioner's step count is).
"""

from __future__ import annotations

import bisect
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig
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


#: Units a :func:`kfac_schedule`'s milestones can be given in.
UNITS = ("epoch", "step")
#: Strategy options whose schedules must give integers (update intervals).
INTEGER_OPTIONS = ("factor_update_steps", "inv_update_steps")


@dataclass(frozen=True)
class StepSchedule:
    """``base * gamma ** (number of bounds <= step)``: a step decay as a callable of the step.

    A frozen dataclass rather than a closure, so it pickles and shows its values
    in logs.

    Attributes:
        base: The value before the first bound.
        gamma: The factor applied at each bound.
        bounds: The optimizer steps at which ``gamma`` applies, sorted.
        integer: Give integers (update intervals), truncated like the authors'
            ``KFACParamScheduler`` (``int(base * factor)``) and never below 1.
    """

    base: float
    gamma: float
    bounds: tuple[int, ...]
    integer: bool = False

    def __call__(self, step: int) -> float | int:
        value = self.base * self.gamma ** bisect.bisect_right(self.bounds, step)
        return max(1, int(value)) if self.integer else value


def kfac_schedule(
    *,
    steps_per_epoch: int,
    base: float,
    milestones: Sequence[float] = (),
    gamma: float = 1.0,
    unit: str = "epoch",
    integer: bool = False,
) -> StepSchedule:
    """A K-FAC hyperparameter multiplied by ``gamma`` at each milestone.

    The schedule of the DP-KFAC authors' ``KFACParamScheduler``
    (lzhangbv/kfac_pytorch, kfac/kfac_preconditioner_base.py): the value during
    epoch ``e`` is ``base * gamma ** #{m in milestones: e >= m}``, here per
    optimizer step, so a milestone of epoch ``m`` applies from step
    ``m * steps_per_epoch`` on. A config writes e.g.::

        strategy:
          damping: {_target_: experiments.schedules.kfac_schedule,
                    base: 0.002, milestones: [40, 80], gamma: 0.5}

    and the trainer supplies ``steps_per_epoch`` (optimizer steps, after
    gradient accumulation) and, for the update intervals, ``integer=True``
    (see :func:`build_step_schedules`).

    Args:
        steps_per_epoch: Optimizer steps in one epoch (given by the trainer).
        base: The initial value.
        milestones: Where ``gamma`` applies, in ``unit``s.
        gamma: The factor (0.5 halves the damping; 10 makes updates 10x rarer).
        unit: ``epoch`` or ``step``.
        integer: Give integers of at least 1 (update intervals).

    Raises:
        ValueError: A unit, factor or milestone that makes no schedule.
    """
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {list(UNITS)}, got {unit!r}")
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0:
        raise ValueError(f"base must be a positive number, got {base!r}")
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not gamma > 0:
        raise ValueError(f"gamma must be a positive number, got {gamma!r}")
    if any(isinstance(m, bool) or not isinstance(m, (int, float)) or m < 0 for m in milestones):
        raise ValueError(f"milestones must be non-negative numbers, got {list(milestones)!r}")
    scale = steps_per_epoch if unit == "epoch" else 1
    bounds = tuple(sorted(round(m * scale) for m in milestones))
    return StepSchedule(base=base, gamma=gamma, bounds=bounds, integer=integer)


def is_schedule_node(value: Any) -> bool:
    """Whether a config value is a ``_target_`` node (a schedule of the step, built later)."""
    return isinstance(value, DictConfig | Mapping) and "_target_" in value


def build_step_schedules(
    options: Mapping[str, Any], steps_per_epoch: int
) -> dict[str, Callable[[int], Any]]:
    """Build the schedule nodes among a strategy node's options, as callables of the step.

    Each ``_target_`` value is instantiated as a partial and called with what
    the run knows and the target accepts: ``steps_per_epoch``, and
    ``integer=True`` for the update intervals (:data:`INTEGER_OPTIONS`). Any
    other target returning a callable of the step works too.

    Args:
        options: The node's values (e.g. ``cfg.strategy``); plain values are skipped.
        steps_per_epoch: Optimizer steps per epoch.

    Returns:
        Option name -> callable, for the options that are schedules.

    Raises:
        ValueError: naming the option, when a node cannot be built or does not
            give a callable.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    built: dict[str, Callable[[int], Any]] = {}
    for key, value in options.items():
        if not is_schedule_node(value):
            continue
        try:
            factory = instantiate(value, _partial_=True)
            params = inspect.signature(factory).parameters
            any_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
            extra: dict[str, Any] = {}
            if "steps_per_epoch" in params or any_kw:
                extra["steps_per_epoch"] = steps_per_epoch
            if key in INTEGER_OPTIONS and ("integer" in params or any_kw):
                extra["integer"] = True
            schedule = factory(**extra)
        except (InstantiationException, TypeError, ValueError) as exc:
            cause = exc.__cause__ if isinstance(exc, InstantiationException) else None
            text = str(cause or exc).strip()
            raise ValueError(
                f"{key}: {text.splitlines()[0] if text else type(exc).__name__}"
            ) from None
        if not callable(schedule):
            raise ValueError(
                f"{key}: {value.get('_target_')} did not return a callable of the step"
            )
        built[str(key)] = schedule
    return built
