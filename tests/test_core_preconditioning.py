"""Preconditioned gradients of KFACPreconditioner against dense Kronecker solves (float64).

The gradient matrix ``∇W`` is (d_out, d_in[+1]) row-major with the bias as
last column, so ``vec(∇W) = ∇W.reshape(-1)`` and, A and G being symmetric,
``(G ⊗ A) vec(X) = vec(G X A)``. The references:

* eigen: ``V = (G ⊗ A + γ I)⁻¹ vec(∇W)`` by ``torch.linalg.solve`` on the dense
  ``torch.kron`` matrix;
* inverse: ``V = (G + √γ I)⁻¹ ∇W (A + √γ I)⁻¹``;
* kl_clip: ``ν = min(1, sqrt(kl_clip / |Σ_l lr² ⟨V_l, ∇W_l⟩|))``, update ``ν·V``.

A and G come from the dense per-sample references of ``test_core_factors``;
``∇W`` from a plain backward pass of a hook-free twin model.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator

import pytest
import torch
from test_core_factors import CASES, assert_rel_close, dense_factors
from torch import nn

import dpkfac

TOL = 1e-10
MAX_REL_ERR: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_errors(single_thread: None) -> Iterator[None]:
    """Single-threaded (see conftest); prints the largest errors after the module."""
    yield
    for key, err in sorted(MAX_REL_ERR.items()):
        print(f"[max rel err] {key}: {err:.3e}")


def check(key: str, actual: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> float:
    return assert_rel_close(key, actual, ref, tol=tol, table=MAX_REL_ERR)


def grad_matrix(layer: nn.Module) -> torch.Tensor:
    """The contract's (d_out, d_in[+1]) gradient matrix, bias gradient last."""
    g = layer.weight.grad.reshape(layer.weight.shape[0], -1)
    if layer.bias is not None:
        g = torch.cat([g, layer.bias.grad.reshape(-1, 1)], dim=1)
    return g.clone()


def kron_solve(g_f: torch.Tensor, a_f: torch.Tensor, grad: torch.Tensor, damping: float):
    """``(G ⊗ A + γ I)⁻¹ vec(∇W)`` on the dense matrix, in the row-major vec convention."""
    m = torch.kron(g_f, a_f) + damping * torch.eye(grad.numel(), dtype=grad.dtype)
    return torch.linalg.solve(m, grad.reshape(-1)).reshape(grad.shape)


def inverse_ref(g_f: torch.Tensor, a_f: torch.Tensor, grad: torch.Tensor, damping: float):
    s = math.sqrt(damping)
    g_inv = torch.linalg.inv(g_f + s * torch.eye(g_f.shape[0], dtype=g_f.dtype))
    a_inv = torch.linalg.inv(a_f + s * torch.eye(a_f.shape[0], dtype=a_f.dtype))
    return g_inv @ grad @ a_inv


REFERENCE = {"eigen": kron_solve, "inverse": inverse_ref}


def reference_updates(model, x, y, loss_fn, method, damping, sharing="expand"):
    """(V_l, ∇W_l) per K-FAC layer from a hook-free copy of ``model``."""
    twin = copy.deepcopy(model)
    refs = dense_factors(twin, x, y, loss_fn, sharing)
    twin.zero_grad()
    loss_fn(twin(x), y).mean().backward()
    out = {}
    for name, (a_f, g_f) in refs.items():
        grad = grad_matrix(twin[int(name)])
        out[name] = (REFERENCE[method](g_f, a_f, grad, damping), grad)
    return out


def step_once(model, x, y, loss_fn, **kwargs) -> dpkfac.KFACPreconditioner:
    pre = dpkfac.KFACPreconditioner(model, **kwargs)
    model.zero_grad()
    loss_fn(model(x), y).mean().backward()
    pre.step()
    return pre


PRECOND_CASES = ["linear_2d", "linear_3d", "conv_s2_p1_d2_bias", "conv_s2_p1_d2_nobias"]


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("case", PRECOND_CASES)
def test_preconditioned_gradient_matches_dense_solve(case: str, method: str, sharing: str):
    model, x, y, loss_fn = CASES[case]()
    damping = 0.02
    ref = reference_updates(model, x, y, loss_fn, method, damping, sharing)
    step_once(
        model,
        x,
        y,
        loss_fn,
        compute_method=method,
        damping=damping,
        kl_clip=None,
        weight_sharing=sharing,
    )
    for name, (v_ref, grad) in ref.items():
        actual = grad_matrix(model[int(name)])
        check(f"precond {method}", actual, v_ref)
        # Preconditioning did something (not the identity up to scale).
        assert (actual - grad).norm() > 1e-3 * grad.norm()


def test_eigen_and_inverse_differ() -> None:
    """The two methods damp differently; equal outputs would mean one ignores damping."""
    model, x, y, loss_fn = CASES["linear_2d"]()
    eig = reference_updates(model, x, y, loss_fn, "eigen", 0.05)
    inv = reference_updates(model, x, y, loss_fn, "inverse", 0.05)
    assert any((eig[n][0] - inv[n][0]).norm() > 1e-3 * eig[n][0].norm() for n in eig)


@pytest.mark.parametrize("nu_target", [0.5, 2.0], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_kl_clip_scales_every_layer(method: str, nu_target: float) -> None:
    model, x, y, loss_fn = CASES["conv_s2_p1_d2_bias"]()
    damping, lr = 0.01, 0.3
    ref = reference_updates(model, x, y, loss_fn, method, damping)
    vg = sum(lr**2 * float((v * g).sum()) for v, g in ref.values())
    kl_clip = nu_target**2 * abs(vg)
    nu = min(1.0, math.sqrt(kl_clip / abs(vg)))
    assert nu == pytest.approx(min(1.0, nu_target))
    step_once(model, x, y, loss_fn, compute_method=method, damping=damping, kl_clip=kl_clip, lr=lr)
    for name, (v_ref, _) in ref.items():
        check(
            f"kl_clip nu={min(1.0, nu_target)} {method}", grad_matrix(model[int(name)]), nu * v_ref
        )


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_damping_and_lr_callables(method: str) -> None:
    """damping(step) and lr(step) are evaluated at every step with the step index."""
    model, x, y, loss_fn = CASES["linear_3d"]()
    twin = copy.deepcopy(model)
    calls: dict[str, list[int]] = {"damping": [], "lr": []}

    def damping(step: int) -> float:
        calls["damping"].append(step)
        return 0.005 * (step + 1)

    def lr(step: int) -> float:
        calls["lr"].append(step)
        return 0.05 * (step + 1)

    kl_clip = 1e-5
    pre = dpkfac.KFACPreconditioner(
        model, compute_method=method, damping=damping, lr=lr, kl_clip=kl_clip, factor_decay=0.8
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        xb = x + 0.1 * step
        twin.load_state_dict(model.state_dict())
        twin.zero_grad()
        loss_fn(twin(xb), y).mean().backward()
        opt.zero_grad()
        loss_fn(model(xb), y).mean().backward()
        pre.step()
        # A and G are the running averages (checked against dense references
        # in test_core_factors); the solve and the clip are checked here.
        d = 0.005 * (step + 1)
        ref = {}
        for name, layer in pre.layers.items():
            grad = grad_matrix(twin[int(name)])
            ref[name] = (REFERENCE[method](layer.g_factor, layer.a_factor, grad, d), grad)
        vg = sum((0.05 * (step + 1)) ** 2 * float((v * g).sum()) for v, g in ref.values())
        nu = min(1.0, math.sqrt(kl_clip / abs(vg)))
        assert nu < 1.0
        for name, (v_ref, _) in ref.items():
            check(f"callable damping/lr {method}", grad_matrix(model[int(name)]), nu * v_ref)
        opt.step()
    assert sorted(set(calls["damping"])) == [0, 1, 2]
    assert sorted(set(calls["lr"])) == [0, 1, 2]


class Mixed(nn.Module):
    """Embedding, BatchNorm and Linear layers; ``head`` is skipped by regex."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.fc1 = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).mean(dim=1)
        h = torch.relu(self.bn(self.fc1(h)))
        return self.out(torch.tanh(self.head(h)))


@pytest.mark.parametrize("skip", ["head", [r"^hea", r"nomatch\d+"]], ids=["str", "list"])
def test_skip_layers_and_unsupported_layers_keep_gradients(skip) -> None:
    torch.manual_seed(0)
    model = Mixed().double()
    tokens = torch.randint(0, 10, (6, 4))
    y = torch.randint(0, 3, (6,))
    pre = dpkfac.KFACPreconditioner(model, skip_layers=skip, damping=0.01, kl_clip=1e-4)
    assert set(pre.layers) == {"fc1", "out"}
    for _ in range(2):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(tokens), y).backward()
        before = {n: p.grad.clone() for n, p in model.named_parameters()}
        pre.step()
        for n, p in model.named_parameters():
            if n.startswith(("emb.", "bn.", "head.")):
                assert torch.equal(p.grad, before[n]), n
            else:
                assert not torch.allclose(p.grad, before[n]), n


@pytest.mark.parametrize("kl_clip", [None, 1e-4])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_strategies_agree_at_world_size_one(method: str, kl_clip: float | None) -> None:
    base, x, y, loss_fn = CASES["conv_s2_p1_d2_bias"]()
    results = {}
    for strategy in ("dp_kfac", "d_kfac", "spd_kfac"):
        model = copy.deepcopy(base)
        pre = dpkfac.KFACPreconditioner(
            model,
            strategy=strategy,
            compute_method=method,
            damping=0.01,
            kl_clip=kl_clip,
            factor_decay=0.9,
            inv_update_steps=2,
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(4):
            opt.zero_grad()
            loss_fn(model(x * (1 + 0.1 * step)), y).mean().backward()
            pre.step()
            opt.step()
        assert all(
            v == {"bytes": 0, "calls": 0, "wire_bytes": 0} for v in pre.comm_stats().values()
        )
        results[strategy] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    start = torch.cat([p.detach().reshape(-1) for p in base.parameters()])
    for strategy in ("d_kfac", "spd_kfac"):
        err = check(
            f"strategies ws=1 {method}", results[strategy] - start, results["dp_kfac"] - start, 1e-6
        )
        assert err <= 1e-6


def test_pi_damping_splits_damping_by_factor_traces() -> None:
    """Inverse method with π-damping: (G + √γ/π I)⁻¹ ∇W (A + π√γ I)⁻¹ with the stored factors."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    model = model.double()
    damping = 0.05
    pre = dpkfac.KFACPreconditioner(
        model, compute_method="inverse", pi_damping=True, damping=damping, kl_clip=None
    )
    x = torch.randn(7, 5, dtype=torch.float64)
    model(x).pow(2).mean().backward()
    raw = {n: p.grad.clone() for n, p in model.named_parameters()}
    pre.step()
    for name in ("0", "2"):
        layer = pre.layers[name]
        a, g = layer.a_factor, layer.g_factor
        pi = math.sqrt((torch.trace(a) / a.shape[0]) / (torch.trace(g) / g.shape[0]))
        grad = torch.cat([raw[f"{name}.weight"], raw[f"{name}.bias"][:, None]], dim=1)
        eye_a, eye_g = torch.eye(a.shape[0], dtype=a.dtype), torch.eye(g.shape[0], dtype=g.dtype)
        sq = math.sqrt(damping)
        ref = torch.linalg.solve(g + sq / pi * eye_g, grad) @ torch.linalg.inv(a + pi * sq * eye_a)
        got = torch.cat(
            [model.get_submodule(name).weight.grad, model.get_submodule(name).bias.grad[:, None]],
            dim=1,
        )
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-10


def test_pi_damping_requires_inverse_method() -> None:
    with pytest.raises(ValueError, match="pi_damping"):
        dpkfac.KFACPreconditioner(torch.nn.Linear(2, 2), compute_method="eigen", pi_damping=True)
