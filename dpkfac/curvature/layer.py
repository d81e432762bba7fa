"""State of one K-FAC layer: running-average factors and their decompositions.

A :class:`KFACLayer` knows nothing about ranks beyond the placement fields the
strategy writes into it (``owner``, ``a_owner``, ``g_owner``); it never
communicates. Batch factors are accumulated by the capture hooks (summed over
micro-batches), possibly replaced by their cross-rank average by a strategy,
and folded into the running averages by :meth:`KFACLayer.update_factors`.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from dpkfac.curvature.decomposition import (
    Decomposition,
    DecompositionError,
    precondition,
    working_dtype,
)
from dpkfac.curvature.factors import a_factor, g_factor
from dpkfac.curvature.modules import ModuleHelper

FACTORS = ("A", "G")


class KFACLayer:
    """Factors, decompositions and placement of one preconditioned module.

    Attributes:
        name: module name in ``model.named_modules()`` (no DDP prefix).
        module: the module itself.
        helper: the shape/gradient helper for its type.
        owner: rank that preconditions the layer under dp-kfac; under
            d-kfac/spd-kfac the rank that decomposes its A factor (its G
            factor when A is decomposed locally), or -1 when every rank
            decomposes both (spd-kfac's small factors).
        a_owner / g_owner: rank that decomposes A / G, or None when every
            rank decomposes it locally.
        a_factor / g_factor: running averages, or None where this rank holds none.
        a_decomp / g_decomp: decompositions, or None.
        positions / batch_size: T and N of the last captured input (load balancing).
    """

    def __init__(self, name: str, module: nn.Module, helper: ModuleHelper) -> None:
        self.name = name
        self.module = module
        self.helper = helper
        self.owner: int = 0
        self.a_owner: int | None = 0
        self.g_owner: int | None = 0
        self.a_factor: torch.Tensor | None = None
        self.g_factor: torch.Tensor | None = None
        self.a_decomp: Decomposition | None = None
        self.g_decomp: Decomposition | None = None
        self.a_batch: torch.Tensor | None = None
        self.g_batch: torch.Tensor | None = None
        self.a_count = 0
        self.g_count = 0
        self.positions = 0
        self.batch_size = 0
        self.ever_captured = False
        self.warned_no_capture = False
        self.seen_in_eval_mode = False

    # ------------------------------------------------------------------ capture
    def accumulate_a(
        self, x: torch.Tensor, weight_sharing: str, dtype: torch.dtype | None
    ) -> torch.Tensor:
        """Add the batch A factor of input ``x``; returns the running batch sum."""
        a = self.helper.a_matrix(x.detach())
        self.batch_size, self.positions = a.shape[0], a.shape[1]
        factor = a_factor(
            a, has_bias=self.helper.has_bias, weight_sharing=weight_sharing, dtype=dtype
        )
        self.a_batch = factor if self.a_batch is None else self.a_batch + factor
        self.a_count += 1
        self.ever_captured = True
        return self.a_batch

    def accumulate_g(
        self, grad_output: torch.Tensor, weight_sharing: str, dtype: torch.dtype | None
    ) -> torch.Tensor:
        """Add the batch G factor of ``grad_output``; returns the running batch sum."""
        g = self.helper.g_matrix(grad_output.detach())
        factor = g_factor(g, weight_sharing=weight_sharing, dtype=dtype)
        self.g_batch = factor if self.g_batch is None else self.g_batch + factor
        self.g_count += 1
        return self.g_batch

    def has_pending(self, which: str) -> bool:
        """Whether a batch factor waits to be folded in (cheap: no averaging)."""
        return (self.a_batch if which == "A" else self.g_batch) is not None

    def pending(self, which: str) -> torch.Tensor | None:
        """The batch factor waiting to be folded in, averaged over micro-batches."""
        batch, count = (
            (self.a_batch, self.a_count) if which == "A" else (self.g_batch, self.g_count)
        )
        if batch is None:
            return None
        return batch / count if count > 1 else batch

    def set_pending(self, which: str, factor: torch.Tensor | None) -> None:
        """Replace the pending batch factor (a strategy's cross-rank average)."""
        if which == "A":
            self.a_batch, self.a_count = factor, int(factor is not None)
        else:
            self.g_batch, self.g_count = factor, int(factor is not None)

    def clear_pending(self) -> None:
        """Drop batch factors (after folding them in, or when another rank owns the layer)."""
        self.a_batch = self.g_batch = None
        self.a_count = self.g_count = 0

    def pending_nbytes(self) -> int:
        """Bytes of batch factors awaiting ``step()``."""
        return sum(
            t.numel() * t.element_size() for t in (self.a_batch, self.g_batch) if t is not None
        )

    # ------------------------------------------------------------ running average
    def update_factors(self, decay: float) -> list[str]:
        """Fold pending batch factors into the running averages.

        ``F ← decay·F + (1-decay)·F_batch``; the first update stores ``F_batch``.
        A batch factor holding NaN/Inf is rejected with a warning and the
        previous running average is kept.

        Returns:
            The factors ("A"/"G") that were updated.
        """
        updated = []
        for which in FACTORS:
            batch = self.pending(which)
            if batch is None:
                continue
            if not torch.isfinite(batch).all():
                warnings.warn(
                    f"dpkfac: non-finite values in the {which} factor of layer {self.name!r}; "
                    "update skipped, previous factor kept",
                    RuntimeWarning,
                    stacklevel=3,
                )
                continue
            current = self.a_factor if which == "A" else self.g_factor
            if current is None:
                new = batch.clone()
            else:
                new = current.mul(decay).add_(batch.to(current.dtype), alpha=1.0 - decay)
            if which == "A":
                self.a_factor = new
            else:
                self.g_factor = new
            updated.append(which)
        self.clear_pending()
        return updated

    # ------------------------------------------------------------- decomposition
    def factor(self, which: str) -> torch.Tensor | None:
        return self.a_factor if which == "A" else self.g_factor

    def decomposition(self, which: str) -> Decomposition | None:
        return self.a_decomp if which == "A" else self.g_decomp

    def set_decomposition(self, which: str, dec: Decomposition | None) -> None:
        if which == "A":
            self.a_decomp = dec
        else:
            self.g_decomp = dec

    def decompose(
        self,
        which: str,
        method: type[Decomposition],
        *,
        damping: float,
        dtype: torch.dtype,
    ) -> bool:
        """Recompute one factor's decomposition; on failure keep the previous one.

        Returns:
            True when a new decomposition was computed.
        """
        factor = self.factor(which)
        if factor is None:
            return False
        work = working_dtype(factor.dtype, dtype)
        try:
            self.set_decomposition(which, method.compute(factor, damping=damping, dtype=work))
            return True
        except DecompositionError as err:
            keep = self.decomposition(which) is not None
            warnings.warn(
                f"dpkfac: decomposing the {which} factor of layer {self.name!r} failed ({err}); "
                + ("keeping the previous decomposition" if keep else "using its diagonal"),
                RuntimeWarning,
                stacklevel=3,
            )
            if not keep:
                self.set_decomposition(which, method.fallback(factor, damping=damping, dtype=work))
            return False

    def pi_damping(self, which: str, damping: float) -> float:
        """The damping of one factor under Martens & Grosse's π-split (inverse method).

        With ``π = sqrt((tr A / d_A) / (tr G / d_G))`` the inverse method uses
        ``(A + π√γ I)⁻¹`` and ``(G + √γ/π I)⁻¹``, i.e. damping ``π²γ`` for A
        and ``γ/π²`` for G, which balances the two factors' scales. Falls back
        to the plain split when either factor is missing or degenerate.
        """
        a, g = self.a_factor, self.g_factor
        if a is None or g is None:
            return damping
        a_mean = float(torch.trace(a.double())) / a.shape[0]
        g_mean = float(torch.trace(g.double())) / g.shape[0]
        if not (a_mean > 0 and g_mean > 0 and math.isfinite(a_mean / g_mean)):
            return damping
        pi = math.sqrt(a_mean / g_mean)
        return damping * pi**2 if which == "A" else damping / pi**2

    def has_decompositions(self) -> bool:
        return self.a_decomp is not None and self.g_decomp is not None

    # ------------------------------------------------------------ preconditioning
    def preconditioned_grad(
        self, damping: float, grad: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The preconditioned gradient matrix, or None when it cannot be computed here.

        Args:
            damping: γ (used by the eigen method at this point).
            grad: the (d_out, a_dim) gradient matrix when the caller already built it.
        """
        grad = self.helper.grad_matrix() if grad is None else grad
        if grad is None or not self.has_decompositions():
            return None
        return precondition(grad, self.a_decomp, self.g_decomp, damping=damping)

    # ----------------------------------------------------------------- accounting
    def factor_nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.a_factor, self.g_factor) if t is not None
        )

    def decomposition_nbytes(self) -> int:
        return sum(d.nbytes() for d in (self.a_decomp, self.g_decomp) if d is not None)

    def __repr__(self) -> str:
        return (
            f"KFACLayer({self.name!r}, {type(self.module).__name__}, A={self.helper.a_dim}, "
            f"G={self.helper.g_dim}, owner={self.owner})"
        )
