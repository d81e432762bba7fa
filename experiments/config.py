"""Checks on the composed configuration, and the error type for user mistakes.

Hydra already rejects unknown group options (``strategy=nope``) and unknown keys
with a short message. Values it cannot judge (``trainer.max_steps=-3``, a damping
of zero, an unknown ``compute_method``) are checked here before anything is built,
so a bad override costs a second, not a crashed run an hour later, and the
message names the key and the value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

STRATEGIES = ("dp-kfac", "d-kfac", "spd-kfac")
COMPUTE_METHODS = ("eigen", "inverse")
WEIGHT_SHARING = ("expand", "reduce")


class ExperimentError(Exception):
    """A mistake in the configuration, the data or a checkpoint.

    The entry point prints these as one line and exits with status 2 instead of
    showing a traceback: they are the user's to fix, not the code's.
    """


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_int(value: Any) -> bool:
    return _is_int(value) and value > 0


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _positive(value: Any) -> bool:
    return _is_number(value) and value > 0


def _non_negative(value: Any) -> bool:
    return _is_number(value) and value >= 0


def _update_interval(value: Any) -> bool:
    # A callable of the step is allowed by the library; from a config that means a
    # `_target_` node, which is instantiated later.
    return _positive_int(value) or isinstance(value, DictConfig)


# key -> (check, what a valid value is)
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": (_is_int, "an integer"),
    "trainer.max_epochs": (_positive_int, "a positive integer"),
    "trainer.max_steps": (_optional(_positive_int), "a positive integer or null"),
    "trainer.eval_every_epochs": (_positive_int, "a positive integer"),
    "trainer.log_every_steps": (_positive_int, "a positive integer"),
    "trainer.checkpoint_every_steps": (_optional(_positive_int), "a positive integer or null"),
    "trainer.keep_checkpoints": (_positive_int, "a positive integer"),
    "trainer.dist_timeout_s": (_positive, "a positive number of seconds"),
    "data.batch_size": (_positive_int, "a positive integer"),
    "data.eval_batch_size": (_positive_int, "a positive integer"),
    "data.num_workers": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "optimizer.lr": (_positive, "a positive number"),
    "optimizer.weight_decay": (_optional(_non_negative), "a non-negative number"),
    "strategy.strategy": (lambda v: v in STRATEGIES, f"one of {', '.join(STRATEGIES)}"),
    "strategy.compute_method": (lambda v: v in COMPUTE_METHODS, " or ".join(COMPUTE_METHODS)),
    "strategy.weight_sharing": (lambda v: v in WEIGHT_SHARING, " or ".join(WEIGHT_SHARING)),
    "strategy.damping": (_positive, "a positive number"),
    "strategy.factor_decay": (lambda v: _is_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "strategy.kl_clip": (_optional(_positive), "a positive number or null"),
    "strategy.factor_update_steps": (_update_interval, "a positive integer"),
    "strategy.inv_update_steps": (_update_interval, "a positive integer"),
}

_KFAC_ONLY = "strategy."


def uses_preconditioner(cfg: DictConfig) -> bool:
    """Whether the strategy group builds a K-FAC preconditioner (``strategy=none`` does not)."""
    return cfg.strategy.get("_target_") is not None


def validate(cfg: DictConfig) -> None:
    """Reject values that would fail, or silently misbehave, later.

    Args:
        cfg: The composed configuration.

    Raises:
        ExperimentError: Naming the first offending key, its value and what is allowed.
    """
    kfac = uses_preconditioner(cfg)
    for key, (check, allowed) in _CHECKS.items():
        if key.startswith(_KFAC_ONLY) and not kfac:
            continue
        node: Any = cfg
        present = True
        for part in key.split("."):
            if not isinstance(node, DictConfig) or part not in node:
                present = False
                break
            node = node[part]
        if present and not check(node):
            raise ExperimentError(f"invalid value {key}={node!r}: expected {allowed}")
    if kfac:
        skip = cfg.strategy.get("skip_layers", [])
        if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
            raise ExperimentError(
                f"invalid value strategy.skip_layers={skip!r}: expected a list of regexes"
            )
    if cfg.trainer.resume is not None and not isinstance(cfg.trainer.resume, str):
        raise ExperimentError(
            f"invalid value trainer.resume={cfg.trainer.resume!r}: expected a path"
        )
