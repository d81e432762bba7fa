"""Update schedules, checkpoints and the inspection API of KFACPreconditioner (world size 1).

* factor_update_steps / inv_update_steps (ints and callables of the step):
  hooks capture only on factor steps, factors change only then, and
  decompositions are recomputed only on inverse steps and reused (the very
  same tensors) in between;
* state_dict round trip mid-run resumes bitwise-identically;
* comm_stats / timings / memory_usage at world size 1.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpkfac
from dpkfac.curvature import KFACLayer

PHASES = {
    "factor_compute",
    "factor_comm",
    "decomposition",
    "decomposition_comm",
    "precondition",
    "precond_comm",
    "grad_comm",
    "comm_sync",
}
CATEGORIES = {"grad_allreduce", "factor_allreduce", "decomposition_broadcast", "precond_broadcast"}


@pytest.fixture(scope="module", autouse=True)
def _single_thread(single_thread: None) -> None:
    """Run this module with one intra-op thread (see conftest)."""


def make_net(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 6),
        nn.Tanh(),
        nn.Linear(6, 4, bias=False),
    ).to(dtype)


def batch(step: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(5, 2, 8, 8, generator=gen).to(dtype)
    return x, torch.randint(0, 4, (5,), generator=gen)


def train_step(model, pre, opt, step: int) -> None:
    x, y = batch(step, next(model.parameters()).dtype)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    pre.step()
    opt.step()


def decomp_tensors(layer: KFACLayer) -> list[torch.Tensor]:
    return [*layer.decomposition("A").tensors(), *layer.decomposition("G").tensors()]


@pytest.fixture
def capture_spy(monkeypatch) -> list[tuple[str, str]]:
    """Record every accumulate_a / accumulate_g call as (factor, layer name)."""
    calls: list[tuple[str, str]] = []
    for which, attr in (("A", "accumulate_a"), ("G", "accumulate_g")):
        original = getattr(KFACLayer, attr)

        def spy(self, *args, _orig=original, _which=which, **kwargs):
            calls.append((_which, self.name))
            return _orig(self, *args, **kwargs)

        monkeypatch.setattr(KFACLayer, attr, spy)
    return calls


SCHEDULES = {
    # name: (factor_update_steps, inv_update_steps, factor steps, inverse steps) over 8 steps
    "ints": (2, 3, {0, 2, 4, 6}, {0, 3, 6}),
    "callables": (
        lambda s: 1 if s < 3 else 4,
        lambda s: 2 if s < 4 else 3,
        {0, 1, 2, 4},
        {0, 2, 6},
    ),
}


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_update_intervals(schedule: str, method: str, capture_spy) -> None:
    factor_steps, inv_steps, expect_factor, expect_inv = SCHEDULES[schedule]
    model = make_net()
    pre = dpkfac.KFACPreconditioner(
        model,
        compute_method=method,
        factor_update_steps=factor_steps,
        inv_update_steps=inv_steps,
        factor_decay=0.9,
        damping=0.01,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prev_factors: dict[str, list[torch.Tensor]] = {}
    prev_decomps: dict[str, list[torch.Tensor]] = {}
    for step in range(8):
        n_calls = len(capture_spy)
        train_step(model, pre, opt, step)
        new_calls = capture_spy[n_calls:]
        if step in expect_factor:
            assert sorted(new_calls) == sorted(
                (w, name) for name in pre.layers for w in ("A", "G")
            ), step
        else:
            assert new_calls == [], f"hooks captured off schedule at step {step}"
        for name, layer in pre.layers.items():
            assert not layer.has_pending("A") and not layer.has_pending("G")  # nothing left pending
            factors = [layer.a_factor, layer.g_factor]
            decomps = decomp_tensors(layer)
            if step > 0:
                changed = [
                    not torch.equal(f, p) for f, p in zip(factors, prev_factors[name], strict=True)
                ]
                assert changed == [step in expect_factor] * 2, (step, name)
                same_objects = all(a is b for a, b in zip(decomps, prev_decomps[name], strict=True))
                if step in expect_inv:
                    assert not same_objects, (step, name)
                else:
                    assert same_objects, f"decomposition recomputed off schedule at {step}"
                    for a, b in zip(decomps, prev_decomps[name], strict=True):
                        assert torch.equal(a, b)
            if step in expect_inv:
                # Recomputed from the current running averages.
                for factor, dec in (
                    (layer.a_factor, layer.decomposition("A")),
                    (layer.g_factor, layer.decomposition("G")),
                ):
                    eye = torch.eye(factor.shape[0], dtype=factor.dtype)
                    if method == "eigen":
                        rebuilt = dec.q @ torch.diag(dec.d) @ dec.q.t()
                        torch.testing.assert_close(rebuilt, factor, rtol=1e-9, atol=1e-12)
                    else:
                        torch.testing.assert_close(
                            dec.inv @ (factor + 0.1 * eye), eye, rtol=1e-9, atol=1e-9
                        )
            prev_factors[name] = [f.clone() for f in factors]
            prev_decomps[name] = decomps


def test_eval_mode_and_no_grad_do_not_capture(capture_spy) -> None:
    model = make_net()
    pre = dpkfac.KFACPreconditioner(model)
    x, _ = batch(0)
    with torch.no_grad():
        model(x)
    model.eval()
    model(x)
    assert capture_spy == []
    assert all(not layer.has_pending("A") for layer in pre.layers.values())


# --------------------------------------------------------------------- state
def build(seed: int, strategy: str, method: str):
    model = make_net(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pre = dpkfac.KFACPreconditioner(
        model,
        strategy=strategy,
        compute_method=method,
        factor_update_steps=2,
        inv_update_steps=3,
        factor_decay=0.8,
        damping=0.01,
        kl_clip=0.01,
        lr=0.05,
    )
    return model, opt, pre


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("strategy", ["dp_kfac", "d_kfac", "spd_kfac"])
def test_state_dict_round_trip_resumes_bitwise(strategy: str, method: str) -> None:
    model_a, opt_a, pre_a = build(0, strategy, method)
    for step in range(5):
        train_step(model_a, pre_a, opt_a, step)

    model_b, opt_b, pre_b = build(0, strategy, method)
    for step in range(2):
        train_step(model_b, pre_b, opt_b, step)
    buf = io.BytesIO()
    torch.save(
        {"model": model_b.state_dict(), "opt": opt_b.state_dict(), "pre": pre_b.state_dict()}, buf
    )
    del model_b, opt_b, pre_b
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)

    model_c, opt_c, pre_c = build(123, strategy, method)  # different init: loading must matter
    model_c.load_state_dict(ckpt["model"])
    opt_c.load_state_dict(ckpt["opt"])
    pre_c.load_state_dict(ckpt["pre"])
    assert pre_c.steps == 2
    for step in range(2, 5):
        train_step(model_c, pre_c, opt_c, step)

    for (name, p_a), p_c in zip(model_a.named_parameters(), model_c.parameters(), strict=True):
        assert torch.equal(p_a, p_c), name
    for name, layer in pre_a.layers.items():
        other = pre_c.layers[name]
        assert torch.equal(layer.a_factor, other.a_factor)
        assert torch.equal(layer.g_factor, other.g_factor)
        for t_a, t_c in zip(decomp_tensors(layer), decomp_tensors(other), strict=True):
            assert torch.equal(t_a, t_c)


def test_state_dict_is_a_copy() -> None:
    model, opt, pre = build(0, "dp_kfac", "eigen")
    train_step(model, pre, opt, 0)
    sd = pre.state_dict()
    saved = sd["layers"]["3"]["A"].clone()
    train_step(model, pre, opt, 2)
    assert torch.equal(sd["layers"]["3"]["A"], saved)


@pytest.mark.parametrize(
    ("key", "value", "kwargs"),
    [
        ("strategy", None, {"strategy": "d_kfac"}),
        ("compute_method", None, {"compute_method": "inverse"}),
        ("world_size", 2, {}),
    ],
)
def test_load_state_dict_rejects_mismatch(key: str, value, kwargs) -> None:
    model, opt, pre = build(0, "dp_kfac", "eigen")
    train_step(model, pre, opt, 0)
    sd = pre.state_dict()
    if value is not None:
        sd[key] = value
    other = dpkfac.KFACPreconditioner(make_net(), **kwargs)
    with pytest.raises(ValueError, match=key):
        other.load_state_dict(sd)


# ---------------------------------------------------------------- inspection
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_inspection_api_at_world_size_one(method: str, dtype: torch.dtype) -> None:
    model = make_net(dtype=dtype)
    pre = dpkfac.KFACPreconditioner(model, compute_method=method)
    assert pre.memory_usage() == {"factors_bytes": 0, "decompositions_bytes": 0, "buffers_bytes": 0}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        train_step(model, pre, opt, step)

    stats = pre.comm_stats()
    assert set(stats) == CATEGORIES
    assert all(v == {"bytes": 0, "calls": 0, "wire_bytes": 0} for v in stats.values())

    times = pre.timings()
    assert set(times) == PHASES
    assert all(isinstance(v, float) and v >= 0.0 for v in times.values())
    for phase in ("factor_compute", "decomposition", "precondition"):
        assert times[phase] > 0.0, phase

    dims = {"0": (2 * 9 + 1, 3), "3": (48 + 1, 6), "5": (6, 4)}
    assert {n: (x.helper.a_dim, x.helper.g_dim) for n, x in pre.layers.items()} == dims
    item = torch.finfo(dtype).bits // 8
    sq = sum(a * a + g * g for a, g in dims.values())
    decomp = sq + sum(a + g for a, g in dims.values()) if method == "eigen" else sq
    assert pre.memory_usage() == {
        "factors_bytes": sq * item,
        "decompositions_bytes": decomp * item,
        "buffers_bytes": sq * item,
    }

    pre.reset_stats()
    assert all(v == 0.0 for v in pre.timings().values())
    assert pre.memory_usage()["buffers_bytes"] == 0
    assert pre.memory_usage()["factors_bytes"] == sq * item


def test_repr_and_layers_expose_owner() -> None:
    model = make_net()
    pre = dpkfac.KFACPreconditioner(copy.deepcopy(model))
    assert list(pre.layers) == ["0", "3", "5"]
    assert all(layer.owner == 0 for layer in pre.layers.values())
    assert "dp_kfac" in repr(pre)
