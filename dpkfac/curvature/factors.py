"""Kronecker factors of the empirical Fisher (KFAC-expand / KFAC-reduce, bias joined).

Conventions (design contract): ``a`` is (N, T, d_in) and ``g`` is (N, T, d_out)
with N samples and T positions per sample.

* expand: ``A = aᵀa / (N·T)`` over all N·T rows; ``G = gᵀg / N`` where ``g``
  holds per-example gradients (``grad_output · N`` for a batch-mean loss).
* reduce: ``a`` is averaged and ``g`` summed over positions first, then
  ``A = āᵀā / N`` and ``G = ĝᵀĝ / N``.

A column of ones is appended to ``a`` after any averaging when the layer has a
bias, so A is (d_in + 1)².
"""

from __future__ import annotations

import torch

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
) -> torch.Tensor:
    """The batch A factor from the (N, T, d_in) layer input.

    Args:
        a: layer input patches, (N, T, d_in).
        has_bias: append a column of ones (after averaging) for the bias.
        weight_sharing: "expand" treats positions as extra samples; "reduce"
            averages them first, which is cheaper and what the DP-KFAC code
            uses for sequences.
        dtype: accumulation dtype of the factor (default: the input's).

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
    factor = rows.t() @ (rows / denom)
    return _symmetrize(factor)


def g_factor(
    g: torch.Tensor,
    *,
    weight_sharing: str = "expand",
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The batch G factor from the (N, T, d_out) gradient of a batch-mean loss.

    The gradient is rescaled by N so each row is a per-example loss gradient;
    that makes G independent of the batch size, as A is.

    Args:
        g: ``grad_output`` of the layer as (N, T, d_out).
        weight_sharing: "expand" sums outer products over positions; "reduce"
            sums the gradients over positions first.
        dtype: accumulation dtype of the factor (default: the input's).
    """
    _check_sharing(weight_sharing)
    if dtype is not None:
        g = g.to(dtype)
    n, t, d = g.shape
    g = g * n
    rows = g.sum(dim=1) if weight_sharing == "reduce" else g.reshape(n * t, d)
    factor = rows.t() @ (rows / n)
    return _symmetrize(factor)


def _symmetrize(factor: torch.Tensor) -> torch.Tensor:
    """Average with the transpose so round-off never makes a factor asymmetric."""
    return (factor + factor.t()) / 2
