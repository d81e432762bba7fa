"""Kronecker factors of KFACPreconditioner against exact dense references (float64).

The references are built here, independently of ``dpkfac.curvature``:

* ``a``: the layer input of every sample, or for Conv2d the im2col patches
  gathered by explicit loops from an explicitly padded input (every padding
  mode re-implemented by index arithmetic), checked against the layer's own
  forward pass;
* ``g``: per-example loss gradients w.r.t. the layer output, one autograd
  call per sample, on a hook-free twin of the model.

The design contract then gives, with T positions and N samples,
expand: ``A = aᵀa/(N·T)``, ``G = gᵀg/N``; reduce: ``A = āᵀā/N`` with ``ā``
averaged over positions, ``G = ĝᵀĝ/N`` with ``ĝ`` summed over positions; a
column of ones is appended to ``a`` (after averaging) when there is a bias.

The helpers of this module are reused by ``test_core_preconditioning.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpkfac

TOL = 1e-10
#: Largest relative error seen per check (printed at module teardown, ``-s``).
MAX_REL_ERR: dict[str, float] = {}

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def rel_err(actual: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error, in float64."""
    actual, ref = actual.double(), ref.double()
    return float((actual - ref).norm() / ref.norm().clamp_min(1e-300))


def assert_rel_close(
    key: str, actual: torch.Tensor, ref: torch.Tensor, tol: float = TOL, table=MAX_REL_ERR
) -> float:
    """Assert ``‖actual - ref‖ / ‖ref‖ <= tol`` and record the error under ``key``."""
    assert actual.shape == ref.shape, (key, actual.shape, ref.shape)
    err = rel_err(actual, ref)
    table[key] = max(table.get(key, 0.0), err)
    assert err <= tol, f"{key}: relative error {err:.3e} > {tol:.1e}"
    return err


@pytest.fixture(scope="module", autouse=True)
def _report_errors(single_thread: None) -> Iterator[None]:
    """Single-threaded (see conftest); prints the largest errors after the module."""
    yield
    for key, err in sorted(MAX_REL_ERR.items()):
        print(f"[max rel err] {key}: {err:.3e}")


# ----------------------------------------------------------------- references
def _source_index(i: int, size: int, mode: str) -> int | None:
    """Index of the input element that padded coordinate ``i`` copies (None: zero)."""
    if 0 <= i < size:
        return i
    if mode == "zeros":
        return None
    if mode == "reflect":
        return -i if i < 0 else 2 * (size - 1) - i
    if mode == "replicate":
        return min(max(i, 0), size - 1)
    if mode == "circular":
        return i % size
    raise AssertionError(mode)


def conv_pads(conv: nn.Conv2d) -> list[tuple[int, int]]:
    """(before, after) padding per spatial dim; 'same' puts the odd element after."""
    if conv.padding == "valid":
        return [(0, 0), (0, 0)]
    if conv.padding == "same":
        pads = []
        for k, d in zip(conv.kernel_size, conv.dilation, strict=True):
            total = d * (k - 1)
            pads.append((total // 2, total - total // 2))
        return pads
    return [(p, p) for p in conv.padding]


def pad_explicit(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Pad (N, C, H, W) by index arithmetic for the conv's padding and padding_mode."""
    (top, bottom), (left, right) = conv_pads(conv)
    n, c, h, w = x.shape
    out = x.new_zeros(n, c, h + top + bottom, w + left + right)
    for i in range(out.shape[2]):
        si = _source_index(i - top, h, conv.padding_mode)
        if si is None:
            continue
        for j in range(out.shape[3]):
            sj = _source_index(j - left, w, conv.padding_mode)
            if sj is not None:
                out[:, :, i, j] = x[:, :, si, sj]
    return out


def im2col(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """(N, T, C·kh·kw) patches gathered position by position from the padded input."""
    xp = pad_explicit(conv, x)
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel_size, conv.stride, conv.dilation
    ho = (xp.shape[2] - dh * (kh - 1) - 1) // sh + 1
    wo = (xp.shape[3] - dw * (kw - 1) - 1) // sw + 1
    rows = []
    for oh in range(ho):
        for ow in range(wo):
            ii = [oh * sh + r * dh for r in range(kh)]
            jj = [ow * sw + s * dw for s in range(kw)]
            patch = xp[:, :, ii][:, :, :, jj]  # (N, C, kh, kw): the weight's layout
            rows.append(patch.reshape(x.shape[0], -1))
    patches = torch.stack(rows, dim=1)
    # Self-check: the patches reproduce the layer's own forward pass.
    out = patches @ conv.weight.reshape(conv.out_channels, -1).t()
    if conv.bias is not None:
        out = out + conv.bias
    expected = conv(x).reshape(x.shape[0], conv.out_channels, -1).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    return patches


def layer_rows(layer: nn.Module, inp: torch.Tensor, grad_out: torch.Tensor):
    """(N, T, d_in) inputs/patches and (N, T, d_out) output gradients of one layer."""
    if isinstance(layer, nn.Conv2d):
        n = inp.shape[0]
        g = grad_out.reshape(n, layer.out_channels, -1).transpose(1, 2)
        return im2col(layer, inp), g
    n = inp.shape[0]
    return inp.reshape(n, -1, inp.shape[-1]), grad_out.reshape(n, -1, grad_out.shape[-1])


def factors_from_rows(
    a: torch.Tensor, g: torch.Tensor, has_bias: bool, sharing: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's A and G from (N, T, d_in) ``a`` and per-example (N, T, d_out) ``g``."""
    n, t, _ = a.shape
    if sharing == "expand":
        rows = a.reshape(n * t, -1)
        if has_bias:
            rows = torch.cat([rows, torch.ones(n * t, 1, dtype=a.dtype)], dim=1)
        big_a = rows.t() @ rows / (n * t)
        grows = g.reshape(n * t, -1)
        big_g = grows.t() @ grows / n
    else:
        abar = a.mean(dim=1)
        if has_bias:
            abar = torch.cat([abar, torch.ones(n, 1, dtype=a.dtype)], dim=1)
        big_a = abar.t() @ abar / n
        ghat = g.sum(dim=1)
        big_g = ghat.t() @ ghat / n
    return big_a, big_g


def kfac_children(model: nn.Sequential) -> list[int]:
    return [i for i, m in enumerate(model) if isinstance(m, (nn.Linear, nn.Conv2d))]


def dense_factors(
    model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, sharing: str
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Reference (A, G) of every Linear/Conv2d child of a hook-free Sequential.

    ``loss_fn(out, target)`` returns per-sample losses; the training loss is their mean.
    Each sample's output gradient is one autograd call on that sample alone; the
    suffix runs on a clone, so an in-place activation after the layer cannot
    alter the tensor whose gradient is taken (the pre-activation gradient).
    """
    refs = {}
    for k in kfac_children(model):
        layer = model[k]
        a_list, g_list = [], []
        for i in range(x.shape[0]):
            with torch.no_grad():
                inp = model[:k](x[i : i + 1])
            out = layer(inp)
            loss = loss_fn(model[k + 1 :](out.clone()), y[i : i + 1]).sum()
            (grad_out,) = torch.autograd.grad(loss, out)
            a, g = layer_rows(layer, inp, grad_out)
            a_list.append(a)
            g_list.append(g)
        refs[str(k)] = factors_from_rows(
            torch.cat(a_list), torch.cat(g_list), layer.bias is not None, sharing
        )
    return refs


def mse_per_sample(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((out - y) ** 2).flatten(1).sum(dim=1)


def ce_per_sample(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="none")


def conv_net(conv: nn.Conv2d, x: torch.Tensor, classes: int = 3, inplace: bool = False):
    with torch.no_grad():
        feat = conv(x[:1]).numel()
    act = nn.ReLU(inplace=True) if inplace else nn.Tanh()
    return nn.Sequential(conv, act, nn.Flatten(), nn.Linear(feat, classes)).double()


# --------------------------------------------------------------------- cases
def linear_2d():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3, bias=False)).double()
    x = torch.randn(6, 5, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (6,)), ce_per_sample


def linear_3d():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x = torch.randn(3, 4, 5, dtype=torch.float64)  # (N, T, d): T = 4 positions
    return model, x, torch.randn(3, 4, 3, dtype=torch.float64), mse_per_sample


def linear_4d():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(3, 2, 3, 3, dtype=torch.float64)  # T = 2·3 positions
    return model, x, torch.randn(3, 2, 3, 2, dtype=torch.float64), mse_per_sample


def _conv_case(seed: int, shape: tuple[int, ...], **conv_kwargs):
    def make():
        torch.manual_seed(seed)
        x = torch.randn(*shape, dtype=torch.float64)
        conv = nn.Conv2d(shape[1], 3, **conv_kwargs).double()
        return conv_net(conv, x), x, torch.randint(0, 3, (shape[0],)), ce_per_sample

    return make


CASES = {
    "linear_2d": linear_2d,
    "linear_3d": linear_3d,
    "linear_4d": linear_4d,
    "conv_s2_p1_d2_bias": _conv_case(
        3, (3, 2, 9, 8), kernel_size=3, stride=2, padding=1, dilation=2
    ),
    "conv_s2_p1_d2_nobias": _conv_case(
        4, (3, 2, 9, 8), kernel_size=3, stride=2, padding=1, dilation=2, bias=False
    ),
    "conv_rect_kernel_stride": _conv_case(
        5, (2, 2, 7, 9), kernel_size=(2, 3), stride=(2, 1), padding=(0, 2), dilation=(1, 2)
    ),
    "conv_same_asymmetric": _conv_case(
        6, (2, 2, 6, 5), kernel_size=(2, 3), padding="same", dilation=(1, 2)
    ),
    "conv_reflect": _conv_case(
        7, (2, 2, 7, 7), kernel_size=3, stride=2, padding=(1, 2), padding_mode="reflect"
    ),
    "conv_circular_dilated": _conv_case(
        8, (2, 2, 6, 6), kernel_size=2, stride=1, padding=1, dilation=2, padding_mode="circular"
    ),
    "conv_same_replicate": _conv_case(
        9, (2, 2, 5, 5), kernel_size=3, padding="same", dilation=2, padding_mode="replicate"
    ),
}


def one_step(model, x, y, loss_fn, **kwargs) -> dpkfac.KFACPreconditioner:
    pre = dpkfac.KFACPreconditioner(model, kl_clip=None, **kwargs)
    loss_fn(model(x), y).mean().backward()
    pre.step()
    return pre


@pytest.mark.filterwarnings("ignore:Using padding='same':UserWarning")
@pytest.mark.parametrize("sharing", ["expand", "reduce"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_factors_match_dense_reference(case: str, sharing: str) -> None:
    model, x, y, loss_fn = CASES[case]()
    refs = dense_factors(copy.deepcopy(model), x, y, loss_fn, sharing)
    pre = one_step(model, x, y, loss_fn, weight_sharing=sharing, factor_decay=0.5)
    assert set(pre.layers) == set(refs)
    for name, (ref_a, ref_g) in refs.items():
        layer = pre.layers[name]
        assert layer.a_factor.dtype == torch.float64
        assert layer.g_factor.dtype == torch.float64
        assert_rel_close(f"A {sharing}", layer.a_factor, ref_a)
        assert_rel_close(f"G {sharing}", layer.g_factor, ref_g)


def test_expand_and_reduce_agree_without_positions() -> None:
    """With T = 1 the two weight-sharing modes are the same factors."""
    model, x, y, loss_fn = linear_2d()
    twin = copy.deepcopy(model)
    pre_e = one_step(model, x, y, loss_fn, weight_sharing="expand")
    pre_r = one_step(twin, x, y, loss_fn, weight_sharing="reduce")
    for name in pre_e.layers:
        torch.testing.assert_close(pre_e.layers[name].a_factor, pre_r.layers[name].a_factor)
        torch.testing.assert_close(pre_e.layers[name].g_factor, pre_r.layers[name].g_factor)


@pytest.mark.parametrize("decay", [0.7, lambda step: (0.2, 0.5, 0.9)[step]], ids=["const", "fn"])
@pytest.mark.parametrize("case", ["linear_3d", "conv_s2_p1_d2_bias"])
def test_running_average_over_three_steps(case: str, decay) -> None:
    model, x, y, loss_fn = CASES[case]()
    twin = copy.deepcopy(model)
    pre = dpkfac.KFACPreconditioner(model, kl_clip=None, factor_decay=decay, damping=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    expected: dict[str, list[torch.Tensor]] = {}
    for step in range(3):
        xb = x * (1.0 + 0.3 * step)  # a different batch each step
        twin.load_state_dict(model.state_dict())
        batch = dense_factors(twin, xb, y, loss_fn, "expand")
        d = decay(step) if callable(decay) else decay
        for name, (ba, bg) in batch.items():
            if step == 0:
                expected[name] = [ba, bg]  # the first update stores the batch factor
            else:
                expected[name] = [
                    d * expected[name][0] + (1 - d) * ba,
                    d * expected[name][1] + (1 - d) * bg,
                ]
        opt.zero_grad()
        loss_fn(model(xb), y).mean().backward()
        pre.step()
        opt.step()
        for name, (ea, eg) in expected.items():
            assert_rel_close("running average A", pre.layers[name].a_factor, ea)
            assert_rel_close("running average G", pre.layers[name].g_factor, eg)


def post_relu_g(model: nn.Sequential, k: int, x: torch.Tensor, y: torch.Tensor, sharing: str):
    """G built (wrongly) from the gradient w.r.t. the ReLU output after child ``k``."""
    rows = []
    for i in range(x.shape[0]):
        with torch.no_grad():
            r = torch.relu(model[: k + 1](x[i : i + 1]))
        r.requires_grad_(True)
        loss = ce_per_sample(model[k + 2 :](r), y[i : i + 1]).sum()
        (grad_r,) = torch.autograd.grad(loss, r)
        rows.append(grad_r.reshape(1, grad_r.shape[1], -1).transpose(1, 2))
    g = torch.cat(rows)
    g = g.reshape(-1, g.shape[-1]) if sharing == "expand" else g.sum(dim=1)
    return g.t() @ g / x.shape[0]


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
def test_inplace_relu_after_layers(sharing: str) -> None:
    """G is the gradient w.r.t. the layer's (pre-ReLU) output despite ReLU(inplace=True)."""
    torch.manual_seed(10)
    x = torch.randn(4, 2, 7, 7, dtype=torch.float64)
    conv = nn.Conv2d(2, 3, 3, stride=2, padding=1).double()
    with torch.no_grad():
        feat = conv(x[:1]).numel()
    model = nn.Sequential(
        conv,
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(feat, 5),
        nn.ReLU(inplace=True),
        nn.Linear(5, 3),
    ).double()
    y = torch.randint(0, 3, (4,))
    twin = copy.deepcopy(model)
    refs = dense_factors(twin, x, y, ce_per_sample, sharing)
    wrong = {str(k): post_relu_g(twin, k, x, y, sharing) for k in (0, 3)}
    pre = one_step(model, x, y, ce_per_sample, weight_sharing=sharing)
    assert set(pre.layers) == {"0", "3", "5"}
    for name, (ref_a, ref_g) in refs.items():
        assert_rel_close(f"inplace-relu A {sharing}", pre.layers[name].a_factor, ref_a)
        assert_rel_close(f"inplace-relu G {sharing}", pre.layers[name].g_factor, ref_g)
    # The post-ReLU gradient gives a clearly different G, so the check above
    # really tells the two apart.
    for name, g_wrong in wrong.items():
        assert rel_err(pre.layers[name].g_factor, g_wrong) > 1e-2
    for p in model.parameters():
        assert torch.isfinite(p.grad).all()
