"""Process-group setup and the few collectives the experiments layer needs.

The library (dpkfac) does the gradient and K-FAC communication; this module
only starts and stops the process group that torchrun describes through its
environment variables, and moves Python objects (tokenizers, RNG states,
evaluation outputs, a run directory) between ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the run.

    Attributes:
        rank: Global rank.
        world_size: Number of processes.
        local_rank: Rank on this node (picks the GPU).
        device: The device this rank computes on.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        """Whether this rank logs, shows progress and writes checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether collectives are needed (a process group with more than one rank)."""
        return self.world_size > 1

    def barrier(self) -> None:
        """Wait for all ranks; a no-op in a single process."""
        if self.distributed:
            dist.barrier()

    def broadcast_object(self, obj: T | None, src: int = 0) -> T:
        """Return rank ``src``'s ``obj`` on every rank (picklable objects only)."""
        if not self.distributed:
            return obj  # type: ignore[return-value]
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]  # type: ignore[return-value]

    def all_gather_objects(self, obj: T) -> list[T]:
        """Return every rank's ``obj``, ordered by rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a tensor over ranks (returns a new tensor)."""
        value = value.detach().clone()
        if self.distributed:
            dist.all_reduce(value)
            value /= self.world_size
        return value


def _pick_device(setting: str, local_rank: int) -> torch.device:
    """Resolve ``trainer.device``: ``auto`` means this rank's GPU when there is one."""
    if setting == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    device = torch.device(setting)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
    return device


@contextlib.contextmanager
def distributed_context(device: str = "auto", timeout_s: float = 600.0) -> Iterator[DistEnv]:
    """Join the process group torchrun describes, and leave it on exit.

    Without torchrun's variables (``WORLD_SIZE``) the run is a single process and no
    group is created, so the same code path serves both. The backend follows the
    device: NCCL for CUDA, gloo otherwise. The timeout bounds every collective, so
    a crashed peer ends the run instead of hanging it.

    Args:
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        timeout_s: Seconds before a collective gives up.

    Yields:
        This process's place in the run.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch_device = _pick_device(device, local_rank)
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        yield DistEnv(rank, world_size, local_rank, torch_device)
        return
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    backend = "nccl" if torch_device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=torch_device if backend == "nccl" else None,
    )
    try:
        yield DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, torch_device)
    finally:
        dist.destroy_process_group()


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model inside a DistributedDataParallel wrapper (or the model itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def broadcast_buffers(model: nn.Module, env: DistEnv) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics and the like).

    Without DDP each rank updates running statistics from its own batches, so
    replicas would evaluate differently; DDP's default is the same rule (rank 0's
    buffers win), applied here before evaluation and checkpoints.
    """
    if not env.distributed:
        return
    for buffer in unwrap(model).buffers():
        dist.broadcast(buffer, src=0)


def parameter_digest(model: nn.Module) -> str:
    """A hash of all parameters and buffers, to compare replicas bitwise."""
    digest = hashlib.sha256()
    for name, tensor in unwrap(model).state_dict().items():
        digest.update(name.encode())
        digest.update(
            tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
    return digest.hexdigest()


def check_replicas(model: nn.Module, env: DistEnv) -> None:
    """Raise if the ranks' parameters differ in any bit.

    Every strategy promises bitwise-identical replicas after each step; checking it
    at the end of every distributed run turns a silent divergence into an error.
    """
    if not env.distributed:
        return
    digests = env.all_gather_objects(parameter_digest(model))
    if len(set(digests)) != 1:
        differing = [r for r, d in enumerate(digests) if d != digests[0]]
        raise RuntimeError(f"model replicas diverged: ranks {differing} differ from rank 0")
