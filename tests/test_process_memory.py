"""Whole-process memory: the runtime's exact tally and the cost model's prediction of it.

The tally (:func:`dpkfac.process_memory`) is checked against numbers worked
out by hand; the prediction (:func:`dpkfac.costmodel.memory.predict_process_memory`)
against the tally, byte for byte, on real models and strategies, at one rank
and on two gloo ranks; the activation estimate against a hand count.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from torch import nn

import dpkfac
from dpkfac import ProcessMemory, process_memory
from dpkfac.costmodel import PRESETS, predict, shapes_from_model
from dpkfac.costmodel.memory import activation_bytes, predict_process_memory, process_memory_of
from dpkfac.memory import cuda_peak_bytes, reset_cuda_peak

HW = PRESETS["cpu_gloo_local"]


class MLP(nn.Module):
    """Linear(4, 8) -> ReLU -> Linear(8, 3): 67 parameters in 4 tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class CNN(nn.Module):
    """Conv2d(1, 4, 3, stride 2, no bias) -> BatchNorm2d(4) -> ReLU -> Linear(64, 3) on 8x8."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


class Tied(nn.Module):
    """Two Linear layers sharing one weight, and a buffer that is a view of a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight
        self.register_buffer("alias", self.a.weight.detach()[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _input(model: nn.Module, n: int = 5, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (n, 1, 8, 8) if isinstance(model, CNN) else (n, 4)
    return torch.randn(shape, generator=g)


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd_momentum":
        return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    pre: Any = None,
    steps: int = 2,
    rank: int = 0,
) -> torch.Tensor:
    x = _input(model, seed=rank)
    for _ in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), torch.arange(len(x)) % 3).backward()
        if pre is not None:
            pre.step()
        optimizer.step()
    return x


# ------------------------------------------------------------------ the tally
def test_tally_of_an_mlp_with_sgd_momentum_and_adamw() -> None:
    params = (4 * 8 + 8 + 8 * 3 + 3) * 4  # 67 float32 elements
    torch.manual_seed(0)
    model = MLP()
    before = process_memory(model)
    assert before == ProcessMemory(parameters=params)  # no gradients, no optimizer yet
    sgd = _optimizer("sgd_momentum", model)
    _train(model, sgd)
    assert process_memory(model, sgd) == ProcessMemory(
        parameters=params, gradients=params, optimizer=params
    )
    torch.manual_seed(0)
    model = MLP()
    adamw = _optimizer("adamw", model)
    _train(model, adamw)
    got = process_memory(model, adamw)
    # Two moments per parameter and one float32 step scalar per parameter tensor.
    assert got.optimizer == 2 * params + 4 * 4
    assert got.total == 4 * params + 16
    assert got.as_dict()["total"] == got.total and got.as_dict()["kfac"] == 0


def test_tally_counts_module_buffers_and_kfac_state() -> None:
    torch.manual_seed(0)
    model = CNN()
    opt = _optimizer("sgd_momentum", model)
    pre = dpkfac.KFACPreconditioner(model, strategy="dp_kfac")
    _train(model, opt, pre)
    got = process_memory(model, opt, pre)
    params = (4 * 9 + 4 + 4 + 64 * 3 + 3) * 4  # conv, BN weight and bias, fc
    # running_mean and running_var (4 float32 each) and num_batches_tracked (one int64).
    assert got.module_buffers == 4 * 4 + 4 * 4 + 8
    assert got.parameters == got.gradients == got.optimizer == params
    usage = pre.memory_usage()
    assert got.kfac_factors == usage["factors_bytes"] > 0
    assert got.kfac_decompositions == usage["decompositions_bytes"] > 0
    assert got.kfac_buffers == usage["buffers_bytes"]
    assert got.kfac == sum(usage.values())
    assert got.total == 3 * params + 40 + got.kfac


def test_shared_parameters_and_views_are_counted_once() -> None:
    model = Tied()
    opt = _optimizer("sgd_momentum", model)
    _train(model, opt)
    one = 4 * 4 * 4
    # One weight (two modules), one gradient, one momentum; the buffer is a view of it.
    assert process_memory(model, opt) == ProcessMemory(
        parameters=one, gradients=one, optimizer=one, module_buffers=0
    )


def test_cuda_peak_is_none_off_cuda() -> None:
    reset_cuda_peak("cpu")  # a no-op, and no CUDA call
    assert cuda_peak_bytes("cpu") is None
    assert cuda_peak_bytes(torch.device("meta")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_covers_the_tally() -> None:
    device = torch.device("cuda", 0)
    model = CNN().to(device)
    opt = _optimizer("adamw", model)
    pre = dpkfac.KFACPreconditioner(model, strategy="dp_kfac")
    reset_cuda_peak(device)
    x = _input(model).to(device)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), torch.arange(len(x), device=device) % 3).backward()
        pre.step()
        opt.step()
    peak = cuda_peak_bytes(device)
    tally = process_memory(model, opt, pre)
    # AdamW's step scalars live on the host; everything else of the tally is on the GPU.
    assert peak is not None and peak >= tally.total - 4 * len(list(model.parameters()))


# ------------------------------------------------------------- the prediction
def _predicted(
    model: nn.Module, x: torch.Tensor, pre: Any, optimizer: str, world_size: int
) -> list[ProcessMemory]:
    shapes = shapes_from_model(model, x)
    pred = predict(
        shapes,
        strategy=pre.strategy.scheme.name,
        world_size=world_size,
        hardware=HW,
        kfac=pre.options,
        options=pre.strategy.options,
    )
    return [process_memory_of(pred, shapes, optimizer=optimizer, rank=r) for r in range(world_size)]


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adamw"])
@pytest.mark.parametrize("strategy", ["dp_kfac", "d_kfac"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_predicted_tally_equals_measured_at_one_rank(
    kind: str, strategy: str, optimizer: str
) -> None:
    torch.manual_seed(0)
    model = MLP() if kind == "mlp" else CNN()
    opt = _optimizer(optimizer, model)
    pre = dpkfac.KFACPreconditioner(model, strategy=strategy)
    x = _train(model, opt, pre)
    measured = process_memory(model, opt, pre)
    assert measured.kfac > 0 and measured.optimizer > 0
    assert _predicted(model, x, pre, optimizer, 1) == [measured]


def test_predicted_tally_without_kfac_or_optimizer() -> None:
    model = CNN()
    x = _input(model)
    shapes = shapes_from_model(model, x)
    model(x).sum().backward()  # gradients exist; plain SGD keeps no state
    assert predict_process_memory(shapes, None, optimizer="none") == process_memory(model)
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        predict_process_memory(shapes, None, optimizer="lamb")


def _two_ranks(rank: int, world_size: int) -> list[tuple[ProcessMemory, ProcessMemory]]:
    out = []
    for kind, strategy in (("cnn", "dp_kfac"), ("mlp", "d_kfac"), ("cnn", "kaisa")):
        torch.manual_seed(0)
        model = MLP() if kind == "mlp" else CNN()
        opt = _optimizer("sgd_momentum", model)
        pre = dpkfac.KFACPreconditioner(model, strategy=strategy)
        x = _train(model, opt, pre, rank=rank)
        predicted = _predicted(model, x, pre, "sgd_momentum", world_size)[rank]
        out.append((process_memory(model, opt, pre), predicted))
    return out


@pytest.mark.distributed
def test_predicted_tally_equals_measured_on_two_ranks() -> None:
    results = run_ranks(_two_ranks, 2)
    for rank_results in results:
        for measured, predicted in rank_results:
            assert measured == predicted
    # dp_kfac's ranks hold different layers' K-FAC state; the rest is the same on both.
    (a, _), (b, _) = results[0][0], results[1][0]
    assert a.model == b.model and a.kfac != b.kfac


# ---------------------------------------------------------- activation estimate
def test_activation_estimate_by_hand() -> None:
    # MLP, N = 5: fc1 saves its input (4) and output (8); fc2 its input, the ReLU's
    # output (8, a new tensor), and its output (3): 5 x 23 float32 elements.
    model = MLP()
    assert activation_bytes(shapes_from_model(model, _input(model))) == 5 * 23 * 4
    # CNN, N = 5: the conv's input map 1x8x8 (not im2col's 9 x 16 positions) and output
    # 4x4x4; fc's input (the flattened ReLU output, 64) and output (3).
    model = CNN()
    assert (
        activation_bytes(shapes_from_model(model, _input(model)), 2) == 5 * (64 + 64 + 64 + 3) * 2
    )
    # A layer fed by another's output directly: that tensor is counted once (6, not 12).
    seq = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    assert activation_bytes(shapes_from_model(seq, torch.zeros(3, 4))) == 3 * (4 + 6 + 2) * 4


def test_activation_estimate_counts_a_shared_input_once() -> None:
    class QKV(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(4, 4) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.q(x) + self.k(x) + self.v(x)

    shapes = shapes_from_model(QKV(), torch.zeros(2, 7, 4))  # N = 2, T = 7
    assert shapes.saved == ((28, 28), (0, 28), (0, 28))
    assert activation_bytes(shapes) == 2 * (28 + 3 * 28) * 4


def test_activation_estimate_needs_measured_shapes() -> None:
    from dpkfac.costmodel import resnet50

    with pytest.raises(ValueError, match="shapes_from_model"):
        activation_bytes(resnet50(batch_size=1, image_size=32))
