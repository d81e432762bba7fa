"""Gradient accumulation, modules called twice per forward, and a loss scaler.

* ``accumulation_steps=k`` with the loss divided by k over k captured
  micro-batches gives the factors and the update of the whole batch at once
  (float64), on one rank and for every strategy on two.
* A module called twice in one forward (a shared layer) contributes both calls:
  A averages them like positions, G sums them, as the factor conventions do for
  positions; every strategy runs it, spd_kfac with both calls fused into one
  bucket included.
* A loss scaled by a ``GradScaler`` and unscaled before ``pre.step()`` gives the
  unscaled run's factors and update; a step the scaler skips leaves the factors
  alone.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from strategy_cases import (
    REPLICATED_VARIANTS,
    STRATEGY_VARIANTS,
    batch,
    make_model,
    make_preconditioner,
    max_rel_err,
)
from torch import nn

import dpkfac

TOL = 1e-10
STEPS = 3


def _factors(pre: dpkfac.KFACPreconditioner) -> dict[str, torch.Tensor]:
    return {
        f"{name}/{which}": state.running.clone()
        for name, layer in pre.layers.items()
        for which, state in layer.factors.items()
        if state.running is not None
    }


def _accumulated_run(rank: int, world_size: int, variant: str, micro: int) -> dict[str, Any]:
    """Three steps of two batches of 6 per rank, as one batch (micro=1) or two micro-batches."""
    model = make_model()
    pre = make_preconditioner(model, variant, kl_clip=0.01, accumulation_steps=micro)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    factors, params = [], []
    for step in range(STEPS):
        parts = [batch(10 * step + m, rank) for m in range(2)]
        opt.zero_grad()
        if micro == 1:
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            F.cross_entropy(model(x), y).backward()
        else:
            for x, y in parts:
                (F.cross_entropy(model(x), y) / micro).backward()
        pre.step()
        opt.step()
        factors.append(_factors(pre))
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"factors": factors, "params": params}


def _check_same(a: dict[str, Any], b: dict[str, Any], label: str) -> None:
    for step in range(STEPS):
        assert a["factors"][step].keys() == b["factors"][step].keys()
        assert max_rel_err(a["factors"][step], b["factors"][step]) < TOL, (label, step)
        assert max_rel_err(a["params"][step], b["params"][step]) < TOL, (label, step)


@pytest.mark.parametrize("variant", ["dp_kfac", "d_kfac", "spd_kfac"])
def test_accumulation_equals_the_whole_batch_on_one_rank(variant: str) -> None:
    whole = _accumulated_run(0, 1, variant, 1)
    _check_same(_accumulated_run(0, 1, variant, 2), whole, variant)


@pytest.mark.distributed
@pytest.mark.parametrize("variant", sorted(STRATEGY_VARIANTS))
def test_accumulation_equals_the_whole_batch_on_two_ranks(variant: str) -> None:
    whole = run_ranks(_accumulated_run, 2, variant, 1)
    accumulated = run_ranks(_accumulated_run, 2, variant, 2)
    for rank in range(2):
        _check_same(accumulated[rank], whole[rank], f"{variant} rank {rank}")


def test_undeclared_micro_batches_are_not_the_whole_batch() -> None:
    """Without ``accumulation_steps`` G is k² too small: the option is what fixes it, and
    ``step()`` says so, naming both numbers."""
    whole = _accumulated_run(0, 1, "d_kfac", 1)
    model = make_model()
    pre = make_preconditioner(model, "d_kfac")
    for x, y in [batch(0, 0), batch(1, 0)]:
        (F.cross_entropy(model(x), y) / 2).backward()
    with pytest.warns(RuntimeWarning, match=r"after 2 backward passes, but accumulation_steps=1"):
        pre.step()
    g, g_whole = pre.layers["fc1"].g_factor, whole["factors"][0]["fc1/G"]
    ratio = float(g.trace() / g_whole.trace())
    assert ratio == pytest.approx(0.5, rel=1e-9)  # summed over 2 captures, each 1/4


# ----------------------------------------------------------------- shared module
class Siamese(nn.Module):
    """One Linear applied to both halves of the input, then a head on both results."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 5)
        self.head = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left, right = torch.tanh(self.shared(x[:, 0])), torch.tanh(self.shared(x[:, 1]))
        return self.head(torch.cat([left, right], dim=1))


def _siamese(seed: int = 0) -> Siamese:
    torch.manual_seed(seed)
    return Siamese().double()


def _pair_batch(step: int, source: int, size: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + source)
    x = torch.randn(size, 2, 4, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (size,), generator=g)


def test_shared_module_factors_match_the_dense_reference() -> None:
    model = _siamese()
    pre = dpkfac.KFACPreconditioner(model, strategy="d_kfac", kl_clip=None)
    inputs, grads = [], []

    def keep_input(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        inputs.append(args[0].detach())
        output.register_hook(lambda g: grads.append(g.detach()))

    model.shared.register_forward_hook(keep_input)
    x, y = _pair_batch(0, 0)
    n = x.shape[0]
    F.cross_entropy(model(x), y).backward()
    pre.step()
    ones = torch.ones(n, 1, dtype=torch.float64)
    a_ref = sum((torch.cat([a, ones], 1).T @ torch.cat([a, ones], 1)) / n for a in inputs) / 2
    g_ref = sum((g * n).T @ (g * n) / n for g in grads)
    assert len(inputs) == len(grads) == 2
    torch.testing.assert_close(pre.layers["shared"].a_factor, a_ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(pre.layers["shared"].g_factor, g_ref, rtol=1e-12, atol=1e-14)


def _siamese_run(rank: int, world_size: int, variant: str) -> list[dict[str, torch.Tensor]]:
    model = _siamese()
    strategy, options = STRATEGY_VARIANTS[variant]
    if variant.startswith("spd_kfac"):
        # Everything in one fusion bucket, both calls of the shared layer included.
        options = {**options, "local_threshold": 0, "comm_alpha": 1.0, "comm_beta": 0.0}
    pre = dpkfac.KFACPreconditioner(model, strategy=strategy, kl_clip=0.01, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(4):
        opt.zero_grad()
        x, y = _pair_batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    if variant.startswith("spd_kfac"):
        assert any(len(bucket) > 2 for bucket in pre.strategy.fusion_plan)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("variant", sorted(STRATEGY_VARIANTS))
def test_shared_module_runs_under_every_strategy(variant: str) -> None:
    results = run_ranks(_siamese_run, 2, variant)
    for step in range(4):
        for name, t in results[0][step].items():
            assert torch.equal(t, results[1][step][name]), (variant, step, name)
    if variant in REPLICATED_VARIANTS:
        # Replicated curvature: the one-rank run on the concatenated batch.
        model = _siamese()
        pre = dpkfac.KFACPreconditioner(model, strategy="d_kfac", kl_clip=0.01)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            parts = [_pair_batch(step, r) for r in range(2)]
            opt.zero_grad()
            x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            F.cross_entropy(model(x), y).backward()
            pre.step()
            opt.step()
            ref = {n: p.detach() for n, p in model.named_parameters()}
            assert max_rel_err(results[0][step], ref) < 1e-9, (variant, step)


# ------------------------------------------------------------------- loss scaler
def _scaled_run(
    scale: float | None,
    overflow_step: int | None = None,
    dtype: torch.dtype = torch.float32,
    factor_dtype: torch.dtype | None = None,
    autocast: bool = False,
) -> dict[str, Any]:
    """dp_kfac with a GradScaler at ``scale`` (None: no scaler); factors and params per step."""
    model = make_model().to(dtype)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale or 1.0, enabled=scale is not None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = make_preconditioner(
        model, "dp_kfac", kl_clip=0.01, grad_scaler=scaler, factor_dtype=factor_dtype
    )
    factors, params = [], []
    for step in range(STEPS):
        x, y = batch(step, 0)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(x.to(dtype)), y)
        if step == overflow_step:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        pre.step()
        scaler.step(opt)
        scaler.update()
        factors.append(_factors(pre))
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"factors": factors, "params": params, "scale": scaler.get_scale()}


def test_scaled_loss_gives_the_unscaled_factors_and_update() -> None:
    plain, scaled = _scaled_run(None), _scaled_run(2.0**12)
    for step in range(STEPS):
        assert max_rel_err(scaled["factors"][step], plain["factors"][step]) < 1e-5
        assert max_rel_err(scaled["params"][step], plain["params"][step]) < 1e-5


def test_a_step_the_scaler_skips_leaves_the_factors_alone() -> None:
    run = _scaled_run(2.0**12, overflow_step=1)
    for name, factor in run["factors"][1].items():
        assert torch.equal(factor, run["factors"][0][name]), name
    for name, param in run["params"][1].items():
        assert torch.equal(param, run["params"][0][name]), name


def test_grad_scaler_across_ranks_needs_ddp() -> None:
    assert run_ranks(_scaler_without_ddp, 2) == ["DistributedDataParallel"] * 2


def _scaler_without_ddp(rank: int, world_size: int) -> str:
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="DistributedDataParallel") as err:
        dpkfac.KFACPreconditioner(make_model(), grad_scaler=scaler)
    return "DistributedDataParallel" if "DistributedDataParallel" in str(err.value) else ""


# A scaler's scale doubles every 2000 overflow-free steps: a long float32 or bf16 run
# reaches scales where s²·G overflows although s·g does not. G is built from the
# output gradient unscaled first, so the factors keep updating, equal to a run
# without a scaler (the scale is a power of two: unscaling is exact).
HUGE_SCALE = 2.0**70


@pytest.mark.parametrize(
    ("dtype", "factor_dtype", "autocast"),
    [
        (torch.float32, None, False),
        (torch.float64, torch.float32, False),
        (torch.float32, None, True),
    ],
    ids=["float32", "float64_model_float32_factors", "bf16_autocast"],
)
def test_a_huge_loss_scale_keeps_the_factors_updating(
    dtype: torch.dtype, factor_dtype: torch.dtype | None, autocast: bool
) -> None:
    plain = _scaled_run(None, None, dtype, factor_dtype, autocast)
    scaled = _scaled_run(HUGE_SCALE, None, dtype, factor_dtype, autocast)
    assert scaled["scale"] == HUGE_SCALE, "the scaler skipped a step"
    for step in range(STEPS):
        assert len(scaled["factors"][step]) == len(plain["factors"][step]) > 0, step
        assert max_rel_err(scaled["factors"][step], plain["factors"][step]) < 1e-10, step
    assert max_rel_err(scaled["params"][-1], plain["params"][-1]) < 1e-10


def test_a_grad_scaler_that_is_not_one_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"grad_scaler must be a torch\.amp\.GradScaler.*'yes'"):
        dpkfac.KFACPreconditioner(make_model(), grad_scaler="yes")
