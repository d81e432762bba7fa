"""Typed, self-validating options: the preconditioner's common arguments and each strategy's own.

One frozen dataclass per set of options is the single definition of what a
value may be. The preconditioner builds them from its keyword arguments, the
cost model takes them to predict the same run, and the experiments validate
a Hydra config by building them before anything else is constructed. So a
bad value is rejected in the same words wherever it comes from, and the
message names the option and the value.

Strategy options subclass :class:`StrategyOptions`; each strategy class names
its own (``Scheme.Options``, :mod:`dpkfac.plan`), and :func:`make_options` builds one from a
dict of keyword arguments with a clear error for unknown keys.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dpkfac.curvature import DECOMPOSITIONS
from dpkfac.curvature.factors import FACTOR_METHODS, WEIGHT_SHARING
from dpkfac.plan.options import (
    Scalar,
    Schedule,
    StrategyOptions,
    check_choice,
    check_positive,
    checked_at,
    make_options,
)
from dpkfac.stats import TIMING_MODES

__all__ = [
    "COMPUTE_METHODS",
    "WEIGHT_SHARING",
    "KFACOptions",
    "Scalar",
    "Schedule",
    "StrategyOptions",
    "check_choice",
    "check_positive",
    "checked_at",
    "make_options",
]

#: The compute methods, as the decompositions registry names them.
COMPUTE_METHODS = tuple(DECOMPOSITIONS)


def _check_steps(name: str, value: Any) -> None:
    if callable(value):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 or a callable of the step, got {value!r}")


def _check_dtype(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
        raise ValueError(f"{name} must be a floating torch.dtype, got {value!r}")


@dataclass(frozen=True)
class KFACOptions:
    """The arguments every strategy shares (see :class:`dpkfac.KFACPreconditioner`).

    Attributes:
        compute_method: "eigen" (exact damped Kronecker inverse) or "inverse".
        damping: γ, or a callable of the step.
        factor_decay: running-average decay in [0, 1), or a callable of the step.
        kl_clip: KL-clip bound, a callable of the step, or None to disable the clip.
        lr: learning rate the KL clip assumes, or a callable of the step.
        factor_update_steps: factor update interval, or a callable of the step.
        inv_update_steps: decomposition interval, or a callable of the step.
        skip_layers: regexes searched in module names; matches are left alone.
        weight_sharing: "expand" or "reduce" for positions (Conv2d, sequences).
        factor_dtype: dtype factors are built in (None: the weight's dtype).
        factor_method: how batch factors are built (:mod:`dpkfac.curvature.factors`):
            "auto" (exact fast kernels), "unfold" (original im2col path) or
            "auto_bf16" (bf16 products, opt-in, not exact).
        decomposition_dtype: dtype of decompositions, at least 32-bit.
        pi_damping: π-split of the damping (inverse method only).
        bucket_cap_mb: size cap of fused buffers.
        collective_timeout: seconds before a collective counts as hung.
        accumulation_steps: micro-batches per optimizer step, each with its
            loss divided by this number (gradient accumulation).
        fidelity_every: run the curvature-fidelity probe (:mod:`dpkfac.fidelity`)
            at steps where ``step % fidelity_every == 0``; 0 turns it off.
        fidelity_layers: layer names or regexes (full match) the probe
            compares at each probe step; None: one layer per probe step, in
            rotation in module order.
        timing: how phases are timed (:class:`~dpkfac.stats.PhaseTimer`):
            "auto" (CUDA events on a GPU, the wall clock on CPU), "events",
            "host" or "off".
    """

    compute_method: str = "eigen"
    damping: Scalar = 0.003
    factor_decay: Scalar = 0.95
    kl_clip: Scalar | None = 0.001
    lr: Scalar = 0.1
    factor_update_steps: Schedule = 1
    inv_update_steps: Schedule = 1
    skip_layers: tuple[str, ...] = ()
    weight_sharing: str = "expand"
    factor_dtype: torch.dtype | None = None
    factor_method: str = "auto"
    decomposition_dtype: torch.dtype = torch.float32
    pi_damping: bool = False
    bucket_cap_mb: float = 25.0
    collective_timeout: float = 300.0
    accumulation_steps: int = 1
    fidelity_every: int = 0
    fidelity_layers: tuple[str, ...] | None = None
    timing: str = "auto"

    def __post_init__(self) -> None:
        if self.skip_layers is None:
            object.__setattr__(self, "skip_layers", ())
        if isinstance(self.skip_layers, str):
            object.__setattr__(self, "skip_layers", (self.skip_layers,))
        elif isinstance(self.skip_layers, Iterable):
            object.__setattr__(self, "skip_layers", tuple(self.skip_layers))
        else:
            raise ValueError(
                f"skip_layers must be a regex string or a list of them, got {self.skip_layers!r}"
            )
        check_choice("compute_method", self.compute_method, COMPUTE_METHODS)
        check_choice("weight_sharing", self.weight_sharing, WEIGHT_SHARING)
        check_positive("damping", self.damping)
        check_positive("lr", self.lr)
        fd = self.factor_decay
        if not callable(fd) and not (
            isinstance(fd, (int, float)) and not isinstance(fd, bool) and 0 <= fd < 1
        ):
            raise ValueError(f"factor_decay must be in [0, 1), got {fd!r}")
        if self.kl_clip is not None:
            check_positive("kl_clip", self.kl_clip)
        _check_steps("factor_update_steps", self.factor_update_steps)
        _check_steps("inv_update_steps", self.inv_update_steps)
        if callable(self.accumulation_steps):
            raise ValueError("accumulation_steps must be an int >= 1, not a callable")
        _check_steps("accumulation_steps", self.accumulation_steps)
        _check_dtype("factor_dtype", self.factor_dtype)
        check_choice("factor_method", self.factor_method, FACTOR_METHODS)
        _check_dtype("decomposition_dtype", self.decomposition_dtype)
        if torch.finfo(self.decomposition_dtype).bits < 32:
            raise ValueError(
                f"decomposition_dtype {self.decomposition_dtype} is half precision; "
                "decompositions need at least float32"
            )
        if not isinstance(self.pi_damping, bool):
            raise ValueError(f"pi_damping must be True or False, got {self.pi_damping!r}")
        if self.pi_damping and self.compute_method != "inverse":
            raise ValueError(
                f"pi_damping=True needs compute_method='inverse', got {self.compute_method!r} "
                "(the eigen method damps the Kronecker product exactly)"
            )
        for pattern in self.skip_layers:
            if not isinstance(pattern, str):
                raise ValueError(f"skip_layers must be regex strings, got {pattern!r}")
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"invalid skip_layers regex {pattern!r}: {err}") from err
        check_positive("bucket_cap_mb", self.bucket_cap_mb)
        check_positive("collective_timeout", self.collective_timeout)
        check_choice("timing", self.timing, TIMING_MODES)
        self._check_fidelity()

    def _check_fidelity(self) -> None:
        every = self.fidelity_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"fidelity_every must be an int >= 0 (0: off), got {every!r}")
        layers = self.fidelity_layers
        if layers is None:
            return
        if isinstance(layers, str):
            layers = (layers,)
        elif isinstance(layers, Iterable) and not isinstance(layers, (Mapping, bytes)):
            layers = tuple(layers)  # a list, a tuple, a Hydra ListConfig
        else:
            raise ValueError(
                f"fidelity_layers must be None or a list of layer names/regexes, got {layers!r}"
            )
        if not layers:
            raise ValueError(
                "fidelity_layers must name at least one layer, got [] (None: rotation)"
            )
        for pattern in layers:
            if not isinstance(pattern, str):
                raise ValueError(f"fidelity_layers must be strings, got {pattern!r}")
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"invalid fidelity_layers regex {pattern!r}: {err}") from err
        object.__setattr__(self, "fidelity_layers", layers)

    def at(self, name: str, step: int) -> Any:
        """Option ``name`` (one of :data:`STEP_RULES`) at ``step``, checked (:func:`checked_at`)."""
        return checked_at(name, getattr(self, name), step)

    @property
    def bucket_cap_bytes(self) -> int:
        """The bucket cap in bytes."""
        return int(self.bucket_cap_mb * 2**20)
