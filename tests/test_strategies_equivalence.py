"""Equivalences between strategies on gloo ranks, against single-process references.

The design contract's promises, at world sizes 1-4 in float64:
* the same batch on every rank: every strategy gives the world-size-1 update;
* different batches: d-kfac and spd-kfac give the world-size-1 update on the
  concatenated batch; dp-kfac preconditions each layer with its owner's local
  factors and the globally averaged gradient (checked by a dense solve);
* after every step all ranks hold bitwise-identical parameters;
* grad_reduction="owner" gives the same update as "allreduce".
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from strategy_cases import (
    REPLICATED_VARIANTS,
    STRATEGY_VARIANTS,
    batch,
    concat_batch,
    make_model,
    make_preconditioner,
    max_rel_err,
    run,
)

STEPS = 3
TOL = 1e-6


def _train_all_variants(rank: int, world_size: int, same_batch: bool, kl_clip: float | None):
    out = {}
    for variant in STRATEGY_VARIANTS:
        model = make_model()
        pre = make_preconditioner(model, variant, kl_clip=kl_clip)
        batches = [batch(s, 0 if same_batch else rank) for s in range(STEPS)]
        out[variant] = run(model, pre, batches)
        out[variant]["owners"] = {n: layer.owner for n, layer in pre.layers.items()}
    return out


def _reference(batches, kl_clip: float | None):
    model = make_model()
    pre = make_preconditioner(model, "d_kfac", kl_clip=kl_clip)
    return run(model, pre, batches)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_same_batch_every_strategy_matches_world_size_one(world_size: int) -> None:
    kl_clip = 0.001 if world_size == 3 else None  # exercise the KL-clip metadata path once
    results = run_ranks(_train_all_variants, world_size, True, kl_clip)
    ref = _reference([batch(s, 0) for s in range(STEPS)], kl_clip)
    for variant in STRATEGY_VARIANTS:
        for step in range(STEPS):
            for rank in range(world_size):
                got = results[rank][variant]["params"][step]
                err = max_rel_err(got, ref["params"][step])
                assert err < TOL, (variant, step, rank, err)
                # bitwise-identical parameters on all ranks
                for name, tensor in got.items():
                    assert torch.equal(tensor, results[0][variant]["params"][step][name]), (
                        variant,
                        step,
                        rank,
                        name,
                    )


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_different_batches(world_size: int) -> None:
    results = run_ranks(_train_all_variants, world_size, False, None)
    # d-kfac / spd-kfac: the world-size-1 run on the concatenated batch.
    ref = _reference([concat_batch(s, world_size) for s in range(STEPS)], None)
    for variant in REPLICATED_VARIANTS:
        for step in range(STEPS):
            err = max_rel_err(results[0][variant]["params"][step], ref["params"][step])
            assert err < TOL, (variant, step, err)
    for variant in STRATEGY_VARIANTS:
        for rank in range(1, world_size):
            for step in range(STEPS):
                for name, t in results[rank][variant]["params"][step].items():
                    assert torch.equal(t, results[0][variant]["params"][step][name])
    # grad_reduction="owner" equals "allreduce".
    for step in range(STEPS):
        err = max_rel_err(
            results[0]["dp_kfac_owner"]["params"][step], results[0]["dp_kfac"]["params"][step]
        )
        assert err < TOL, (step, err)
    # dp-kfac, first step: owner's local factors, averaged gradient, dense solve.
    _check_dp_kfac_first_step(results, world_size)


def _local_factors(rank: int):
    model = make_model()
    pre = make_preconditioner(model, "d_kfac")
    x, y = batch(0, rank)
    F.cross_entropy(model(x), y).backward()
    pre.step()
    return {n: (layer.a_factor, layer.g_factor) for n, layer in pre.layers.items()}


def _check_dp_kfac_first_step(results, world_size: int) -> None:
    model = make_model()
    x, y = concat_batch(0, world_size)
    F.cross_entropy(model(x), y).backward()
    owners = results[0]["dp_kfac"]["owners"]
    assert set(owners.values()) <= set(range(world_size))
    local = {r: _local_factors(r) for r in set(owners.values())}
    grads = results[0]["dp_kfac"]["grads"][0]
    damping = 0.01
    for name, owner in owners.items():
        module = getattr(model, name)
        a, g = local[owner][name]
        w = module.weight.grad.reshape(module.weight.shape[0], -1)
        if module.bias is not None:
            w = torch.cat([w, module.bias.grad[:, None]], dim=1)
        dense = torch.kron(g, a) + damping * torch.eye(g.shape[0] * a.shape[0], dtype=a.dtype)
        v = torch.linalg.solve(dense, w.reshape(-1)).reshape(w.shape)
        got = grads[f"{name}.weight"].reshape(w.shape[0], -1)
        if module.bias is not None:
            got = torch.cat([got, grads[f"{name}.bias"][:, None]], dim=1)
        err = float((got - v).abs().max() / v.abs().max())
        assert err < TOL, (name, owner, err)
    # the layer K-FAC leaves alone keeps the averaged gradient
    assert torch.allclose(grads["bn.weight"], model.bn.weight.grad, rtol=1e-10, atol=1e-12)
