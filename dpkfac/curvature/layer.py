"""State of one K-FAC layer: running-average factors and their decompositions.

A :class:`KFACLayer` knows nothing about ranks beyond the placement the
strategy writes into it (its ``owner`` and each factor's ``decomposer``); it never
communicates. The per-factor state (running average, decomposition, pending
batch factor, decomposer) is one :class:`FactorState` for A and one for G.
Batch factors are accumulated by the capture hooks (summed over
micro-batches), possibly replaced by their cross-rank average by a strategy,
and folded into the running averages by :meth:`KFACLayer.update_factors`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from dpkfac.curvature.decomposition import (
    Decomposition,
    DecompositionError,
    precondition,
    working_dtype,
)
from dpkfac.curvature.factors import DEFAULT_METHOD
from dpkfac.curvature.modules import ModuleHelper, SupportedModule
from dpkfac.device import HostReader

FACTORS = ("A", "G")


@dataclass
class FactorState:
    """Everything held for one Kronecker factor (A or G) of one layer.

    Attributes:
        decomposer: rank that decomposes it, or None when every rank does.
        running: the running average, or None where this rank holds none.
        decomposition: its decomposition, or None.
        batch: the batch factor summed over the step's captures, awaiting
            ``step()`` (or a strategy's cross-rank average of it).
        count: how many captures ``batch`` sums.
        divisor: what ``batch`` is divided by to give the step's batch factor.
    """

    decomposer: int | None = 0
    running: torch.Tensor | None = None
    decomposition: Decomposition | None = None
    batch: torch.Tensor | None = None
    count: int = 0
    divisor: int = 1

    def add(self, factor: torch.Tensor, divisor: int | None = None) -> torch.Tensor:
        """Add one capture's batch factor; returns the running batch sum.

        Args:
            factor: this capture's batch factor.
            divisor: what the sum is divided by (None: the number of captures,
                i.e. the captures are averaged).
        """
        self.batch = factor if self.batch is None else self.batch + factor
        self.count += 1
        self.divisor = self.count if divisor is None else divisor
        return self.batch

    def pending(self) -> torch.Tensor | None:
        """The step's batch factor: the sum of its captures over ``divisor``."""
        if self.batch is None:
            return None
        return self.batch / self.divisor if self.divisor != 1 else self.batch

    def set_pending(self, factor: torch.Tensor | None) -> None:
        """Replace the pending batch factor by a final one (a cross-rank average)."""
        self.batch, self.count, self.divisor = factor, int(factor is not None), 1

    def clear_pending(self) -> None:
        self.batch, self.count, self.divisor = None, 0, 1


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _fold(running: torch.Tensor, batch: torch.Tensor, decay: float) -> torch.Tensor:
    """``decay·F + (1 - decay)·F_batch``: the running-average update, in one place."""
    return running.mul(decay).add_(batch.to(running.dtype), alpha=1.0 - decay)


def warn_non_finite(layer: str, which: str, *, stacklevel: int = 3) -> None:
    """The warning of a batch factor rejected for NaN/Inf (its update is skipped)."""
    warnings.warn(
        f"dpkfac: non-finite values in the {which} factor of layer {layer!r}; "
        "update skipped, previous factor kept",
        RuntimeWarning,
        stacklevel=stacklevel,
    )


@dataclass(frozen=True)
class MaskedFold:
    """One factor folded by :meth:`KFACLayer.fold_masked`.

    Attributes:
        which: "A" or "G".
        finite: device boolean, whether the batch factor held only finite values.
        had_running: whether there was a running average before.
        old_decomposition: the decomposition before (restored by ``undo_fold``).
        old_running: the running average before, where the fold was asked to keep
            it (a loss-scaled step that may be skipped after the fold: ``revert_fold``).
    """

    which: str
    finite: torch.Tensor
    had_running: bool
    old_decomposition: Decomposition | None
    old_running: torch.Tensor | None = None


class KFACLayer:
    """Factors, decompositions and placement of one preconditioned module.

    Attributes:
        name: module name in ``model.named_modules()`` (no DDP prefix).
        module: the module itself.
        helper: the shape/gradient helper for its type.
        owner: the rank that decomposes both its factors, where one rank does
            (:class:`~dpkfac.plan.assignment.Placement`: under dp-kfac it also builds
            them and preconditions the layer), or -1 where no one rank does.
        factors: "A" and "G" -> :class:`FactorState`.
        positions / batch_size: T and N of the last captured input (load balancing).

    ``a_factor``/``g_factor`` (the running averages) and ``a_decomposer``/``g_decomposer``
    are views of ``factors`` for the public inspection API.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        helper: ModuleHelper[SupportedModule],
        accumulation_steps: int = 1,
    ) -> None:
        self.name = name
        self.module = module
        self.helper = helper
        self.accumulation_steps = accumulation_steps
        self.owner: int = 0
        self.factors: dict[str, FactorState] = {w: FactorState() for w in FACTORS}
        self.positions = 0
        self.batch_size = 0
        self.ever_captured = False
        # Called in training at a factor step, on any rank (set by the preconditioner).
        self.ever_seen = False
        self.warned_no_capture = False
        self.seen_in_eval_mode = False

    # ---------------------------------------------------------- public views
    @property
    def a_factor(self) -> torch.Tensor | None:
        return self.factors["A"].running

    @property
    def g_factor(self) -> torch.Tensor | None:
        return self.factors["G"].running

    @property
    def a_decomposer(self) -> int | None:
        return self.factors["A"].decomposer

    @property
    def g_decomposer(self) -> int | None:
        return self.factors["G"].decomposer

    def dim(self, which: str) -> int:
        """Side of factor ``which``."""
        return self.helper.a_dim if which == "A" else self.helper.g_dim

    def set_placement(self, owner: int, a_decomposer: int | None, g_decomposer: int | None) -> None:
        """Write this layer's entry of a :class:`~dpkfac.plan.assignment.Placement`."""
        self.owner = owner
        self.factors["A"].decomposer, self.factors["G"].decomposer = a_decomposer, g_decomposer

    # ------------------------------------------------------------------ capture
    def accumulate_a(
        self,
        x: torch.Tensor,
        weight_sharing: str,
        dtype: torch.dtype | None,
        method: str = DEFAULT_METHOD,
    ) -> torch.Tensor:
        """Add the batch A factor of input ``x``; returns the running batch sum.

        ``method`` is the ``factor_method`` option (see :mod:`dpkfac.curvature.factors`).
        The forward hook runs inside the model's autocast region, which would
        turn the factor's products into half precision: autocast is off here,
        so the factor is built in ``dtype`` whatever the forward runs in.
        """
        with torch.autocast(x.device.type, enabled=False):
            factor, self.batch_size, self.positions = self.helper.a_factor(
                x.detach(), weight_sharing, dtype, method
            )
        self.ever_captured = True
        return self.factors["A"].add(factor)

    def accumulate_g(
        self,
        grad_output: torch.Tensor,
        weight_sharing: str,
        dtype: torch.dtype | None,
        method: str = DEFAULT_METHOD,
        inverse_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Add the batch G factor of ``grad_output``; returns the running batch sum.

        ``inverse_scale`` (a device scalar ``1/s``, mixed precision) unscales the
        output gradient in ``dtype`` before the product, so ``s²`` never appears
        (see :mod:`dpkfac.amp`).

        With ``accumulation_steps = k`` the loss of each micro-batch is the
        mean divided by k, so each per-example gradient is k times too small
        and G k² too small: the factor is scaled back by k². G is then summed
        over the captures of a step and divided by k, not by the number of
        captures: a module called several times in one forward (a shared
        layer) contributes one gradient per call to ∇W, which the convention
        treats like extra positions (averaged in A, summed in G).
        """
        grad_output = grad_output.detach()
        if inverse_scale is not None:
            work = dtype if dtype is not None else grad_output.dtype
            grad_output = grad_output.to(work) * inverse_scale.to(grad_output.device, work)
        factor = self.helper.g_factor(grad_output, weight_sharing, dtype, method)
        k = self.accumulation_steps
        if k != 1:
            factor = factor.mul_(k * k)
        return self.factors["G"].add(factor, divisor=k)

    def has_pending(self, which: str) -> bool:
        """Whether a batch factor waits to be folded in (cheap: no averaging)."""
        return self.factors[which].batch is not None

    def pending(self, which: str) -> torch.Tensor | None:
        """The batch factor waiting to be folded in, averaged over micro-batches."""
        return self.factors[which].pending()

    def pending_factor(self, which: str) -> torch.Tensor:
        """:meth:`pending` of a factor known to wait (:meth:`has_pending` holds)."""
        factor = self.factors[which].pending()
        assert factor is not None, f"no pending {which} factor of layer {self.name!r}"
        return factor

    def set_pending(self, which: str, factor: torch.Tensor | None) -> None:
        """Replace the pending batch factor (a strategy's cross-rank average)."""
        self.factors[which].set_pending(factor)

    def clear_pending(self) -> None:
        """Drop batch factors (after folding them in, or when another rank owns the layer)."""
        for state in self.factors.values():
            state.clear_pending()

    def pending_nbytes(self) -> int:
        """Bytes of batch factors awaiting ``step()``."""
        return sum(_nbytes(state.batch) for state in self.factors.values())

    # ------------------------------------------------------------ running average
    def finite_checks(self) -> dict[str, torch.Tensor]:
        """Per pending factor, a device boolean: does it hold only finite values?

        The caller gathers these for every layer and reads them in one host
        sync per step, instead of one per factor.
        """
        return {
            which: torch.isfinite(state.batch).all()
            for which, state in self.factors.items()
            if state.batch is not None
        }

    def update_factors(self, decay: float, finite: Mapping[str, bool] | None = None) -> list[str]:
        """Fold pending batch factors into the running averages.

        ``F ← decay·F + (1-decay)·F_batch``; the first update stores ``F_batch``.
        A batch factor holding NaN/Inf is rejected with a warning and the
        previous running average is kept.

        Args:
            decay: the running-average decay.
            finite: the already read :meth:`finite_checks` (None: check here).

        Returns:
            The factors ("A"/"G") that were updated.
        """
        if finite is None:
            finite = {w: bool(ok) for w, ok in self.finite_checks().items()}
        updated = []
        for which, state in self.factors.items():
            batch = state.pending()
            if batch is None:
                continue
            if not finite[which]:
                warn_non_finite(self.name, which, stacklevel=4)
                continue
            state.running = (
                batch.clone() if state.running is None else _fold(state.running, batch, decay)
            )
            updated.append(which)
        self.clear_pending()
        return updated

    def fold_masked(self, decay: float, *, keep: bool = False) -> list[MaskedFold]:
        """Fold pending batch factors without reading the host: NaN/Inf masked on the device.

        Where a batch factor holds NaN/Inf, ``torch.where`` keeps the previous
        running average (zeros where there was none yet: the caller reads the
        returned flags later, warns, and undoes those with :meth:`undo_fold`).
        The arithmetic is :meth:`update_factors`'s, so a finite fold is the same.
        With ``keep`` the records hold the previous running averages (a
        reference: the fold makes new tensors), so :meth:`revert_fold` can undo it.

        Returns:
            One record per folded factor.
        """
        records = []
        for which, state in self.factors.items():
            batch = state.pending()
            if batch is None:
                continue
            finite = torch.isfinite(batch).all()
            running = state.running
            records.append(
                MaskedFold(
                    which,
                    finite,
                    running is not None,
                    state.decomposition,
                    running if keep else None,
                )
            )
            if running is not None:
                state.running = torch.where(finite, _fold(running, batch, decay), running)
            else:
                state.running = torch.where(finite, batch, torch.zeros_like(batch))
        self.clear_pending()
        return records

    def undo_fold(self, record: MaskedFold) -> None:
        """Undo a :meth:`fold_masked` of a non-finite batch factor where there was no running
        average yet (the masked zeros must not count as one)."""
        if not record.had_running:
            state = self.factors[record.which]
            state.running = None
            state.decomposition = record.old_decomposition

    def revert_fold(self, record: MaskedFold) -> None:
        """Undo a kept :meth:`fold_masked` entirely: the running average and decomposition
        before it (the step it belongs to was skipped by the loss scaler)."""
        state = self.factors[record.which]
        state.running = record.old_running
        state.decomposition = record.old_decomposition

    # ------------------------------------------------------------- decomposition
    def factor(self, which: str) -> torch.Tensor | None:
        return self.factors[which].running

    def decomposition(self, which: str) -> Decomposition | None:
        return self.factors[which].decomposition

    def set_decomposition(self, which: str, dec: Decomposition | None) -> None:
        self.factors[which].decomposition = dec

    def decompose(
        self,
        which: str,
        method: type[Decomposition],
        *,
        damping: float,
        dtype: torch.dtype,
        host: HostReader | None = None,
    ) -> bool:
        """Recompute one factor's decomposition; on failure keep the previous one.

        ``host`` reads the decomposition's finiteness check (see :mod:`dpkfac.device`).

        Returns:
            True when a new decomposition was computed.
        """
        factor = self.factor(which)
        if factor is None:
            return False
        work = working_dtype(factor.dtype, dtype)
        try:
            dec = method.compute(factor, damping=damping, dtype=work, host=host)
            self.set_decomposition(which, dec)
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

    def pi_damping(self, which: str, damping: float, host: HostReader | None = None) -> float:
        """The damping of one factor under Martens & Grosse's π-split (inverse method).

        With ``π = sqrt((tr A / d_A) / (tr G / d_G))`` the inverse method uses
        ``(A + π√γ I)⁻¹`` and ``(G + √γ/π I)⁻¹``, i.e. damping ``π²γ`` for A
        and ``γ/π²`` for G, which balances the two factors' scales. Falls back
        to the plain split when either factor is missing or degenerate.
        """
        a, g = self.factor("A"), self.factor("G")
        if a is None or g is None:
            return damping
        host = host if host is not None else HostReader()
        # One host read for both traces (a dry run assumes balanced factors).
        traces = torch.stack([torch.trace(a.double()), torch.trace(g.to(a.device).double())])
        a_trace, g_trace = host.read(traces, [float(a.shape[0]), float(g.shape[0])])
        a_mean, g_mean = a_trace / a.shape[0], g_trace / g.shape[0]
        if not (a_mean > 0 and g_mean > 0 and math.isfinite(a_mean / g_mean)):
            return damping
        pi = math.sqrt(a_mean / g_mean)
        return damping * pi**2 if which == "A" else damping / pi**2

    def has_decompositions(self) -> bool:
        return all(state.decomposition is not None for state in self.factors.values())

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
        a_dec, g_dec = self.decomposition("A"), self.decomposition("G")
        if grad is None or a_dec is None or g_dec is None:
            return None
        return precondition(grad, a_dec, g_dec, damping=damping)

    # ----------------------------------------------------------------- accounting
    def factor_nbytes(self) -> int:
        return sum(_nbytes(state.running) for state in self.factors.values())

    def decomposition_nbytes(self) -> int:
        return sum(
            s.decomposition.nbytes() for s in self.factors.values() if s.decomposition is not None
        )

    def __repr__(self) -> str:
        return (
            f"KFACLayer({self.name!r}, {type(self.module).__name__}, A={self.helper.a_dim}, "
            f"G={self.helper.g_dim}, owner={self.owner})"
        )
