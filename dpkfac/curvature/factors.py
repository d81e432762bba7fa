"""Kronecker factors of the empirical Fisher (KFAC-expand / KFAC-reduce, bias joined).

Conventions (design contract): ``a`` is (N, T, d_in) and ``g`` is (N, T, d_out)
with N samples and T positions per sample.

* expand: ``A = aᵀa / (N·T)`` over all N·T rows; ``G = gᵀg / N`` where ``g``
  holds per-example gradients (``grad_output · N`` for a batch-mean loss).
* reduce: ``a`` is averaged and ``g`` summed over positions first, then
  ``A = āᵀā / N`` and ``G = ĝᵀĝ / N``.

A column of ones is appended to ``a`` after any averaging when the layer has a
bias, so A is (d_in + 1)².

The products are :func:`dpkfac.curvature.kernels.sym_gram` (upper block
triangle only, mirrored) unless ``triangle=False``, which keeps the original
full product (the "unfold" baseline of ``factor_method``). The Conv2d fast
paths that avoid im2col altogether live in :mod:`dpkfac.curvature.kernels`
and are dispatched by :class:`dpkfac.curvature.modules.Conv2dHelper`.
"""

from __future__ import annotations

import torch

from dpkfac.curvature.kernels import sym_gram

WEIGHT_SHARING = ("expand", "reduce")


def _check_sharing(weight_sharing: str) -> None:
    if weight_sharing not in WEIGHT_SHARING:
        raise ValueError(
            f"unknown weight_sharing {weight_sharing!r}; expected one of {WEIGHT_SHARING}"
        )


def a_factor(
    a: torch.Tensor,
    *,
    has_bias: bool,
    weight_sharing: str = "expand",
    dtype: torch.dtype | None = None,
    triangle: bool = True,
    bf16: bool = False,
) -> torch.Tensor:
    """The batch A factor from the (N, T, d_in) layer input.

    Args:
        a: layer input patches, (N, T, d_in).
        has_bias: append a column of ones (after averaging) for the bias.
        weight_sharing: "expand" treats positions as extra samples; "reduce"
            averages them first, which is cheaper and what the DP-KFAC code
            uses for sequences.
        dtype: accumulation dtype of the factor (default: the input's).
        triangle: upper-triangle-only product (False: the original full one).
        bf16: opt-in bf16 products with float32 partial sums (not exact).

    Returns:
        The symmetric (d_in[+1])² factor.
    """
    _check_sharing(weight_sharing)
    if dtype is not None:
        a = a.to(dtype)
    n, t, d = a.shape
    if weight_sharing == "reduce":
        rows, denom = a.mean(dim=1), n
    else:
        rows, denom = a.reshape(n * t, d), n * t
    if has_bias:
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    if triangle or bf16:
        return sym_gram(rows, bf16=bf16) / denom
    factor = rows.t() @ (rows / denom)
    return _symmetrize(factor)


def g_factor(
    g: torch.Tensor,
    *,
    weight_sharing: str = "expand",
    dtype: torch.dtype | None = None,
    triangle: bool = True,
    bf16: bool = False,
) -> torch.Tensor:
    """The batch G factor from the (N, T, d_out) gradient of a batch-mean loss.

    The gradient is rescaled by N so each row is a per-example loss gradient;
    that makes G independent of the batch size, as A is.

    Args:
        g: ``grad_output`` of the layer as (N, T, d_out).
        weight_sharing: "expand" sums outer products over positions; "reduce"
            sums the gradients over positions first.
        dtype: accumulation dtype of the factor (default: the input's).
        triangle: upper-triangle-only product of the unscaled rows, scaled by
            N after (False: the original full product of rescaled rows).
        bf16: opt-in bf16 products with float32 partial sums (not exact).
    """
    _check_sharing(weight_sharing)
    if dtype is not None:
        g = g.to(dtype)
    n, t, d = g.shape
    if triangle or bf16:
        # (g·N)ᵀ(g·N)/N = N·gᵀg: scale the d×d result, not the rows.
        rows = g.sum(dim=1) if weight_sharing == "reduce" else g.reshape(n * t, d)
        return sym_gram(rows, bf16=bf16) * n
    g = g * n
    rows = g.sum(dim=1) if weight_sharing == "reduce" else g.reshape(n * t, d)
    factor = rows.t() @ (rows / n)
    return _symmetrize(factor)


def conv_g_factor(
    grad_output: torch.Tensor,
    *,
    weight_sharing: str = "expand",
    dtype: torch.dtype | None = None,
    bf16: bool = False,
) -> torch.Tensor:
    """:func:`g_factor` of a Conv2d straight from its (N, C, H, W) ``grad_output``.

    ``gᵀg`` summed over samples as one batched product of the contiguous
    (C, H·W) slices (no transposed copy of the gradient), symmetrised.
    """
    _check_sharing(weight_sharing)
    if dtype is not None:
        grad_output = grad_output.to(dtype)
    n, c = grad_output.shape[:2]
    g = grad_output.reshape(n, c, -1)
    if weight_sharing == "reduce":
        return sym_gram(g.sum(dim=2), bf16=bf16) * n
    if bf16:
        return sym_gram(g.transpose(1, 2).reshape(-1, c), bf16=True) * n
    return _symmetrize(torch.bmm(g, g.transpose(1, 2)).sum(0)) * n


def _symmetrize(factor: torch.Tensor) -> torch.Tensor:
    """Average with the transpose so round-off never makes a factor asymmetric."""
    return (factor + factor.t()) / 2
