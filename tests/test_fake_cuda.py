"""The GPU path on fake CUDA tensors: every strategy's hooks and step, on this CPU.

See ``tests/fake_cuda.py`` for the harness. Under the strict fake mode, any
tensor the library makes on the CPU and mixes with layer data raises, and the
communicator's device check rejects any tensor for a collective that is not on
the run's (fake) CUDA device; collectives of P>1 plans go to torch's fake
process group, so one process plays one rank of a large job. Values are not
real: these tests assert devices, dtypes, shapes and the path taken, and the
CPU tests assert the numbers.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from fake_cuda import (
    DEVICE,
    FakeLossScaler,
    Outputs,
    ResNetLike,
    drive_backward,
    dry_run_preconditioner,
    fake_mode,
    fake_process_group,
    fake_step,
    on_fake_cuda,
    tensors_of,
)
from strategy_cases import STRATEGY_VARIANTS
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

from dpkfac.comm import Communicator
from dpkfac.device import DeviceMismatch, DryRunReader, HostReader, same_device
from dpkfac.plan import scheme_options
from dpkfac.plan.configs import kfac_configs

#: Start-up measurements time real kernels; under fake tensors a preset stands in.
PRESET = {"hardware": "cpu_gloo_local"}


#: The cross-strategy variants, plus every configuration of the overlapped mode (its hooks
#: run inside backward).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    **STRATEGY_VARIANTS,
    **{n: c for n, c in kfac_configs().items() if c[1].get("overlap") is True},
}


def _variant(name: str) -> tuple[str, dict[str, Any]]:
    strategy, options = VARIANTS.get(name) or kfac_configs()[name]
    options = dict(options)
    if strategy in ("spd_kfac", "grouped"):
        options.setdefault("hardware", PRESET["hardware"])
    return strategy, options


def _held(pre: Any, *, grads: bool = True) -> int:
    """Tensors a P=1 preconditioner holds once every layer is decomposed."""
    per_decomposition = 2 if pre.options.compute_method == "eigen" else 1
    params = sum(len(x.helper.parameters()) for x in pre.layers.values()) if grads else 0
    return len(pre.layers) * 2 * (1 + per_decomposition) + params


def _assert_on_device(pre: Any) -> int:
    count = 0
    for name, tensor in tensors_of(pre):
        assert same_device(tensor.device, DEVICE), f"{name} is on {tensor.device}"
        count += 1
    return count


# --------------------------------------------------------------- the harness itself
def test_the_harness_refuses_a_cpu_tensor_meeting_cuda_data() -> None:
    """A CPU constant meeting fake CUDA data raises, as on a GPU (the harness's premise)."""
    mode = fake_mode()
    with mode:
        x = torch.randn(3, 3, device="cuda")
        mask = torch.ones(3, 3, device="cpu")
        with pytest.raises(FakeTensorDeviceMismatchError):
            torch.einsum("ij,jk->ik", mask, x)


def _one_backward(rank: int, world_size: int) -> float:
    x = torch.ones(2, requires_grad=True)
    (x * 3).sum().backward()
    assert x.grad is not None
    return float(x.grad.sum())


@pytest.mark.distributed
def test_forked_ranks_still_run_a_backward_after_fake_cuda_tensors() -> None:
    """Fake CUDA tensors must not make the parent's later forks unable to run autograd.

    Made before the process's first backward, a fake CUDA tensor made the
    engine start a thread for a CUDA device that is not there, and every gloo
    rank forked after the next backward in the parent failed ("Unable to handle
    autograd's threading in combination with fork-based multiprocessing"):
    the test suite then depended on the order its files ran in.
    """
    with fake_mode(), torch.device("cuda"):
        torch.randn(3, 3, requires_grad=True).sum()
    parent = torch.ones(1, requires_grad=True)
    (parent * 2).sum().backward()  # the parent's first real backward, in this order
    assert run_ranks(_one_backward, 2) == [6.0, 6.0]


# ------------------------------------------------------------------ forward hooks
CONV_GEOMETRIES: dict[str, dict[str, Any]] = {
    "3x3_s1_p1": {"kernel_size": 3, "padding": 1},
    "3x3_s1_p0_nobias": {"kernel_size": 3, "bias": False},
    "3x3_s2_p1": {"kernel_size": 3, "stride": 2, "padding": 1},
    "1x1_s2_nobias": {"kernel_size": 1, "stride": 2, "bias": False},
    "3x3_dilation2": {"kernel_size": 3, "padding": 2, "dilation": 2},
    "5x3_s1_p21": {"kernel_size": (5, 3), "padding": (2, 1)},
    "3x1_s12": {"kernel_size": (3, 1), "stride": (1, 2), "padding": (1, 0)},
    "same": {"kernel_size": 3, "padding": "same"},
    "reflect": {"kernel_size": 3, "padding": 1, "padding_mode": "reflect"},
    "circular_s2": {"kernel_size": 3, "stride": 2, "padding": 1, "padding_mode": "circular"},
}


@pytest.mark.parametrize("method", ["auto", "unfold", "auto_bf16"])
@pytest.mark.parametrize("sharing", ["expand", "reduce"])
@pytest.mark.parametrize("geometry", sorted(CONV_GEOMETRIES))
def test_conv_factors_are_built_on_the_device(geometry: str, sharing: str, method: str) -> None:
    mode = fake_mode()
    model = on_fake_cuda(mode, lambda: nn.Sequential(nn.Conv2d(3, 4, **CONV_GEOMETRIES[geometry])))
    with mode:
        pre = dry_run_preconditioner(model, weight_sharing=sharing, factor_method=method)
        layer = pre.layers["0"]
        outputs = Outputs(model)
        model(torch.randn(2, 3, 7, 9, device="cuda"))
        outputs.remove()
        assert drive_backward(model, outputs) == 1
        for which, dim in (("A", layer.helper.a_dim), ("G", layer.helper.g_dim)):
            batch = layer.factors[which].batch
            assert batch is not None and same_device(batch.device, DEVICE), which
            assert batch.shape == (dim, dim) and batch.dtype == torch.float32, which
        pre.step()
        assert _assert_on_device(pre) > 0


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
@pytest.mark.parametrize("shape", [(5, 6), (5, 4, 6), (6,)])
def test_linear_factors_are_built_on_the_device(shape: tuple[int, ...], sharing: str) -> None:
    mode = fake_mode()
    model = on_fake_cuda(mode, lambda: nn.Sequential(nn.Linear(6, 3)))
    with mode:
        pre = dry_run_preconditioner(model, weight_sharing=sharing)
        outputs = Outputs(model)
        model(torch.randn(*shape, device="cuda"))
        outputs.remove()
        assert drive_backward(model, outputs) == 1
        pre.step()
        layer = pre.layers["0"]
        assert layer.a_factor.shape == (7, 7) and layer.g_factor.shape == (3, 3)
        assert _assert_on_device(pre) == 2 + 2 + 2 + 2  # factors, 2×2 eigen tensors, grads


# ------------------------------------------------------------------- whole steps
METHODS: dict[str, dict[str, Any]] = {
    "eigen": {},
    "inverse": {"compute_method": "inverse"},
    "inverse_pi": {"compute_method": "inverse", "pi_damping": True},
}


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_strategy_steps_on_one_fake_gpu(variant: str, method: str) -> None:
    """Defaults plus the KL clip and a decomposition interval: steps 0-3 on fake CUDA."""
    strategy, options = _variant(variant)
    mode = fake_mode()
    model = on_fake_cuda(mode, ResNetLike)
    with mode:
        pre = dry_run_preconditioner(
            model, strategy=strategy, kl_clip=0.01, inv_update_steps=2, **METHODS[method], **options
        )
        for _ in range(4):
            assert fake_step(model, pre) == len(pre.layers)
        # Every layer's factors, decompositions and gradient, all on the GPU.
        assert _assert_on_device(pre) == _held(pre)
        assert pre.timings()["factor_compute"] == 0.0  # timing="off"


def test_one_host_read_per_factor_step_on_fake_cuda() -> None:
    """Outside decomposition steps the step reads the host once: the joint finiteness check."""
    mode = fake_mode()
    model = on_fake_cuda(mode, ResNetLike)
    with mode:
        pre = dry_run_preconditioner(model, kl_clip=0.01, inv_update_steps=100)
        fake_step(model, pre)  # placement and decompositions
        reads = []
        for _ in range(3):
            before = pre.host.reads
            fake_step(model, pre)
            reads.append(pre.host.reads - before)
        assert reads == [1, 1, 1]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize(("world_size", "rank"), [(4, 3), (64, 5)])
def test_every_strategy_plays_one_rank_of_a_large_job(
    variant: str, world_size: int, rank: int
) -> None:
    """Rank r of P on the fake process group: every collective gets fake CUDA tensors."""
    strategy, options = _variant(variant)
    mode = fake_mode()
    model = on_fake_cuda(mode, ResNetLike)
    with fake_process_group(rank, world_size), mode:
        pre = dry_run_preconditioner(
            model, strategy=strategy, kl_clip=0.01, inv_update_steps=2, **options
        )
        assert pre.comm.size == world_size and pre.comm.rank == rank
        for _ in range(3):
            fake_step(model, pre)
        stats = pre.comm_stats()
        assert stats["grad_allreduce"]["calls"] + stats["precond_broadcast"]["calls"] > 0
        _assert_on_device(pre)


def test_a_collective_refuses_a_cpu_tensor() -> None:
    mode = fake_mode()
    with fake_process_group(1, 4), mode:
        comm = Communicator(device=DEVICE)
        comm.allreduce_mean([torch.zeros(3, device="cuda")], "grad_allreduce")
        with pytest.raises(DeviceMismatch, match=r"cpu tensor \(3,\).*'factor_allreduce'.*cuda"):
            comm.allreduce_mean([torch.zeros(3, device="cpu")], "factor_allreduce")
        with pytest.raises(DeviceMismatch, match="decomposition_broadcast"):
            comm.broadcast([torch.zeros(2, 2)], 0, "decomposition_broadcast")


def test_agreed_values_are_sent_from_the_device_and_read_once() -> None:
    mode = fake_mode()
    with fake_process_group(2, 8), mode:
        reader = DryRunReader()
        comm = Communicator(device=DEVICE, host=reader)
        assert comm.agree_max([1.0, 4.0]) == [1.0, 4.0]
        assert reader.reads == 1
        assert comm.stats.as_dict()["setup"] == {"bytes": 16, "calls": 1, "wire_bytes": 28}


# -------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("variant", ["dp_kfac", "d_kfac", "kaisa_mem_opt", "grouped_auto"])
def test_state_dict_is_on_the_cpu_and_loads_onto_a_cuda_model(variant: str) -> None:
    """``state_dict`` holds CPU tensors (what the trainer saves and loads with
    ``map_location="cpu"``); loading puts every tensor on the layer's GPU."""
    strategy, options = _variant(variant)
    mode = fake_mode()
    model = on_fake_cuda(mode, ResNetLike)
    with mode:
        pre = dry_run_preconditioner(model, strategy=strategy, **options)
        for _ in range(2):
            fake_step(model, pre)
        state = pre.state_dict()
        saved = [
            t
            for entry in state["layers"].values()
            for key in ("A", "G", "A_decomp", "G_decomp")
            for t in ([entry[key]] if isinstance(entry[key], torch.Tensor) else entry[key] or [])
        ]
        assert saved and all(t.device.type == "cpu" for t in saved)
        other = on_fake_cuda(mode, ResNetLike)
        resumed = dry_run_preconditioner(other, strategy=strategy, **options)
        resumed.load_state_dict(state)
        assert _assert_on_device(resumed) == _held(resumed, grads=False)
        fake_step(other, resumed)
        _assert_on_device(resumed)


# ------------------------------------------------------------------ mixed precision
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_model_with_a_loss_scaler(dtype: torch.dtype) -> None:
    """A half-precision model, factors in float32, G unscaled by a device-side 1/s."""
    mode = fake_mode()
    model = on_fake_cuda(mode, ResNetLike, dtype)
    with mode:
        pre = dry_run_preconditioner(
            model, factor_dtype=torch.float32, grad_scaler=FakeLossScaler(), kl_clip=0.01
        )
        for _ in range(2):
            outputs = Outputs(model)
            model(torch.randn(3, 3, 8, 8, device="cuda", dtype=dtype))
            outputs.remove()
            drive_backward(model, outputs)
            pre.step()
        for layer in pre.layers.values():
            assert layer.a_factor.dtype == torch.float32 and layer.g_factor.dtype == torch.float32
            assert layer.module.weight.grad.dtype == dtype
        _assert_on_device(pre)


def test_the_default_reader_reads_and_counts() -> None:
    reader = HostReader()
    assert reader.flags(torch.tensor([True, False])) == [True, False]
    assert reader.read(torch.tensor([2.0]), [0.0]) == [2.0]
    assert reader.reads == 2


# ----------------------------------------------------- exact bytes and memory at scale
#: Every configuration that chooses nothing at start-up (spd_kfac and the "auto" ones do).
EXACT_VARIANTS = [
    name
    for name, (scheme, options) in kfac_configs().items()
    if scheme != "spd_kfac" and "auto" not in asdict(scheme_options(scheme, options)).values()
]


@pytest.mark.parametrize("variant", EXACT_VARIANTS)
@pytest.mark.parametrize(("world_size", "rank"), [(8, 7), (64, 5), (256, 200)])
def test_one_rank_of_a_large_job_hands_over_the_predicted_bytes(
    variant: str, world_size: int, rank: int
) -> None:
    """On the fake group, rank r of P hands collectives exactly the bytes the cost model
    predicts for that rank, and holds exactly the predicted K-FAC memory."""
    from dpkfac.costmodel import PRESETS, predict, shapes_from_model

    strategy, options = _variant(variant)
    shapes = shapes_from_model(ResNetLike(), torch.randn(3, 3, 8, 8))
    mode = fake_mode()
    model = on_fake_cuda(mode, ResNetLike)
    with fake_process_group(rank, world_size), mode:
        pre = dry_run_preconditioner(model, strategy=strategy, kl_clip=0.01, **options)
        fake_step(model, pre)  # placement, setup collectives
        pre.reset_stats()
        fake_step(model, pre)  # a factor and decomposition step
        measured, memory = pre.comm_stats(), pre.memory_usage()
    pred = predict(
        shapes,
        strategy=strategy,
        world_size=world_size,
        hardware=PRESETS["v100_ib100"],
        kfac=pre.options,
        options=pre.strategy.options,
        param_itemsize=4,
    )
    assert measured == pred.update.comm_of(rank)
    assert memory == pred.memory[rank]


def test_the_overlap_reduces_and_broadcasts_inside_the_driven_backward() -> None:
    """dp_kfac's overlap reduces gradient buckets from the gradient hooks, on fake CUDA,
    and the hook that launches the last bucket preconditions and broadcasts (waiting on
    the fake group's works returns at once), so ``step()`` sends nothing more."""
    strategy, options = _variant("dp_kfac_overlap")
    mode = fake_mode()
    model = on_fake_cuda(mode, ResNetLike)
    with fake_process_group(1, 4), mode:
        # Small buckets: each is reduced as soon as it is complete.
        pre = dry_run_preconditioner(
            model, strategy=strategy, kl_clip=0.01, bucket_cap_mb=1e-4, **options
        )
        fake_step(model, pre)  # placement: an ordinary step
        pre.reset_stats()
        outputs = Outputs(model)
        model(torch.randn(3, 3, 8, 8, device="cuda"))
        outputs.remove()
        drive_backward(model, outputs)
        in_backward = pre.comm_stats()
        assert in_backward["grad_allreduce"]["calls"] > 1, in_backward
        assert in_backward["precond_broadcast"]["calls"] > 0, in_backward
        pre.step()
        assert pre.comm_stats() == in_backward
        _assert_on_device(pre)
