"""CUDA paths: every strategy on a GPU, ranks sharing one GPU, NCCL, mixed precision.

Skipped without CUDA (``make test-gpu`` runs only these). The hot path must not
synchronise the device: the capture hooks run under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising
call.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from strategy_cases import STRATEGY_VARIANTS, batch, make_model, make_preconditioner, max_rel_err

import dpkfac

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _train(variant: str, device: str, steps: int = 3) -> dict[str, torch.Tensor]:
    model = make_model().to(device)
    pre = make_preconditioner(model, variant, kl_clip=0.01, inv_update_steps=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = (t.to(device) for t in batch(step, 0))
        opt.zero_grad()
        if device.startswith("cuda") and step > 0:
            torch.cuda.set_sync_debug_mode("error")
            try:
                loss = F.cross_entropy(model(x), y)
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        else:
            F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
    assert sum(pre.timings().values()) > 0
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", sorted(STRATEGY_VARIANTS))
def test_every_strategy_on_one_gpu_matches_the_cpu(variant: str) -> None:
    assert max_rel_err(_train(variant, "cuda"), _train(variant, "cpu")) < 1e-8


def _shared_gpu(rank: int, world_size: int, variant: str) -> dict[str, torch.Tensor]:
    return _train(variant, "cuda:0")


@pytest.mark.distributed
@pytest.mark.parametrize("variant", ["dp_kfac", "d_kfac", "spd_kfac"])
def test_two_ranks_share_one_gpu_over_gloo(variant: str) -> None:
    results = run_ranks(_shared_gpu, 2, variant, start_method="spawn")
    for name, t in results[0].items():
        assert torch.equal(t, results[1][name]), name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_on_two_gpus() -> None:
    results = run_ranks(_nccl_rank, 2, backend="nccl", start_method="spawn")
    for name, t in results[0].items():
        assert torch.equal(t, results[1][name]), name


def _nccl_rank(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    return _train("dp_kfac", f"cuda:{rank}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_with_a_grad_scaler(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    ).cuda()
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = dpkfac.KFACPreconditioner(model, grad_scaler=scaler)
    for _ in range(3):
        x, y = torch.randn(8, 16, device="cuda"), torch.randint(0, 4, (8,), device="cuda")
        opt.zero_grad()
        with torch.autocast("cuda", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        pre.step()
        scaler.step(opt)
        scaler.update()
    for layer in pre.layers.values():
        assert layer.a_factor.dtype == torch.float32
        assert torch.isfinite(layer.g_factor).all()


# ---------------------------------------------- the owner reduction overlapped, inside DDP
def _owner_overlap(
    rank: int, world_size: int, device: str, fp16: bool, drain: str = "last"
) -> dict[str, torch.Tensor | list[bool]]:
    """dp_kfac_owner_overlap under DDP: the hooks (DDP's communication hook) never
    synchronise the device, also where they ask whether a bucket is reduced (``drain``
    "ready": ``is_completed()``, a query of the work's CUDA events); with fp16 the loss
    scaler decides after pre.step()."""
    inner = make_model().float().to(device)
    dev = torch.device(device)
    model = torch.nn.parallel.DistributedDataParallel(
        inner, device_ids=[dev.index] if dev.type == "cuda" else None
    )
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10) if fp16 else None
    pre = dpkfac.KFACPreconditioner(
        model,
        grad_reduction="owner",
        overlap=True,
        drain=drain,
        grad_scaler=scaler,
        kl_clip=0.01,
        damping=0.01,
        inv_update_steps=4,  # decompositions (which check eigh on the host) at step 0 only
    )
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    skipped = []
    for step in range(4):
        x, y = (t.to(device) for t in batch(step, rank))
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16, enabled=fp16):
            loss = F.cross_entropy(model(x.float()), y)
        if step > 0:
            torch.cuda.set_sync_debug_mode("error")
        try:
            (scaler.scale(loss) if scaler is not None else loss).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        pre.step()
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < before)
        else:
            opt.step()
    out: dict[str, torch.Tensor | list[bool]] = {
        n: p.detach().cpu() for n, p in inner.named_parameters()
    }
    out["skipped"] = skipped
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("drain", ["last", "ready"])
def test_owner_overlap_inside_ddp_two_ranks_share_one_gpu(drain: str) -> None:
    """Over gloo with CUDA tensors: the same parameters as the CPU run, replicas equal."""
    gpu = run_ranks(_owner_overlap, 2, "cuda:0", False, drain, start_method="spawn")
    cpu = run_ranks(_owner_overlap_cpu, 2, start_method="spawn")
    for name, t in gpu[0].items():
        if name != "skipped":
            assert torch.equal(t, gpu[1][name]), name
            assert max_rel_err({name: t}, {name: cpu[0][name]}) < 1e-4, name


def _owner_overlap_cpu(rank: int, world_size: int) -> dict[str, torch.Tensor | list[bool]]:
    inner = make_model().float()
    model = torch.nn.parallel.DistributedDataParallel(inner)
    pre = dpkfac.KFACPreconditioner(
        model, grad_reduction="owner", overlap=True, kl_clip=0.01, damping=0.01, inv_update_steps=4
    )
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)
    for step in range(4):
        x, y = batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(model(x.float()), y).backward()
        pre.step()
        opt.step()
    return {n: p.detach() for n, p in inner.named_parameters()}


@pytest.mark.distributed
def test_owner_overlap_inside_ddp_with_fp16_on_one_gpu() -> None:
    """fp16 autocast and a loss scaler on a shared GPU (gloo): the ranks skip alike."""
    results = run_ranks(_owner_overlap, 2, "cuda:0", True, start_method="spawn")
    assert results[0]["skipped"] == results[1]["skipped"]
    for name, t in results[0].items():
        if name != "skipped":
            assert torch.equal(t, results[1][name]), name
            assert isinstance(t, torch.Tensor) and torch.isfinite(t).all(), name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("drain", ["last", "ready"])
def test_owner_overlap_on_nccl_with_fp16(drain: str) -> None:
    """NCCL: the reduce-scatter completes DDP's future, the updates travel by one all-gather
    of uneven shards; with fp16 every rank skips the same steps."""
    results = run_ranks(_nccl_owner_overlap, 2, drain, backend="nccl", start_method="spawn")
    assert results[0]["skipped"] == results[1]["skipped"]
    for name, t in results[0].items():
        if name != "skipped":
            assert torch.equal(t, results[1][name]), name


def _nccl_owner_overlap(
    rank: int, world_size: int, drain: str
) -> dict[str, torch.Tensor | list[bool]]:
    return _owner_overlap(rank, world_size, f"cuda:{rank}", True, drain)
