"""Option values that may change with the step, and the base of every strategy's options.

The plan floor's half of :mod:`dpkfac.options`: what a scheme's options
(:class:`StrategyOptions`) and the step-dependent values need, with nothing
but the standard library, so that the plans and the cost model can validate
options without the runtime.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "STEP_RULES",
    "Scalar",
    "Schedule",
    "StrategyOptions",
    "check_choice",
    "check_positive",
    "checked_at",
    "did_you_mean",
    "make_options",
]

#: A value that may change with the step: a number, or a callable ``step -> number``.
Scalar = float | Callable[[int], float]
#: An update interval: an int, or a callable ``step -> int``.
Schedule = int | Callable[[int], int]


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _positive(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value) and value > 0


def _decay(value: Any) -> bool:
    return _is_number(value) and 0 <= value < 1


def _interval(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 1


#: What a callable option must return at every step: (test, what it must be).
STEP_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "damping": (_positive, "a finite number > 0"),
    "lr": (_positive, "a finite number > 0"),
    "kl_clip": (_positive, "a finite number > 0"),
    "factor_decay": (_decay, "a number in [0, 1)"),
    "factor_update_steps": (_interval, "an int >= 1"),
    "inv_update_steps": (_interval, "an int >= 1"),
}


def checked_at(name: str, value: Any, step: int) -> Any:
    """The value of option ``name`` at ``step``; a callable's result is checked at every read.

    A callable's value may change at any step, so it is checked whenever it
    is read (a few comparisons); constants were checked at construction.

    Raises:
        ValueError: the callable returned a value the option does not accept,
            named with the step.
    """
    if not callable(value):
        return value
    result = value(step)
    test, must_be = STEP_RULES[name]
    if not test(result):
        raise ValueError(f"{name} returned {result!r} at step {step}; it must return {must_be}")
    return result


def check_positive(name: str, value: Any, *, allow_zero: bool = False) -> None:
    """Raise ValueError unless ``value`` is a finite positive number (or a callable)."""
    if callable(value):
        return
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and (value >= 0 if allow_zero else value > 0)
    )
    if not ok:
        raise ValueError(
            f"{name} must be a positive number or a callable of the step, got {value!r}"
        )


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {list(choices)}")


@dataclass(frozen=True)
class StrategyOptions:
    """Base of each strategy's own options (a strategy without options uses it as is)."""

    def as_dict(self) -> dict[str, Any]:
        """The options as keyword arguments (what ``make_options`` would take back)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


OptionsT = TypeVar("OptionsT", bound="DataclassInstance")


def did_you_mean(unknown: Collection[str], known: Collection[str]) -> str:
    """`` did you mean 'damping'?`` for the known names closest to the unknown ones, or "".

    A misspelt option or name is the commonest mistake, and the list of
    everything accepted is long: the closest name is what the reader needs.
    """
    pairs = [
        (name, close[0])
        for name in sorted(unknown)
        if (close := difflib.get_close_matches(name, sorted(known), n=1))
    ]
    if not pairs:
        return ""
    if len(unknown) == 1:
        return f" did you mean {pairs[0][1]!r}?"
    return " did you mean " + ", ".join(f"{c!r} for {n!r}" for n, c in pairs) + "?"


def make_options(
    cls: type[OptionsT],
    values: Mapping[str, Any],
    owner: str,
    *,
    common: Collection[str] = (),
) -> OptionsT:
    """Build ``cls`` from keyword arguments, naming unknown keys and their owner.

    Args:
        cls: an options dataclass.
        values: keyword arguments.
        owner: what the options belong to, for the message ("strategy 'dp_kfac'").
        common: the other names the caller accepts beside ``cls``'s (the
            preconditioner's common options): an unknown key is more often one
            of them misspelt (``dampening``) than one of the strategy's, so the
            message lists them too and looks for the closest name among all.

    Raises:
        ValueError: unknown keys, with the closest accepted name; or a value
            the dataclass rejects.
    """
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        what = f"option {unknown[0]!r}" if len(unknown) == 1 else f"options {unknown}"
        hint = did_you_mean(unknown, [*names, *common])
        accepted = f"common options: {sorted(common)}; " if common else ""
        raise ValueError(
            f"unknown {what} for {owner}{f';{hint}' if hint else '.'} Accepted: {accepted}"
            f"options of {owner}: {sorted(names) or 'none'}"
        )
    return cls(**values)
