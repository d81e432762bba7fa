"""Argument checking, dtypes and numerical safety of KFACPreconditioner (world size 1).

* bad arguments raise ValueError naming the bad value;
* factor_dtype / decomposition_dtype (never half-precision decompositions);
* nn.MultiheadAttention is left alone (its projections are applied functionally,
  so none is a layer) unless split (dpkfac.split_attention); a Linear applied
  functionally by the model is registered, but its hooks never fire: one
  warning naming it, its gradient is left alone;
* a non-finite batch factor is rejected with a warning and the previous
  factor kept; eigh failures retry in float64, then keep the previous
  decomposition (or fall back to the diagonal) with a warning.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpkfac


@pytest.fixture(scope="module", autouse=True)
def _single_thread(single_thread: None) -> None:
    """Run this module with one intra-op thread (see conftest)."""


def mlp(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(dtype)


def data(dtype: torch.dtype = torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, 3, generator=gen).to(dtype), torch.randint(0, 2, (8,), generator=gen)


def run_step(model, pre, x, y, opt=None) -> None:
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    pre.step()
    if opt is not None:
        opt.step()


def runtime_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, RuntimeWarning)]


# ------------------------------------------------------------------ arguments
BAD_ARGS = [
    ({"strategy": "nope-kfac"}, "nope-kfac"),
    ({"compute_method": "cholesky"}, "cholesky"),
    ({"weight_sharing": "average"}, "average"),
    ({"damping": -0.003}, "-0.003"),
    ({"damping": float("nan")}, "nan"),
    ({"factor_decay": 1.5}, "1.5"),
    ({"factor_decay": -0.1}, "-0.1"),
    ({"kl_clip": -1}, "-1"),
    ({"lr": -0.5}, "-0.5"),
    ({"factor_update_steps": 0}, "factor_update_steps.*0"),
    ({"inv_update_steps": -2}, "inv_update_steps.*-2"),
    ({"factor_update_steps": 1.5}, "1.5"),
    ({"foo": 1}, "foo"),
    ({"grad_reduction": "nope"}, "nope"),
    ({"strategy": "spd_kfac", "fusion": "greedy"}, "greedy"),
    ({"factor_dtype": torch.int32}, "int32"),
    ({"decomposition_dtype": torch.float16}, "float16"),
    ({"decomposition_dtype": torch.bfloat16}, "bfloat16"),
]


@pytest.mark.parametrize(("kwargs", "named"), BAD_ARGS, ids=[str(k) for k, _ in BAD_ARGS])
def test_bad_arguments_raise_value_error_naming_the_value(kwargs, named) -> None:
    with pytest.raises(ValueError, match=named):
        dpkfac.KFACPreconditioner(mlp(), **kwargs)


@pytest.mark.parametrize("pattern", ["[abc", "(unclosed"])
def test_bad_skip_layers_regex_is_named(pattern: str) -> None:
    with pytest.raises(ValueError, match=re.escape(pattern)):
        dpkfac.KFACPreconditioner(mlp(), skip_layers=[r"ok\d", pattern])


def test_bad_skip_layers_regex_raises_value_error() -> None:
    with pytest.raises(ValueError, match="skip_layers"):
        dpkfac.KFACPreconditioner(mlp(), skip_layers="[abc")


def test_model_must_be_a_module() -> None:
    with pytest.raises(ValueError, match="list"):
        dpkfac.KFACPreconditioner([nn.Linear(2, 2)])


def test_callable_damping_checked_at_step() -> None:
    model = mlp()
    pre = dpkfac.KFACPreconditioner(model, damping=lambda step: -1.0)
    x, _ = data()
    model(x).sum().backward()
    with pytest.raises(ValueError, match=r"-1\.0"):
        pre.step()


# --------------------------------------------------------------------- dtypes
def test_bfloat16_factors() -> None:
    x, y = data(torch.float32)
    model, ref_model = mlp(torch.float32), mlp(torch.float32)
    pre = dpkfac.KFACPreconditioner(model, factor_dtype=torch.bfloat16, kl_clip=None)
    ref = dpkfac.KFACPreconditioner(ref_model, kl_clip=None)
    run_step(model, pre, x, y)
    run_step(ref_model, ref, x, y)
    for name, layer in pre.layers.items():
        assert layer.a_factor.dtype == torch.bfloat16
        assert layer.g_factor.dtype == torch.bfloat16
        for t in (*layer.decomposition("A").tensors(), *layer.decomposition("G").tensors()):
            assert t.dtype == torch.float32  # never decomposed in half precision
        other = ref.layers[name]
        for mine, full in ((layer.a_factor, other.a_factor), (layer.g_factor, other.g_factor)):
            assert float((mine.float() - full).norm() / full.norm()) < 2e-2
    for p in model.parameters():
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()


@pytest.mark.parametrize(
    ("model_dtype", "decomposition_dtype", "expected"),
    [
        (torch.float32, None, torch.float32),
        (torch.float64, None, torch.float64),
        (torch.float32, torch.float64, torch.float64),
    ],
)
def test_decomposition_dtypes(model_dtype, decomposition_dtype, expected) -> None:
    model = mlp(model_dtype)
    kwargs = {} if decomposition_dtype is None else {"decomposition_dtype": decomposition_dtype}
    for method in ("eigen", "inverse"):
        pre = dpkfac.KFACPreconditioner(model, compute_method=method, **kwargs)
        run_step(model, pre, *data(model_dtype))
        for layer in pre.layers.values():
            assert layer.a_factor.dtype == model_dtype
            for t in (*layer.decomposition("A").tensors(), *layer.decomposition("G").tensors()):
                assert t.dtype == expected, (method, t.dtype)
        for p in model.parameters():
            assert p.grad.dtype == model_dtype


# ------------------------------------------------------- MultiheadAttention
class AttnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h, _ = self.attn(h, h, h)
        return self.head(h.mean(dim=1))


class FunctionalNet(nn.Module):
    """The middle Linear is applied with F.linear: registered, but its hooks never fire."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(F.linear(self.embed(x), self.mix.weight, self.mix.bias))
        return self.head(h.mean(dim=1))


def _three_steps(
    model: nn.Module, pre: dpkfac.KFACPreconditioner, left_alone: str | None
) -> list[str]:
    """Three steps; parameters whose names start with ``left_alone`` keep their gradient, the
    others are preconditioned. Returns the runtime warnings."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            x = torch.randn(4, 5, 4, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 3, (4,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            before = {n: p.grad.clone() for n, p in model.named_parameters()}
            pre.step()
            for n, p in model.named_parameters():
                if left_alone is not None and n.startswith(left_alone):
                    assert torch.equal(p.grad, before[n]), n
                else:
                    assert not torch.allclose(p.grad, before[n]), n
            opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return runtime_warnings(record)


def test_multihead_attention_is_left_alone_without_a_warning() -> None:
    torch.manual_seed(0)
    model = AttnNet().double()
    pre = dpkfac.KFACPreconditioner(model, damping=0.01, kl_clip=None)
    assert set(pre.layers) == {"embed", "head"}  # out_proj is called functionally
    assert _three_steps(model, pre, "attn.") == []


def test_split_multihead_attention_is_preconditioned() -> None:
    torch.manual_seed(0)
    model = dpkfac.split_attention(AttnNet().double())
    pre = dpkfac.KFACPreconditioner(model, damping=0.01, kl_clip=None)
    projections = {f"attn.{p}_proj" for p in "qkv"} | {"attn.out_proj"}
    assert set(pre.layers) == {"embed", "head"} | projections
    assert _three_steps(model, pre, None) == []


def test_functionally_called_linear_warns_once_and_keeps_gradient() -> None:
    torch.manual_seed(0)
    model = FunctionalNet().double()
    pre = dpkfac.KFACPreconditioner(model, damping=0.01, kl_clip=None)
    assert set(pre.layers) == {"embed", "mix", "head"}
    messages = _three_steps(model, pre, "mix.")
    assert len(messages) == 1, messages
    assert "'mix'" in messages[0]
    assert pre.layers["mix"].a_factor is None


def test_warnings_of_step_point_at_the_callers_line() -> None:
    """step() runs under torch.no_grad's wrapper: the stack level counts that frame too."""
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).double()
    model[1].requires_grad_(False)
    pre = dpkfac.KFACPreconditioner(model, kl_clip=None)
    model[1].requires_grad_(True)  # unfrozen after construction: averaged, with a warning
    x, y = data()
    F.cross_entropy(model(x), y).backward()
    with pytest.warns(RuntimeWarning, match="were frozen when the preconditioner") as record:
        pre.step()
    assert [w.filename for w in record] == [__file__]


# -------------------------------------------------------- numerical safety
def test_non_finite_factor_is_rejected() -> None:
    """An input of 1e200 overflows aᵀa to inf while the loss and gradients stay finite.

    tanh saturates exactly, so the huge sample contributes zero gradient; only the
    first layer's A factor becomes non-finite.
    """
    model = mlp()
    pre = dpkfac.KFACPreconditioner(model, damping=0.01, factor_decay=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()
    run_step(model, pre, x, y, opt)
    first = {n: (x_.a_factor.clone(), x_.g_factor.clone()) for n, x_ in pre.layers.items()}

    x_bad = x.clone()
    x_bad[0, 0] = 1e200
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run_step(model, pre, x_bad, y, opt)
    messages = runtime_warnings(record)
    assert len(messages) == 1, messages
    assert "A factor" in messages[0] and "'0'" in messages[0]
    layer0, layer2 = pre.layers["0"], pre.layers["2"]
    assert torch.equal(layer0.a_factor, first["0"][0])  # rejected: previous kept
    assert not torch.equal(layer0.g_factor, first["0"][1])  # G was finite: updated
    assert not torch.equal(layer2.a_factor, first["2"][0])
    for layer in pre.layers.values():
        for t in (
            layer.a_factor,
            layer.g_factor,
            *layer.decomposition("A").tensors(),
            *layer.decomposition("G").tensors(),
        ):
            assert torch.isfinite(t).all()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    run_step(model, pre, x, y, opt)  # and training goes on normally
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _failing_eigh(monkeypatch, fail_times: int | None) -> list[torch.dtype]:
    """Make torch.linalg.eigh raise LinAlgError ``fail_times`` times (None: always)."""
    original = torch.linalg.eigh
    calls: list[torch.dtype] = []

    def eigh(a, *args, **kwargs):
        calls.append(a.dtype)
        if fail_times is None or len(calls) <= fail_times:
            raise torch.linalg.LinAlgError("injected eigh failure")
        return original(a, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    return calls


def test_eigh_failure_retries_in_float64(monkeypatch) -> None:
    model = mlp(torch.float32)
    pre = dpkfac.KFACPreconditioner(model, damping=0.01)
    calls = _failing_eigh(monkeypatch, fail_times=1)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run_step(model, pre, *data(torch.float32))
    assert runtime_warnings(record) == []
    assert calls[:2] == [torch.float32, torch.float64]  # the retry ran in float64
    for layer in pre.layers.values():
        for factor, dec in (
            (layer.a_factor, layer.decomposition("A")),
            (layer.g_factor, layer.decomposition("G")),
        ):
            assert dec.q.dtype == torch.float32
            rebuilt = dec.q @ torch.diag(dec.d) @ dec.q.t()
            torch.testing.assert_close(rebuilt, factor, rtol=1e-4, atol=1e-5)


def test_eigh_failure_keeps_previous_decomposition(monkeypatch) -> None:
    model = mlp()
    pre = dpkfac.KFACPreconditioner(model, damping=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()
    run_step(model, pre, x, y, opt)
    previous = {n: (x_.decomposition("A"), x_.decomposition("G")) for n, x_ in pre.layers.items()}
    _failing_eigh(monkeypatch, fail_times=None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run_step(model, pre, x, y, opt)
    messages = runtime_warnings(record)
    assert len(messages) == 2 * len(pre.layers), messages
    assert all("keeping the previous decomposition" in m for m in messages)
    for name, layer in pre.layers.items():
        assert layer.decomposition("A") is previous[name][0]
        assert layer.decomposition("G") is previous[name][1]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_eigh_failure_without_previous_uses_diagonal(monkeypatch) -> None:
    model = mlp()
    pre = dpkfac.KFACPreconditioner(model, damping=0.01)
    _failing_eigh(monkeypatch, fail_times=None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        run_step(model, pre, *data())
    messages = runtime_warnings(record)
    assert len(messages) == 2 * len(pre.layers)
    assert all("using its diagonal" in m for m in messages)
    for layer in pre.layers.values():
        torch.testing.assert_close(layer.decomposition("A").d, layer.a_factor.diagonal())
        assert torch.equal(layer.decomposition("A").q, torch.eye(layer.a_factor.shape[0]).double())
    for p in model.parameters():
        assert torch.isfinite(p.grad).all()


def test_eval_mode_forward_during_training_is_named_in_the_warning() -> None:
    """A model left in eval mode (as from_pretrained returns it) is never captured: say why."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2)).double().eval()
    pre = dpkfac.KFACPreconditioner(model, kl_clip=None)
    model(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    with pytest.warns(RuntimeWarning, match=r"eval mode.*model\.train\(\)"):
        pre.step()
    assert pre.layers["0"].a_factor is None
