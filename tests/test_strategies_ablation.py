"""d_kfac's ablation switches: triangle packing, per-layer placement, lazy factor sync.

Each switch changes how the baseline communicates, never what it computes:
the decompositions and the update equal the published (eager, unpacked,
LPT-placed) scheme's in float64, while the factor bytes shrink as predicted.
Lazy sync (the default) sends the factors once per decomposition instead of
once per factor update: F/I of the eager bytes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from strategy_cases import batch, make_model, max_rel_err

import dpkfac
from dpkfac.comm import triangle_numel

FACTOR_EVERY, INV_EVERY, STEPS = 2, 4, 8


def _run(rank: int, world_size: int, options: dict[str, Any]) -> dict[str, Any]:
    model = make_model()
    pre = dpkfac.KFACPreconditioner(
        model,
        strategy="d_kfac",
        kl_clip=0.01,
        damping=0.01,
        factor_update_steps=FACTOR_EVERY,
        inv_update_steps=INV_EVERY,
        **options,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params, dense, factor_bytes = [], [], []
    for step in range(STEPS):
        pre.reset_stats()
        x, y = batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
        factor_bytes.append(pre.comm_stats()["factor_allreduce"]["bytes"])
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        if step % INV_EVERY == 0:
            # Sign-free view of each eigendecomposition: Q diag(d) Qᵀ.
            dense.append(
                {
                    f"{name}/{w}": dec.q @ torch.diag(dec.d) @ dec.q.T
                    for name, layer in pre.layers.items()
                    for w in "AG"
                    if (dec := layer.decomposition(w)) is not None
                }
            )
    owners = {n: (x.a_decomposer, x.g_decomposer) for n, x in pre.layers.items()}
    dims = [x.dim(w) for x in pre.layers.values() for w in "AG"]
    return {
        "params": params,
        "dense": dense,
        "bytes": factor_bytes,
        "owners": owners,
        "dims": dims,
    }


@pytest.fixture(scope="module")
def eager() -> list[dict[str, Any]]:
    return run_ranks(_run, 2, {"lazy_factor_sync": False})


@pytest.mark.distributed
def test_lazy_sync_decompositions_equal_the_eager_ones(eager: list[dict[str, Any]]) -> None:
    lazy = run_ranks(_run, 2, {})  # the default
    for rank in range(2):
        for got, want in zip(lazy[rank]["dense"], eager[rank]["dense"], strict=True):
            assert max_rel_err(got, want) < 1e-12
        for got, want in zip(lazy[rank]["params"], eager[rank]["params"], strict=True):
            assert max_rel_err(got, want) < 1e-10
    # Bytes: eager sends every factor on each of the I/F factor steps of a cycle,
    # lazy once per decomposition: F/I of the eager traffic.
    itemsize = 8
    full = sum(d * d for d in eager[0]["dims"]) * itemsize
    assert eager[0]["bytes"] == [full if s % FACTOR_EVERY == 0 else 0 for s in range(STEPS)]
    assert lazy[0]["bytes"] == [full if s % INV_EVERY == 0 else 0 for s in range(STEPS)]
    assert sum(lazy[0]["bytes"]) * INV_EVERY == sum(eager[0]["bytes"]) * FACTOR_EVERY


@pytest.mark.distributed
def test_triangle_packing_sends_triangles_and_changes_nothing(
    eager: list[dict[str, Any]],
) -> None:
    packed = run_ranks(_run, 2, {"triangle": True, "lazy_factor_sync": False})
    for got, want in zip(packed[0]["params"], eager[0]["params"], strict=True):
        assert max_rel_err(got, want) < 1e-12
    tri = sum(triangle_numel(d) for d in eager[0]["dims"]) * 8
    assert packed[0]["bytes"][0] == tri < eager[0]["bytes"][0]


@pytest.mark.distributed
def test_layer_round_robin_places_a_and_g_of_a_layer_together(
    eager: list[dict[str, Any]],
) -> None:
    rr = run_ranks(_run, 2, {"placement": "layer_round_robin", "lazy_factor_sync": False})
    owners = list(rr[0]["owners"].values())
    assert owners == [(i % 2, i % 2) for i in range(len(owners))]
    for got, want in zip(rr[0]["params"], eager[0]["params"], strict=True):
        assert max_rel_err(got, want) < 1e-10


def test_bad_switch_values_are_named() -> None:
    with pytest.raises(ValueError, match="unknown placement 'random'"):
        dpkfac.KFACPreconditioner(make_model(), strategy="d_kfac", placement="random")
    with pytest.raises(ValueError, match="lazy_factor_sync must be true or false"):
        dpkfac.KFACPreconditioner(make_model(), strategy="d_kfac", lazy_factor_sync="yes")
