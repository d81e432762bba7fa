"""The fast factor kernels (dpkfac.curvature.factors) against dense float64 references.

References: the im2col ("unfold") path of the library, an independent naive
loop over output positions and kernel offsets, and full ``XᵀX`` products.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpkfac
from dpkfac.curvature import factors as kernels
from dpkfac.curvature.factors import a_factor, g_factor
from dpkfac.curvature.modules import helper_for

TOL = 1e-10
BF16_TOL = 2e-2  # relative Frobenius error of the bf16 option (8-bit mantissa inputs)


def rel(actual: torch.Tensor, ref: torch.Tensor) -> float:
    return float((actual.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300))


def naive_a(x, kernel, padding, dilation, has_bias):
    """Σ over output positions of patch outer products, by explicit loops (expand)."""
    n, c, h, w = x.shape
    (kh, kw), (ph, pw), (dh, dw) = kernel, padding, dilation
    xp = F.pad(x, (pw, pw, ph, ph))
    ho, wo = h + 2 * ph - dh * (kh - 1), w + 2 * pw - dw * (kw - 1)
    d = c * kh * kw + int(has_bias)
    acc = torch.zeros(d, d, dtype=torch.float64)
    for oy in range(ho):
        for ox in range(wo):
            patch = xp[:, :, oy : oy + dh * kh : dh, ox : ox + dw * kw : dw].reshape(n, -1)
            if has_bias:
                patch = torch.cat([patch, torch.ones(n, 1, dtype=patch.dtype)], 1)
            acc += patch.t() @ patch
    return acc / (n * ho * wo)


def unfold_a(conv: nn.Conv2d, x: torch.Tensor, sharing: str = "expand") -> torch.Tensor:
    return helper_for(conv).a_factor(x, sharing, torch.float64, "unfold")[0]


GEOMETRIES = [
    (c, k, p, bias, n, hw)
    for c, k, p, bias, n, hw in itertools.product(
        (3, 16),
        ((1, 1), (3, 3), (5, 5), (3, 1)),
        ((0, 0), (1, 1), (2, 2)),
        (False, True),
        (1, 4),
        ((7, 9), (6, 5)),
    )
    if hw[0] + 2 * p[0] >= k[0] and hw[1] + 2 * p[1] >= k[1]
]


@pytest.mark.parametrize(("c", "k", "p", "bias", "n", "hw"), GEOMETRIES)
def test_shifted_equals_unfold(c, k, p, bias, n, hw) -> None:
    torch.manual_seed(hash((c, k, p, bias, n, hw)) % 2**31)
    conv = nn.Conv2d(c, 5, k, padding=p, bias=bias).double()
    x = torch.randn(n, c, *hw, dtype=torch.float64)
    ref = unfold_a(conv, x)
    for method in ("auto",):
        got, n_got, t_got = helper_for(conv).a_factor(x, "expand", torch.float64, method)
        assert (n_got, t_got) == (n, conv(x).shape[2] * conv(x).shape[3])
        assert rel(got, ref) <= TOL, (method, rel(got, ref))
        assert float((got - ref).abs().max()) <= TOL * float(ref.abs().max())
        assert torch.equal(got, got.t())  # exactly symmetric


@pytest.mark.parametrize(
    ("k", "p", "dil", "bias"),
    [
        ((3, 3), (1, 1), (1, 1), True),
        ((3, 3), (0, 2), (2, 1), False),
        ((2, 3), (1, 0), (1, 2), True),
    ],
)
def test_shifted_equals_naive_loop(k, p, dil, bias) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, 8, 7, dtype=torch.float64)
    got = kernels.conv_a_shifted(x, k, p, dil, has_bias=bias)
    assert rel(got, naive_a(x, k, p, dil, bias)) <= TOL


@pytest.mark.parametrize(
    "kwargs",
    [
        {"stride": 2, "padding": 1},
        {"stride": (1, 2), "padding": 0},
        {"padding": "same", "padding_mode": "reflect"},
        {"padding": 1, "padding_mode": "circular"},
        {"padding": "valid"},
        {"padding": "same", "dilation": 2},
    ],
)
@pytest.mark.parametrize("sharing", ["expand", "reduce"])
def test_fallbacks_and_other_geometries_equal_unfold(kwargs, sharing) -> None:
    torch.manual_seed(1)
    conv = nn.Conv2d(3, 4, 3, bias=True, **kwargs).double()
    x = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    ref = unfold_a(conv, x, sharing)
    got = helper_for(conv).a_factor(x, sharing, torch.float64, "auto")[0]
    assert rel(got, ref) <= TOL


@pytest.mark.parametrize(("k", "p", "s"), [((3, 3), (1, 1), (1, 1)), ((1, 1), (0, 0), (2, 2))])
@pytest.mark.parametrize("bias", [False, True])
def test_reduce_mode_equals_unfold(k, p, s, bias) -> None:
    torch.manual_seed(2)
    conv = nn.Conv2d(16, 8, k, padding=p, stride=s, bias=bias).double()
    x = torch.randn(4, 16, 8, 6, dtype=torch.float64)
    got = helper_for(conv).a_factor(x, "reduce", torch.float64, "auto")[0]
    assert rel(got, unfold_a(conv, x, "reduce")) <= TOL


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
def test_g_factor_paths_agree(sharing) -> None:
    torch.manual_seed(3)
    conv = nn.Conv2d(3, 16, 3)
    grad = torch.randn(4, 16, 5, 6, dtype=torch.float64)
    helper = helper_for(conv)
    ref = helper.g_factor(grad, sharing, torch.float64, "unfold")
    assert rel(helper.g_factor(grad, sharing, torch.float64, "auto"), ref) <= TOL
    lin = helper_for(nn.Linear(3, 70))
    g = torch.randn(4, 5, 70, dtype=torch.float64)
    ref = g_factor(g, weight_sharing=sharing, triangle=False)
    assert rel(lin.g_factor(g, sharing, torch.float64, "auto"), ref) <= TOL


@pytest.mark.parametrize("d", [5, 127, 128, 300])
def test_triangle_product_equals_full(d) -> None:
    torch.manual_seed(d)
    x = torch.randn(257, d, dtype=torch.float64)
    got = kernels.sym_gram(x)
    assert torch.equal(got, got.t())
    assert rel(got, x.t() @ x) <= 1e-13
    a = torch.randn(3, 40, d, dtype=torch.float64)
    tri = a_factor(a, has_bias=True, triangle=True)
    assert rel(tri, a_factor(a, has_bias=True, triangle=False)) <= 1e-13


def test_bf16_option_within_tolerance() -> None:
    torch.manual_seed(4)
    conv = nn.Conv2d(16, 8, 3, padding=1)
    x = torch.randn(4, 16, 16, 16)
    ref = unfold_a(conv, x.double())
    got = helper_for(conv).a_factor(x, "expand", torch.float32, "auto_bf16")[0]
    assert got.dtype == torch.float32
    assert 0 < rel(got, ref) <= BF16_TOL
    y = torch.randn(500, 200)
    assert rel(kernels.sym_gram(y, bf16=True), y.double().t() @ y.double()) <= BF16_TOL


def test_float32_close_to_float64() -> None:
    torch.manual_seed(5)
    conv = nn.Conv2d(16, 8, 3, padding=1)
    x = torch.randn(8, 16, 16, 16)
    ref = unfold_a(conv, x.double())
    assert rel(helper_for(conv).a_factor(x, "expand", torch.float32, "auto")[0], ref) <= 1e-5


def test_unknown_method_rejected() -> None:
    with pytest.raises(ValueError, match="factor_method"):
        helper_for(nn.Conv2d(3, 4, 3)).a_factor(torch.randn(1, 3, 5, 5), "expand", None, "fast")
    with pytest.raises(ValueError, match="factor_method"):
        dpkfac.KFACPreconditioner(nn.Linear(2, 2), factor_method="fast")


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.c3 = nn.Conv2d(8, 6, 1, stride=2)
        self.c4 = nn.Conv2d(6, 6, (3, 1), padding=(2, 0), dilation=(2, 1))
        self.fc = nn.Linear(6 * 5 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.c2(torch.tanh(self.c1(x))))
        x = torch.tanh(self.c4(torch.tanh(self.c3(x))))
        return self.fc(x.flatten(1))


def test_factor_method_has_one_name_per_path() -> None:
    """The retired second name of "auto" ("shifted") is refused, naming the choices."""
    with pytest.raises(ValueError, match=r"factor_method.*'shifted'.*auto"):
        dpkfac.KFACPreconditioner(TinyNet(), strategy="dp_kfac", factor_method="shifted")


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
def test_preconditioner_factors_unchanged_between_methods(sharing) -> None:
    factors = {}
    for method in ("unfold", "auto"):
        torch.manual_seed(0)
        model = TinyNet().double()
        pre = dpkfac.KFACPreconditioner(
            model, strategy="dp_kfac", factor_method=method, weight_sharing=sharing
        )
        x = torch.randn(4, 3, 10, 8, dtype=torch.float64)
        y = torch.randint(0, 4, (4,))
        F.cross_entropy(model(x), y).backward()
        pre.step()
        factors[method] = {n: (la.a_factor, la.g_factor) for n, la in pre.layers.items()}
    assert len(factors["unfold"]) == 5
    for method in ("auto",):
        for name, (a_ref, g_ref) in factors["unfold"].items():
            a, g = factors[method][name]
            assert rel(a, a_ref) <= TOL, (method, name)
            assert rel(g, g_ref) <= TOL, (method, name)
