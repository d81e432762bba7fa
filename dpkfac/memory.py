"""Whole-process memory of a training process: an exact tally of what it holds to train.

The DP-KFAC paper reports memory as the whole process's, not only K-FAC's, so
a comparison with it needs more than :meth:`dpkfac.KFACPreconditioner.memory_usage`.
:func:`process_memory` counts, on any device, the bytes of

* the model's parameters and their gradients,
* the optimizer's state (every tensor in ``optimizer.state``: SGD's momentum
  buffers, AdamW's two moments and its ``step`` scalars),
* the model's buffers (BatchNorm running statistics and counters),
* the K-FAC state the preconditioner reports (factors, decompositions and the
  peak of pending batch factors), category by category,

as the bytes of each distinct storage (``numel x element_size`` of a tensor
that owns its storage), counting each storage once, so a parameter shared
between modules, or a tensor that is a view of another, is not counted twice.

What is *not* in the tally: activations saved for backward and other
transient tensors (the autograd graph, fused communication buckets, the
allocator's cache). Those exist only during a step, so a tally read between
steps cannot see them; on CUDA :func:`cuda_peak_bytes` (the allocator's peak
since :func:`reset_cuda_peak`) covers them, and the cost model estimates the
activations (:func:`dpkfac.costmodel.memory.activation_bytes`). Nor is a DDP
wrapper's own bucket copy of the gradients, which is persistent unless DDP is
built with ``gradient_as_bucket_view=True`` (as
``experiments.distributed.wrap_ddp`` does): then the gradients are views of
the buckets, and the tally's gradients are the buckets, counted once.

The cost model predicts the same :class:`ProcessMemory` from shapes
(:func:`dpkfac.costmodel.memory.predict_process_memory`), field by field.
This module sits on the runtime's lower floor (beside :mod:`dpkfac.stats`):
it reads the preconditioner through its public ``memory_usage()`` only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

__all__ = [
    "MemoryReporter",
    "ProcessMemory",
    "cuda_peak_bytes",
    "process_memory",
    "reset_cuda_peak",
]


class MemoryReporter(Protocol):
    """Anything reporting its own state like ``KFACPreconditioner.memory_usage()``."""

    def memory_usage(self) -> Mapping[str, int]:
        """``factors_bytes``, ``decompositions_bytes`` and ``buffers_bytes``."""
        ...


@dataclass(frozen=True)
class ProcessMemory:
    """Bytes a training process holds between steps, by what holds them.

    Attributes:
        parameters: the model's parameters.
        gradients: their ``.grad`` tensors (those that exist).
        optimizer: every tensor in the optimizer's state.
        module_buffers: the model's buffers (``named_buffers()``).
        kfac_factors: K-FAC running factors (``factors_bytes``).
        kfac_decompositions: K-FAC decompositions (``decompositions_bytes``).
        kfac_buffers: peak of pending batch factors (``buffers_bytes``).
    """

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    module_buffers: int = 0
    kfac_factors: int = 0
    kfac_decompositions: int = 0
    kfac_buffers: int = 0

    @property
    def kfac(self) -> int:
        """K-FAC's share: the total of ``memory_usage()``."""
        return self.kfac_factors + self.kfac_decompositions + self.kfac_buffers

    @property
    def model(self) -> int:
        """What plain data parallelism holds too: parameters, gradients, optimizer, buffers."""
        return self.parameters + self.gradients + self.optimizer + self.module_buffers

    @property
    def total(self) -> int:
        """Every byte of the tally."""
        return self.model + self.kfac

    def as_dict(self) -> dict[str, int]:
        """The fields plus ``kfac`` and ``total``, as a benchmark record stores them."""
        return {**asdict(self), "kfac": self.kfac, "total": self.total}

    @classmethod
    def with_kfac(cls, kfac: Mapping[str, int] | None, **model: int) -> ProcessMemory:
        """A tally from ``memory_usage()``'s dict (None: no preconditioner) and the rest."""
        kfac = kfac or {}
        return cls(
            **model,
            kfac_factors=int(kfac.get("factors_bytes", 0)),
            kfac_decompositions=int(kfac.get("decompositions_bytes", 0)),
            kfac_buffers=int(kfac.get("buffers_bytes", 0)),
        )


class _Tally:
    """Bytes of distinct storages; the first category to meet a storage owns it.

    A storage is keyed by its device and address. Meta tensors have no
    address (every one reports 0), so they are keyed by the tensor object
    itself and counted whole: nothing on ``meta`` is shared or a view unless
    it is the very same tensor.
    """

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def count(self, tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            if t.device.type == "meta":
                key, nbytes = ("meta", id(t)), t.numel() * t.element_size()
            else:
                storage = t.untyped_storage()
                key, nbytes = (str(t.device), storage.data_ptr()), storage.nbytes()
                if nbytes == 0:
                    continue
            if key not in self._seen:
                self._seen.add(key)
                total += nbytes
        return total


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def process_memory(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    preconditioner: MemoryReporter | None = None,
) -> ProcessMemory:
    """The exact tally of what this process holds for training (see the module docstring).

    Read it between steps (after ``optimizer.step()``): the optimizer's state
    exists from its first step on, and gradients until ``zero_grad``.

    Args:
        model: the model (a ``DistributedDataParallel`` wrapper is unwrapped:
            its parameters are the module's).
        optimizer: its optimizer, or None.
        preconditioner: whatever reports K-FAC state with ``memory_usage()``
            (a :class:`dpkfac.KFACPreconditioner`), or None.

    Returns:
        Bytes by category; a storage is counted once, in the first category
        that holds it (parameters, gradients, optimizer, buffers).
    """
    inner = getattr(model, "module", model)
    tally = _Tally()
    params = list(inner.parameters())  # each shared parameter once already
    return ProcessMemory.with_kfac(
        preconditioner.memory_usage() if preconditioner is not None else None,
        parameters=tally.count(params),
        gradients=tally.count(p.grad for p in params),
        optimizer=tally.count(_state_tensors(optimizer)) if optimizer is not None else 0,
        module_buffers=tally.count(inner.buffers()),
    )


def cuda_peak_bytes(device: torch.device | str) -> int | None:
    """The CUDA allocator's peak bytes on ``device`` since the last reset; None off CUDA.

    Never calls a CUDA API for another device type, so CPU runs (and
    machines without CUDA) are untouched.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def reset_cuda_peak(device: torch.device | str) -> None:
    """Start a new peak on ``device`` (a step's own); nothing off CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
