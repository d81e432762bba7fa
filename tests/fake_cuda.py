"""The fake-CUDA harness of the tests: the GPU path of a step, run on this CPU.

The harness itself (fake mode, fake CUDA models, the driven backward, the
dry-run preconditioner, torch's fake process group) is product code shared
with the scale simulation: :mod:`experiments.bench.fake_cuda`, whose
docstring says what the mode cannot run and how the harness gets past it.
This module re-exports it for the tests and adds what only the tests use: a
loss-scaler stand-in and a walk over every tensor a preconditioner holds.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

import dpkfac
from experiments.bench.fake_cuda import (
    DEVICE,
    Outputs,
    drive_backward,
    dry_run_preconditioner,
    fake_forward_backward,
    fake_mode,
    fake_process_group,
    fake_step,
    on_fake_cuda,
)
from experiments.models.harness import ResNetLike

__all__ = [
    "DEVICE",
    "FakeLossScaler",
    "Outputs",
    "ResNetLike",
    "drive_backward",
    "dry_run_preconditioner",
    "fake_forward_backward",
    "fake_mode",
    "fake_process_group",
    "fake_step",
    "on_fake_cuda",
    "tensors_of",
]


class FakeLossScaler:
    """A started, enabled ``GradScaler`` stand-in whose scale is a fake CUDA tensor.

    ``torch.amp.GradScaler("cuda")`` disables itself where CUDA is absent; the
    preconditioner only asks a scaler whether it is enabled and for its scale.
    """

    def __init__(self, scale: float = 2.0**16) -> None:
        self._scale = torch.full((), scale, dtype=torch.float32, device="cuda")
        self.value = scale

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return self.value

    def _get_scale_async(self) -> torch.Tensor:
        return self._scale


def tensors_of(pre: dpkfac.KFACPreconditioner) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor the preconditioner holds per layer, named, for device checks."""
    for name, layer in pre.layers.items():
        for which, state in layer.factors.items():
            if state.running is not None:
                yield f"{name}.{which}", state.running
            if state.decomposition is not None:
                for i, t in enumerate(state.decomposition.tensors()):
                    yield f"{name}.{which}_decomp[{i}]", t
        for p in layer.helper.parameters():
            if p.grad is not None:
                yield f"{name}.grad", p.grad
