"""Paired comparisons with confidence intervals, and verdicts against margins fixed beforehand.

A claim such as "DP-KFAC keeps D-KFAC's convergence" is a statement about a
difference between two methods, so it needs that difference's interval, not
each method's spread. Seeds pair the runs (a seed gives both methods the same
initial model and data order), so the interval comes from resampling seeds,
both methods' runs of a seed together (a paired bootstrap). The verdict then
compares the interval with margins written in the config before the runs:
equivalent (inside the margins), better or worse (wholly beyond them), or
inconclusive (anything else: more seeds would decide).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

#: The verdicts, in the order a page lists them.
VERDICTS = ("equivalent", "better", "worse", "inconclusive")


@dataclass(frozen=True)
class Interval:
    """A statistic, its bootstrap interval and the number of paired seeds behind it."""

    value: float
    low: float
    high: float
    pairs: int

    def text(self, digits: int = 2, signed: bool = False) -> str:
        sign = "+" if signed else ""
        return (
            f"{self.value:{sign}.{digits}f} [{self.low:{sign}.{digits}f}, "
            f"{self.high:{sign}.{digits}f}]"
        )


def ratio_of_means(a: np.ndarray, b: np.ndarray) -> float:
    """Mean of ``a`` over mean of ``b`` (steps to target of one method against another's)."""
    return float(np.mean(a) / np.mean(b))


def mean_difference(a: np.ndarray, b: np.ndarray) -> float:
    """Mean of ``a - b`` (final accuracy of one method minus another's)."""
    return float(np.mean(a - b))


def paired_bootstrap(
    a: Sequence[float],
    b: Sequence[float],
    statistic: Callable[[np.ndarray, np.ndarray], float],
    resamples: int = 10_000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Interval:
    """The percentile interval of ``statistic(a, b)`` over resampled seeds.

    ``a[i]`` and ``b[i]`` are the two methods' values for seed i; each resample draws
    seed indices with replacement and keeps both methods' values of a drawn seed
    together. Deterministic for a given ``seed``.

    Raises:
        ValueError: unpaired or empty inputs, or a confidence outside (0, 1).
    """
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or not len(x):
        raise ValueError(f"paired values needed, got {len(x)} and {len(y)}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    index = rng.integers(0, len(x), size=(resamples, len(x)))
    values = np.array([statistic(x[i], y[i]) for i in index])
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return Interval(statistic(x, y), float(low), float(high), len(x))


def verdict(interval: Interval, margins: tuple[float, float], lower_is_better: bool) -> str:
    """``equivalent`` when the interval lies within ``margins``; ``better`` or ``worse`` when
    it lies wholly beyond one of them (which one is better depends on the statistic);
    ``inconclusive`` otherwise."""
    lo, hi = margins
    if not lo <= hi:
        raise ValueError(f"margins must be (low, high) with low <= high, got {margins}")
    if lo <= interval.low and interval.high <= hi:
        return "equivalent"
    if interval.high < lo:
        return "better" if lower_is_better else "worse"
    if interval.low > hi:
        return "worse" if lower_is_better else "better"
    return "inconclusive"
