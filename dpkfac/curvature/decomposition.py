"""Decompositions of Kronecker factors and the preconditioning they enable.

Two compute methods share one interface so strategies can communicate them
as plain tensor lists:

* ``eigen``: ``F = Q diag(d) Qᵀ``; preconditioning divides by the outer
  product of eigenvalues plus damping, which is exactly
  ``(G ⊗ A + γ I)⁻¹ vec(∇W)``.
* ``inverse``: ``(F + √γ I)⁻¹``, the damping split evenly over both factors.

Decompositions run in at least float32 (never in half precision) and retry in
float64 when ``eigh`` fails; if that fails too the caller keeps the previous
decomposition.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from dpkfac.device import HostReader


class DecompositionError(RuntimeError):
    """Raised when a factor cannot be decomposed even in float64."""


def working_dtype(factor_dtype: torch.dtype, decomposition_dtype: torch.dtype) -> torch.dtype:
    """The dtype a decomposition runs in: the more precise of the two, never below float32."""
    candidates = [decomposition_dtype, factor_dtype, torch.float32]
    return max(candidates, key=lambda dt: torch.finfo(dt).bits if dt.is_floating_point else 0)


class Decomposition(ABC):
    """A factor's decomposition, held as a list of tensors for communication."""

    method: ClassVar[str]

    @classmethod
    @abstractmethod
    def compute(
        cls,
        factor: torch.Tensor,
        *,
        damping: float,
        dtype: torch.dtype,
        host: HostReader | None = None,
    ) -> Decomposition:
        """Decompose ``factor`` in ``dtype`` (raises :class:`DecompositionError`).

        ``host`` reads the result's finiteness check (one read; None: a plain reader).
        """

    @classmethod
    @abstractmethod
    def fallback(cls, factor: torch.Tensor, *, damping: float, dtype: torch.dtype) -> Decomposition:
        """A safe stand-in built from the factor's diagonal, used when no decomposition exists."""

    @classmethod
    @abstractmethod
    def shapes(cls, dim: int) -> list[tuple[int, ...]]:
        """Shapes of :meth:`tensors` for a factor of dimension ``dim`` (for receive buffers)."""

    @classmethod
    @abstractmethod
    def from_tensors(cls, tensors: list[torch.Tensor]) -> Decomposition:
        """Rebuild from :meth:`tensors` output (after a broadcast or a checkpoint)."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """The contiguous tensors that define this decomposition."""

    def nbytes(self) -> int:
        """Bytes held by this decomposition."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _safe_diagonal(factor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The factor's diagonal with non-finite and negative entries zeroed (fallbacks only)."""
    diag = torch.diagonal(factor).to(dtype)
    return torch.nan_to_num(diag, nan=0.0, posinf=0.0, neginf=0.0).clamp(min=0.0)


def _all_finite(host: HostReader, *tensors: torch.Tensor) -> bool:
    """Whether every value of ``tensors`` is finite: one host read for all of them."""
    return all(host.flags(torch.stack([torch.isfinite(t).all() for t in tensors])))


def _eigh(
    factor: torch.Tensor, dtype: torch.dtype, host: HostReader
) -> tuple[torch.Tensor, torch.Tensor]:
    """``eigh`` in ``dtype``, retried in float64 before giving up."""
    try:
        d, q = torch.linalg.eigh(factor.to(dtype))
        if _all_finite(host, d, q):
            return d, q
    except (RuntimeError, torch.linalg.LinAlgError):
        pass
    try:
        d, q = torch.linalg.eigh(factor.to(torch.float64))
    except (RuntimeError, torch.linalg.LinAlgError) as err:
        raise DecompositionError(f"eigh failed in {dtype} and float64: {err}") from err
    if not _all_finite(host, d, q):
        raise DecompositionError("eigh returned non-finite values in float64")
    return d.to(dtype), q.to(dtype)


class EigenDecomposition(Decomposition):
    """Eigenvectors ``q`` and non-negative eigenvalues ``d`` of a factor."""

    method = "eigen"

    def __init__(self, q: torch.Tensor, d: torch.Tensor) -> None:
        self.q = q.contiguous()
        self.d = d.contiguous()

    @classmethod
    def compute(
        cls,
        factor: torch.Tensor,
        *,
        damping: float,
        dtype: torch.dtype,
        host: HostReader | None = None,
    ) -> EigenDecomposition:
        d, q = _eigh(factor, dtype, host if host is not None else HostReader())
        # Factors are PSD: negative eigenvalues are round-off and would make
        # d_G d_Aᵀ + γ approach zero.
        return cls(q, d.clamp(min=0.0))

    @classmethod
    def fallback(
        cls, factor: torch.Tensor, *, damping: float, dtype: torch.dtype
    ) -> EigenDecomposition:
        diag = _safe_diagonal(factor, dtype)
        return cls(torch.eye(factor.shape[0], dtype=dtype, device=factor.device), diag)

    @classmethod
    def shapes(cls, dim: int) -> list[tuple[int, ...]]:
        return [(dim, dim), (dim,)]

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor]) -> EigenDecomposition:
        q, d = tensors
        return cls(q, d)

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.d]


class InverseDecomposition(Decomposition):
    """The damped inverse ``(F + √γ I)⁻¹`` of a factor."""

    method = "inverse"

    def __init__(self, inv: torch.Tensor) -> None:
        self.inv = inv.contiguous()

    @classmethod
    def compute(
        cls,
        factor: torch.Tensor,
        *,
        damping: float,
        dtype: torch.dtype,
        host: HostReader | None = None,
    ) -> InverseDecomposition:
        host = host if host is not None else HostReader()
        for work_dtype in dict.fromkeys([dtype, torch.float64]):
            eye = torch.eye(factor.shape[0], dtype=work_dtype, device=factor.device)
            damped = factor.to(work_dtype) + math.sqrt(damping) * eye
            try:
                chol = torch.linalg.cholesky(damped)
                inv = torch.cholesky_inverse(chol)
            except (RuntimeError, torch.linalg.LinAlgError):
                try:
                    inv = torch.linalg.inv(damped)
                except (RuntimeError, torch.linalg.LinAlgError):
                    continue
            if _all_finite(host, inv):
                return cls(((inv + inv.t()) / 2).to(dtype))
        raise DecompositionError("damped inverse failed in float32 and float64")

    @classmethod
    def fallback(
        cls, factor: torch.Tensor, *, damping: float, dtype: torch.dtype
    ) -> InverseDecomposition:
        return cls(torch.diag(1.0 / (_safe_diagonal(factor, dtype) + math.sqrt(damping))))

    @classmethod
    def shapes(cls, dim: int) -> list[tuple[int, ...]]:
        return [(dim, dim)]

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor]) -> InverseDecomposition:
        (inv,) = tensors
        return cls(inv)

    def tensors(self) -> list[torch.Tensor]:
        return [self.inv]


#: The decomposition of each compute method (the choices: dpkfac.options.COMPUTE_METHODS).
DECOMPOSITIONS: dict[str, type[Decomposition]] = {
    "eigen": EigenDecomposition,
    "inverse": InverseDecomposition,
}


def precondition(
    grad: torch.Tensor,
    a_dec: Decomposition,
    g_dec: Decomposition,
    *,
    damping: float,
) -> torch.Tensor:
    """Precondition a (d_out, a_dim) gradient matrix with the factors' decompositions.

    The computation runs in the decompositions' dtype and the result is cast
    back to the gradient's dtype.
    """
    dtype = a_dec.tensors()[0].dtype
    grad_w = grad.to(dtype)
    if isinstance(a_dec, EigenDecomposition) and isinstance(g_dec, EigenDecomposition):
        v1 = g_dec.q.t() @ grad_w @ a_dec.q
        v2 = v1 / (torch.outer(g_dec.d, a_dec.d) + damping)
        result = g_dec.q @ v2 @ a_dec.q.t()
    elif isinstance(a_dec, InverseDecomposition) and isinstance(g_dec, InverseDecomposition):
        result = g_dec.inv @ grad_w @ a_dec.inv
    else:
        raise TypeError(f"mismatched decompositions {type(a_dec).__name__}/{type(g_dec).__name__}")
    return result.to(grad.dtype)
