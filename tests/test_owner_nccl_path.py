"""The owner reduction's collectives as NCCL runs them, on the in-process group.

On gloo the owner path's sharded collectives go by alltoallv (gloo has no all-gather of
uneven shards, and its reduce-scatter sends an all-reduce's bytes and completes no future,
which a DDP communication hook must return). Every other backend takes its own all-gather
of uneven shards per round and reduce-scatter per bucket. torch's fake process group cannot
copy uneven shards of real tensors, so those calls run here on the project's in-process group
(``experiments.threads``, backend ``threads``), which implements them as NCCL does
(coalesced broadcasts and reduces, one per root): the update equals dp_kfac's in float64
to 1e-12, replicas are bitwise identical, and the calls and bytes are the cost model's for
every backend.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from strategy_cases import batch, make_model, make_preconditioner
from torch.nn.parallel import DistributedDataParallel

from dpkfac.costmodel import PRESETS, predict, shapes_from_model
from dpkfac.options import KFACOptions
from experiments.threads import run_threads

TOL = 1e-12
STEPS = 4
SMALL = 300 / 2**20  # several buckets of the tiny model
#: name -> (options, wrapped in DDP)
CASES: dict[str, tuple[dict[str, Any], bool]] = {
    "owner": ({"grad_reduction": "owner"}, False),
    "owner-capped": ({"grad_reduction": "owner", "bucket_cap_mb": SMALL}, False),
    "owner-overlap": ({"grad_reduction": "owner", "overlap": True, "bucket_cap_mb": SMALL}, False),
    # DDP's buckets and the update rounds under the same cap, as the cost model prices them.
    "owner-overlap-ddp": (
        {"grad_reduction": "owner", "overlap": True, "bucket_cap_mb": SMALL},
        True,
    ),
    "owner-ready-ddp": (
        {"grad_reduction": "owner", "overlap": True, "drain": "ready", "bucket_cap_mb": SMALL},
        True,
    ),
}


def _train(rank: int, options: dict[str, Any], ddp: bool) -> dict[str, Any]:
    inner = make_model()
    model = DistributedDataParallel(inner, bucket_cap_mb=SMALL) if ddp else inner
    pre = make_preconditioner(model, "dp_kfac", kl_clip=0.01, **options)
    opt = torch.optim.SGD(inner.parameters(), lr=0.1, momentum=0.9)
    params, stats = [], []
    for step in range(STEPS):
        opt.zero_grad()
        pre.reset_stats()
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
        params.append({n: p.detach().clone() for n, p in inner.named_parameters()})
        stats.append(pre.comm_stats())
    return {"params": params, "stats": stats, "backend": pre.comm.backend}


def _all(rank: int, world_size: int) -> dict[str, Any]:
    out = {name: _train(rank, options, ddp) for name, (options, ddp) in CASES.items()}
    out["reference"] = _train(rank, {}, False)
    return out


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)) for k in a)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_uneven_all_gather_and_reduce_scatter_give_dp_kfacs_update(world_size: int) -> None:
    results = run_threads(_all, world_size, timeout=240)
    assert results[0]["reference"]["backend"] == "threads"
    shapes = shapes_from_model(make_model(), batch(0, 0)[0], ready_order=True)
    for name, (options, ddp) in CASES.items():
        for rank, res in enumerate(results):
            for step in range(STEPS):
                err = _rel(res[name]["params"][step], res["reference"]["params"][step])
                assert err < TOL, (name, rank, step, err)
            assert all(
                torch.equal(t, results[0][name]["params"][-1][k])
                for k, t in res[name]["params"][-1].items()
            ), (name, rank)
        kfac = KFACOptions(
            damping=0.01,
            factor_decay=0.9,
            kl_clip=0.01,
            lr=0.1,
            bucket_cap_mb=options.get("bucket_cap_mb", 25.0),
        )
        pred = predict(
            shapes,
            strategy="dp_kfac",
            options={k: v for k, v in options.items() if k != "bucket_cap_mb"},
            world_size=world_size,
            hardware=PRESETS["cpu_gloo_local"],
            param_itemsize=8,
            kfac=kfac,
            ddp=ddp,
        )
        for rank, res in enumerate(results):
            assert res[name]["stats"][-1] == pred.update.comm_of(rank), (name, rank)
        # Uncapped: one all-gather of every owner's updates.
        if name == "owner":
            assert results[0][name]["stats"][-1]["precond_broadcast"]["calls"] == 1
