"""Kronecker factors of the empirical Fisher (KFAC-expand / KFAC-reduce, bias joined).

Conventions (design contract): ``a`` is (N, T, d_in) and ``g`` is (N, T, d_out)
with N samples and T positions per sample.

* expand: ``A = aᵀa / (N·T)`` over all N·T rows; ``G = gᵀg / N`` where ``g``
  holds per-example gradients (``grad_output · N`` for a batch-mean loss).
* reduce: ``a`` is averaged and ``g`` summed over positions first, then
  ``A = āᵀā / N`` and ``G = ĝᵀĝ / N``.

A column of ones is appended to ``a`` after any averaging when the layer has a
bias, so A is (d_in + 1)².

The products are :func:`sym_gram` (upper block triangle only, mirrored) unless
``triangle=False``, which keeps the original full product (the "unfold" baseline of
``factor_method``). The Conv2d fast paths that avoid im2col altogether are below too,
dispatched by :class:`dpkfac.curvature.modules.Conv2dHelper`.

**The exact kernels that build them cheaply.**

Three building blocks, all exact up to float round-off unless marked:

* :func:`sym_gram` — ``XᵀX`` computing only the upper block triangle (one GEMM
  per block row of column blocks, the lower triangle mirrored), so the
  result is exactly symmetric and costs about ``(nb+1)/(2nb)`` of the full
  product's flops for ``nb`` column blocks.
* :func:`conv_a_shifted` — the "expand" A factor of a stride-1 ``Conv2d``
  (any kernel, dilation and zero padding) built from the input without
  im2col. Block ``(δ, δ')`` of ``Σ aᵀa`` (kernel offsets δ, δ') is
  ``Σ_p x[p+δ] x[p+δ']ᵀ`` over output positions p; it depends on the shift
  ``s = δ'−δ`` except at the borders. One ``C×C`` GEMM per distinct shift
  with ``s ≥ 0`` (13 for 3×3 instead of 81 block products; ``S(−s) = S(s)ᵀ``)
  gives the sum over *every* pair of real pixels ``(p, p+s)``; the pixels a
  given ``(δ, δ')`` does not see (border rows/columns of the image) are
  subtracted exactly: row strips plus column strips minus their corners
  (inclusion–exclusion). The shifted GEMMs run on one flat copy of the input
  laid out ``(C, N·H'·W')`` with ``(kh−1)·dh`` zero rows and ``(kw−1)·dw`` zero
  columns after each image, so that a shift is a plain offset in the flat
  index: a pair that would wrap to the next row or image lands on a zero.
* :func:`conv_a_reduce` — the "reduce" A factor of any zero-padded Conv2d:
  the position average of every patch column is a masked window sum
  (``einsum`` of 0/1 row and column masks with the input), no im2col.

:class:`dpkfac.curvature.modules.Conv2dHelper` dispatches. Measured with
``python -m experiments.bench.factor_kernels`` (this 2-core AMD EPYC, MKL,
float32, ResNet-32 option-B shapes at batch 32, 1 thread, median of 7
interleaved runs, ms per layer; the machine is shared, so ±20 %)::

    layer (×count)               unfold  unfold+tri  auto(shifted)  ratio
    conv 3->16   32² 3×3 s1 (1)    9.0      8.4        5.8          1.6×
    conv 16->16  32² 3×3 s1 (10) 122.3     87.7       15.2          8.1×
    conv 32->32  16² 3×3 s1 (9)   33.6     16.9        6.1          5.5×
    conv 64->64   8² 3×3 s1 (9)   21.6     24.4        7.1          3.0×
    conv 16->32  32² 3×3 s2 (1)   15.9     10.5       14.5 (tri)    1.1×
    conv 32->64  16² 3×3 s2 (1)    5.2      4.1        4.0 (tri)    1.3×
    1×1 s2 shortcuts, linear     ≤0.44    ≤0.38      ≤0.38         1.1×
    total A (all 34 layers)     1750       1272        295          5.9×
    total G                       20.1                   9.5          2.1×

So "auto" (:data:`DEFAULT_METHOD`) uses "shifted" for every stride-1
"expand" Conv2d (faster on every shape measured, 1.6–8×, most on many
channels × big maps), the masked-sum path for "reduce", and im2col with
:func:`sym_gram` for strided convolutions and Linear layers (1.1–1.4×);
``factor_method="unfold"`` keeps the original im2col + full product
everywhere. "auto" has no shape-dependent branch for stride 1: no measured
shape favoured im2col there.

``bf16=True`` ("auto_bf16"; opt-in, never the default, not exact) rounds
the GEMM inputs to bfloat16 and sums the products over row chunks in float32
(torch on CPU has no bf16×bf16→fp32 GEMM, so each chunk's output is rounded
to bf16 once; relative error 3e-4 to 2e-3 on the ResNet-32 shapes). It
measured *slower* than float32 here (total A 684 ms vs 295 ms): the bf16
GEMMs with tiny C×C outputs and the casts cost more than the AVX-512 BF16 instructions save.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from dpkfac.device import TableCache

T = TypeVar("T")

#: Values of the ``factor_method`` option.
FACTOR_METHODS = ("auto", "unfold", "auto_bf16")
#: The method used when none is given.
DEFAULT_METHOD = "auto"
#: Column-block size of :func:`sym_gram` (below 2 blocks: one full GEMM).
TRIANGLE_BLOCK = 64
#: Rows per float32 partial sum in bf16 mode.
BF16_CHUNK = 1024


def check_method(method: str) -> None:
    if method not in FACTOR_METHODS:
        raise ValueError(
            f"unknown factor_method {method!r}; expected one of {list(FACTOR_METHODS)}"
        )


def out_positions(
    hw: tuple[int, int],
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int],
) -> int:
    """Output positions T of a Conv2d on an (H, W) input."""
    return _out_size(hw[0], kernel_size[0], stride[0], padding[0], dilation[0]) * _out_size(
        hw[1], kernel_size[1], stride[1], padding[1], dilation[1]
    )


def use_shifted(
    method: str, stride: tuple[int, int], kernel_size: tuple[int, int], nhw: tuple[int, int, int]
) -> bool:
    """Whether an expand Conv2d A factor is built by :func:`conv_a_shifted`.

    Only stride 1 is covered; "unfold" never uses it; "auto" (and
    "auto_bf16") use it for every stride-1 layer (it measured faster on every shape we
    tried, see the module docstring).
    """
    del kernel_size, nhw  # every stride-1 shape measured so far favours "shifted"
    return method != "unfold" and tuple(stride) == (1, 1)


# ---------------------------------------------------------------- cost model
def shift_count(kh: int, kw: int) -> int:
    """GEMMs of :func:`conv_a_shifted`: shifts ``s ≥ 0`` of a kh×kw kernel (13 for 3×3)."""
    return kh * (2 * kw - 1) - (kw - 1)


def triangle_work(rows: int, d: int, block: int = TRIANGLE_BLOCK) -> tuple[int, float]:
    """(GEMM calls, flops) of :func:`sym_gram` on a (rows, d) matrix."""
    if d < 2 * block:
        return 1, 2.0 * rows * d * d
    nb = -(-d // block)
    flops = sum(2.0 * rows * min(block, d - b0) * (d - b0) for b0 in range(0, d, block))
    return nb, flops


def guess_square_kernel(a_dim: int) -> tuple[int, int]:
    """(k, C) of a conv A factor side ``a_dim`` (bias or not): the largest odd k in 7, 5, 3
    with ``k²`` dividing it, else 1. A guess: :class:`~dpkfac.plan.assignment.LayerShape`
    keeps neither the kernel nor the stride."""
    for k in (7, 5, 3):
        for d in (a_dim, a_dim - 1):
            if d >= k * k and d % (k * k) == 0:
                return k, d // (k * k)
    return 1, a_dim


# ------------------------------------------------------------------- products
def _mm(a: torch.Tensor, b: torch.Tensor, bf16: bool) -> torch.Tensor:
    """``a @ b`` (a: (m, k), b: (k, n)); in bf16 mode, chunked over k with fp32 sums."""
    if not bf16:
        return a @ b
    out_dtype = torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype
    out = a.new_zeros((a.shape[0], b.shape[1]), dtype=out_dtype)
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    for k0 in range(0, a.shape[1], BF16_CHUNK):
        out += (a16[:, k0 : k0 + BF16_CHUNK] @ b16[k0 : k0 + BF16_CHUNK]).to(out_dtype)
    return out.to(a.dtype)


def _mirror_upper(out: torch.Tensor) -> torch.Tensor:
    """Exactly symmetric matrix from the upper triangle of ``out``."""
    return torch.triu(out) + torch.triu(out, 1).t()


def sym_gram(x: torch.Tensor, *, block: int = TRIANGLE_BLOCK, bf16: bool = False) -> torch.Tensor:
    """``xᵀx`` of an (m, d) matrix from its upper block triangle only.

    Row strip ``b`` of the result is ``x[:, b]ᵀ x[:, b:]`` (one GEMM per
    column block, no copies: column slices of a row-major matrix are BLAS
    operands as they are); the strictly lower part is the mirror, so the
    result is exactly symmetric. With fewer than two blocks it is one GEMM.
    """
    d = x.shape[1]
    if d < 2 * block:
        return _mirror_upper(_mm(x.t(), x, bf16))
    out = x.new_zeros((d, d))
    for b0 in range(0, d, block):
        b1 = min(d, b0 + block)
        out[b0:b1, b0:] = _mm(x[:, b0:b1].t(), x[:, b0:], bf16)
    return _mirror_upper(out)


# -------------------------------------------------------------- conv geometry
# Plans are pure Python (ints, tuples), cached per geometry; the tensors made
# from them live on the layer input's device and in its dtype, cached per
# (geometry, device, dtype) in a table cache that one layer's helper owns
# (:class:`~dpkfac.device.TableCache`). A plan never holds a tensor: a CPU tensor that meets
# CUDA data would fail (or copy host to device on every call).
@dataclass(frozen=True)
class _Shift:
    """One shift ``s = (si·dh, sj·dw) ≥ 0`` and what its blocks must subtract."""

    si: int
    sj: int
    offset: int  # flat offset in the padded (H', W') layout
    rows: tuple[int, int]  # rows u with u and u+si·dh both real
    cols: tuple[int, int]
    i_list: tuple[int, ...]  # kernel row offsets i with i+si in range
    j_list: tuple[int, ...]  # kernel column offsets j with j+sj in range
    row_runs: tuple[tuple[int, int], ...]  # border rows some pair excludes, as slices
    col_runs: tuple[tuple[int, int], ...]
    mask_rows: tuple[tuple[float, ...], ...]  # (ni, |band_rows|): 1 where pair row i excludes
    mask_cols: tuple[tuple[float, ...], ...]  # (nj, |band_cols|)


@dataclass(frozen=True)
class _ShiftTensors:
    """A shift's index and mask tensors on one device, in one dtype."""

    ii: torch.Tensor  # (ni, 1) kernel row offsets
    jj: torch.Tensor  # (1, nj)
    ii2: torch.Tensor  # ii + si
    jj2: torch.Tensor  # jj + sj
    mask_rows: torch.Tensor
    mask_cols: torch.Tensor


@dataclass(frozen=True)
class _Plan:
    h: int
    w: int
    hp: int  # rows per image in the flat layout
    wp: int  # columns per row in the flat layout
    out_hw: tuple[int, int]
    shifts: tuple[_Shift, ...]
    win_rows: tuple[tuple[int, ...], ...]  # (kh, H) 0/1: input rows seen by kernel row i
    win_cols: tuple[tuple[int, ...], ...]  # (kw, W)


def _cached(cache: TableCache | None, key: tuple[object, ...], build: Callable[[], T]) -> T:
    return build() if cache is None else cache.get(key, build)


def _window(
    k: int, size: int, out: int, stride: int, pad: int, dil: int
) -> tuple[tuple[int, ...], ...]:
    """Per kernel offset, the 0/1 indicator of the input indices its window visits."""
    rows = []
    for i in range(k):
        hit = [0] * size
        for o in range(out):
            u = o * stride + i * dil - pad
            if 0 <= u < size:
                hit[u] = 1
        rows.append(tuple(hit))
    return tuple(rows)


def _runs(indices: list[int]) -> tuple[tuple[int, int], ...]:
    """Sorted indices as maximal ``(start, stop)`` slices."""
    runs: list[list[int]] = []
    for k in indices:
        if runs and runs[-1][1] == k:
            runs[-1][1] = k + 1
        else:
            runs.append([k, k + 1])
    return tuple((a, b) for a, b in runs)


def _out_size(size: int, k: int, stride: int, pad: int, dil: int) -> int:
    return (size + 2 * pad - dil * (k - 1) - 1) // stride + 1


@functools.lru_cache(maxsize=256)
def _plan(h: int, w: int, kh: int, kw: int, ph: int, pw: int, dh: int, dw: int) -> _Plan:
    """Index and mask tables of the shifted kernel for one stride-1 geometry (Python data)."""
    ho, wo = _out_size(h, kh, 1, ph, dh), _out_size(w, kw, 1, pw, dw)
    win_r = _window(kh, h, ho, 1, ph, dh)
    win_c = _window(kw, w, wo, 1, pw, dw)
    shifts = []
    for si in range(kh):
        for sj in range(-(kw - 1), kw):
            if si == 0 and sj < 0:
                continue  # the transpose of shift (0, -sj)
            ri, rj = si * dh, sj * dw
            rows = (0, max(0, h - ri))
            cols = (min(w, max(0, -rj)), max(0, w - max(0, rj)))
            i_list = tuple(range(0, kh - si))
            j_list = tuple(range(max(0, -sj), kw - max(0, sj)))
            # Excluded rows of pair row i: real rows of the shift its window misses.
            ex_r = [[u for u in range(*rows) if not win_r[i][u]] for i in i_list]
            ex_c = [[v for v in range(*cols) if not win_c[j][v]] for j in j_list]
            band_r = sorted({u for ex in ex_r for u in ex})
            band_c = sorted({v for ex in ex_c for v in ex})
            shifts.append(
                _Shift(
                    si=si,
                    sj=sj,
                    offset=ri * (w + (kw - 1) * dw) + rj,
                    rows=rows,
                    cols=cols,
                    i_list=i_list,
                    j_list=j_list,
                    row_runs=_runs(band_r),
                    col_runs=_runs(band_c),
                    mask_rows=tuple(tuple(float(u in ex) for u in band_r) for ex in ex_r),
                    mask_cols=tuple(tuple(float(v in ex) for v in band_c) for ex in ex_c),
                )
            )
    return _Plan(
        h=h,
        w=w,
        hp=h + (kh - 1) * dh,
        wp=w + (kw - 1) * dw,
        out_hw=(ho, wo),
        shifts=tuple(shifts),
        win_rows=win_r,
        win_cols=win_c,
    )


def _mask(rows: tuple[tuple[float, ...], ...], like: torch.Tensor) -> torch.Tensor:
    """A (len(rows), width) 0/1 table on ``like``'s device, in its dtype (width may be 0)."""
    width = len(rows[0]) if rows else 0
    return torch.tensor(rows, dtype=like.dtype, device=like.device).reshape(len(rows), width)


def _shift_tensors(sh: _Shift, like: torch.Tensor) -> _ShiftTensors:
    """A shift's tensors on ``like``'s device (masks in its dtype)."""
    ii = torch.tensor(sh.i_list, dtype=torch.long, device=like.device).reshape(-1, 1)
    jj = torch.tensor(sh.j_list, dtype=torch.long, device=like.device).reshape(1, -1)
    return _ShiftTensors(
        ii=ii,
        jj=jj,
        ii2=ii + sh.si,
        jj2=jj + sh.sj,
        mask_rows=_mask(sh.mask_rows, like),
        mask_cols=_mask(sh.mask_cols, like),
    )


def _with_bias(s: torch.Tensor, col: torch.Tensor, count: float) -> torch.Tensor:
    """``[[S, b], [bᵀ, count]]``."""
    d = s.shape[0]
    out = s.new_empty((d + 1, d + 1))
    out[:d, :d] = s
    out[:d, d] = col
    out[d, :d] = col
    out[d, d] = count
    return out


# ------------------------------------------------------------ shifted A factor
def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _corrections(
    x: torch.Tensor, sh: _Shift, tables: _ShiftTensors, dilation: tuple[int, int]
) -> torch.Tensor:
    """What each pair of shift ``sh`` must subtract from the full shifted product.

    Border rows (all columns of the shift's range) plus border columns (all
    rows) minus the corners counted twice, each resolved per row/column and
    combined per pair with the 0/1 masks of the rows/columns it excludes.
    Returns (ni, nj, C, C) (broadcastable).
    """
    ri, rj = sh.si * dilation[0], sh.sj * dilation[1]
    (r0, r1), (c0, c1) = sh.rows, sh.cols
    corr = None
    if sh.row_runs:
        rows = _cat(
            [
                torch.einsum(
                    "ncuv,nduv->ucd",
                    x[:, :, a:b, c0:c1],
                    x[:, :, a + ri : b + ri, c0 + rj : c1 + rj],
                )
                for a, b in sh.row_runs
            ],
            0,
        )
        corr = torch.einsum("iu,ucd->icd", tables.mask_rows, rows)[:, None]
    if sh.col_runs:
        cols = _cat(
            [
                torch.einsum(
                    "ncuv,nduv->vcd",
                    x[:, :, r0:r1, a:b],
                    x[:, :, r0 + ri : r1 + ri, a + rj : b + rj],
                )
                for a, b in sh.col_runs
            ],
            0,
        )
        col_corr = torch.einsum("jv,vcd->jcd", tables.mask_cols, cols)[None]
        corr = col_corr if corr is None else corr + col_corr
        if sh.row_runs:
            corners = _cat(
                [
                    _cat(
                        [
                            torch.einsum(
                                "ncuv,nduv->uvcd",
                                x[:, :, a:b, e:f],
                                x[:, :, a + ri : b + ri, e + rj : f + rj],
                            )
                            for e, f in sh.col_runs
                        ],
                        1,
                    )
                    for a, b in sh.row_runs
                ],
                0,
            )
            corr = corr - torch.einsum(
                "iu,jv,uvcd->ijcd", tables.mask_rows, tables.mask_cols, corners
            )
    assert corr is not None, "_corrections needs a shift with border rows or columns"
    return corr


def conv_a_shifted(
    x: torch.Tensor,
    kernel_size: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int] = (1, 1),
    *,
    has_bias: bool,
    bf16: bool = False,
    cache: TableCache | None = None,
) -> torch.Tensor:
    """The expand A factor ``aᵀa/(N·T)`` of a stride-1, zero-padded Conv2d, without im2col.

    Args:
        x: layer input (N, C, H, W), already in the factor's dtype.
        kernel_size, padding, dilation: the convolution's (padding in pixels,
            zero padding; apply other padding modes to ``x`` first and pass 0).
        has_bias: append the ones column (patch sums and ``N·T`` in the corner).
        bf16: opt-in bf16 products with float32 partial sums (not exact).
        cache: where the geometry's index and mask tensors are kept (per
            device and dtype); None makes them at every call.

    Returns:
        (C·kh·kw [+1])² factor with the im2col column order ``(c, i, j)``.
    """
    n, c, h, w = x.shape
    kh, kw = kernel_size
    geometry = (h, w, kh, kw, padding[0], padding[1], dilation[0], dilation[1])
    plan = _plan(*geometry)
    key = ("shifted", *geometry, x.device, x.dtype)
    tables = _cached(cache, key, lambda: [_shift_tensors(sh, x) for sh in plan.shifts])
    ho, wo = plan.out_hw
    count = n * ho * wo
    flat = x.new_zeros((c, n, plan.hp, plan.wp))
    flat[:, :, :h, :w] = x.transpose(0, 1)
    flat = flat.reshape(c, -1)
    length = flat.shape[1]
    out = x.new_empty((c, kh, kw, c, kh, kw))
    for sh, tab in zip(plan.shifts, tables, strict=True):
        off = sh.offset
        s = _mm(flat[:, : length - off], flat[:, off:].t(), bf16)
        blocks = s.expand(len(sh.i_list), len(sh.j_list), c, c)
        if sh.row_runs or sh.col_runs:
            blocks = blocks - _corrections(x, sh, tab, dilation)
        if sh.si == 0 and sh.sj == 0:
            blocks = (blocks + blocks.transpose(-1, -2)) / 2
        out[:, tab.ii, tab.jj, :, tab.ii2, tab.jj2] = blocks
        if sh.si or sh.sj:
            out[:, tab.ii2, tab.jj2, :, tab.ii, tab.jj] = blocks.transpose(-1, -2)
    d = c * kh * kw
    # Exactly symmetric: the s = 0 blocks are symmetrised, the others mirrored.
    factor = out.reshape(d, d) / count
    if not has_bias:
        return factor
    win_rows, win_cols = _cached(
        cache,
        ("windows", *key),
        lambda: (_mask(plan.win_rows, x), _mask(plan.win_cols, x)),
    )
    sums = torch.einsum("iu,cuv,jv->cij", win_rows, x.sum(0), win_cols)
    return _with_bias(factor, sums.reshape(d) / count, 1.0)


# ------------------------------------------------------------- reduce A factor
@functools.lru_cache(maxsize=256)
def _windows(
    h: int, w: int, kh: int, kw: int, sh: int, sw: int, ph: int, pw: int, dh: int, dw: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...], int]:
    """Row and column window indicators of a strided geometry, and its positions T."""
    ho, wo = _out_size(h, kh, sh, ph, dh), _out_size(w, kw, sw, pw, dw)
    return _window(kh, h, ho, sh, ph, dh), _window(kw, w, wo, sw, pw, dw), ho * wo


def conv_a_reduce(
    x: torch.Tensor,
    kernel_size: tuple[int, int],
    stride: tuple[int, int],
    padding: tuple[int, int],
    dilation: tuple[int, int] = (1, 1),
    *,
    has_bias: bool,
    bf16: bool = False,
    cache: TableCache | None = None,
) -> torch.Tensor:
    """The reduce A factor ``āᵀā/N`` of a zero-padded Conv2d, ā = patches averaged over positions.

    The average of patch column ``(c, i, j)`` is a window sum of channel c,
    ``Σ_{u,v} R[i,u] x[c,u,v] K[j,v] / T`` with 0/1 masks R, K of the rows
    and columns kernel offset (i, j) visits: one einsum, no im2col.
    """
    n, c, h, w = x.shape
    kh, kw = kernel_size
    geometry = (h, w, kh, kw, *stride, *padding, *dilation)
    rows_ind, cols_ind, t = _windows(*geometry)
    win_r, win_c = _cached(
        cache,
        ("reduce", *geometry, x.device, x.dtype),
        lambda: (_mask(rows_ind, x), _mask(cols_ind, x)),
    )
    mean = torch.einsum("iu,ncuv,jv->ncij", win_r, x, win_c)
    rows = mean.reshape(n, c * kh * kw) / t
    if has_bias:
        rows = torch.cat([rows, rows.new_ones(n, 1)], dim=1)
    return sym_gram(rows, bf16=bf16) / n


# -------------------------------------------------------------- the factors
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
