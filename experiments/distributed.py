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
import itertools
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from experiments.config import ExperimentError

T = TypeVar("T")


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which a scheduler may narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def threads_per_rank(setting: int | str, local_ranks: int | None = None) -> int:
    """The intra-op threads one rank of a run should use.

    Several ranks on one machine, each with torch's default pool (a thread
    per core), oversubscribe the cores many times over: the default digits
    run took 73-115 s that way on two shared cores, and 4.9 s with one thread
    per rank. ``"auto"`` takes ``OMP_NUM_THREADS`` where it is set (the
    per-process count a user, a batch scheduler or torchrun with several local
    ranks chose: overriding it put a 2-thread pool beside another job on two
    cores, where one MNIST-1D MLP epoch took 67-77 s against 3.5 s with one
    thread, OpenMP's barriers waiting on a descheduled thread).
    Otherwise it divides the cores among the ranks this node runs side by side
    (torchrun's ``LOCAL_WORLD_SIZE``); ranks of ``launcher=threads`` compute
    one after another, so they count as one.

    Args:
        setting: ``trainer.threads``: ``"auto"`` or a positive integer.
        local_ranks: Ranks computing side by side on this node (default: from
            torchrun's environment, 1 outside it).
    """
    if setting != "auto":
        return int(setting)
    chosen = os.environ.get("OMP_NUM_THREADS", "").strip()
    if chosen.isdigit() and int(chosen) > 0:
        return int(chosen)
    if local_ranks is None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, available_cores() // max(1, local_ranks))


#: Process groups this process has created (each gets its own keys in torchrun's store).
_GROUPS = itertools.count()


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

    def gather_objects(self, obj: T, dst: int = 0) -> list[T] | None:
        """Every rank's ``obj`` on rank ``dst``, ordered by rank; ``None`` elsewhere.

        Prefer it to :meth:`all_gather_objects` when one rank consumes the result:
        P pickles are unpickled once, not P times (P**2 in all), which dominates
        evaluation and checkpoints when hundreds of ranks share one process.
        """
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def all_gather_objects(self, obj: T) -> list[T]:
        """Return every rank's ``obj``, ordered by rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a tensor over ranks (returns a new tensor, on ``value``'s device).

        One all-reduce, whatever the tensor's size: pack several values into one
        tensor rather than reducing each (a collective of ``launcher=threads`` is a
        rendezvous of every rank).
        """
        if not self.distributed:
            return value.detach().clone()
        return self._all_reduced(value).to(value.device)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """Average a tensor over ranks (returns a new tensor, on ``value``'s device)."""
        if not self.distributed:
            return value.detach().clone()
        work = self._all_reduced(value)
        work /= self.world_size
        return work.to(value.device)

    def _all_reduced(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of ``value`` over ranks, a new tensor on this rank's device.

        Reduced on this rank's device: NCCL accepts only CUDA tensors of the rank's GPU.
        """
        work = value.detach().to(self.device, copy=True)
        dist.all_reduce(work)
        return work


def _pick_device(setting: str, local_rank: int) -> torch.device:
    """Resolve ``trainer.device``: ``auto`` means this rank's GPU when there is one.

    Raises:
        ExperimentError: CUDA is asked for but absent, or the GPU index does not exist
            (named in one line instead of a crash deep inside torch).
    """
    if setting == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    try:
        device = torch.device(setting)
    except (RuntimeError, TypeError) as err:
        raise ExperimentError(
            f"invalid value trainer.device={setting!r}: expected auto, cpu, cuda or cuda:N ({err})"
        ) from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ExperimentError(
                f"trainer.device={setting} but CUDA is not available on this machine; use "
                "trainer.device=auto (a GPU where there is one, else the CPU) or "
                "trainer.device=cpu"
            )
        count = torch.cuda.device_count()
        if device.index is None:
            device = torch.device("cuda", local_rank % count)
        elif device.index >= count:
            raise ExperimentError(
                f"trainer.device={setting} but this machine has {count} CUDA device(s)"
            )
    return device


@contextlib.contextmanager
def deadline(phase: str, seconds: float, rank: int | str) -> Iterator[None]:
    """End the process if the block has not finished within ``seconds``.

    Some waits have no timeout of their own that reliably fires: joining a
    rendezvous whose peer died, or the first collective on a half-built group.
    A hung rank would keep an elastic agent (torchrun) from noticing anything,
    so a watchdog thread prints one line naming the phase and the rank and
    calls ``os._exit(1)``: the agent then sees a failed worker and restarts
    the group or gives up, instead of waiting forever.

    Args:
        phase: What is being waited for, for the message (``init_process_group``).
        seconds: The bound.
        rank: This process's rank (from the environment before a group exists).
    """
    done = threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        print(
            f"error: {phase} did not finish within {seconds:g} s on rank {rank}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    watchdog = threading.Thread(target=watch, name=f"deadline:{phase}", daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        done.set()
        watchdog.join()


def _attempt_store(timeout: datetime.timedelta) -> dict[str, Any]:
    """``init_process_group`` arguments that keep torchrun's restarts apart, or none.

    torchrun's workers share the elastic agent's store, which outlives a restart of
    the workers; torch writes the process group's keys (gloo's peer addresses among
    them) under the same names on every attempt, so a restarted rank can read the
    previous attempt's addresses and fail connecting to peers that no longer exist.
    Under torchrun the store is therefore opened here and every key put under
    ``attempt_<TORCHELASTIC_RESTART_COUNT>/group_<n>/``, n counting the groups
    this process has created: the jobs of a Hydra sweep run one after another in
    the same processes, and a job that read the previous job's gloo addresses
    (same keys, same store) would wait on sockets that are gone, a hang seen in
    half of the sweeps before. Every rank runs the same jobs in the same order,
    so their counts agree. Elsewhere nothing changes.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return {}
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    job = next(_GROUPS)
    prefixed = dist.PrefixStore(f"dpkfac/attempt_{attempt}/group_{job}/default_pg", store)
    return {"store": prefixed, "rank": rank, "world_size": world_size}


@contextlib.contextmanager
def distributed_context(
    device: str = "auto", timeout_s: float = 600.0, job: str | None = None
) -> Iterator[DistEnv]:
    """Join the process group torchrun describes, and leave it on exit.

    Without torchrun's variables (``WORLD_SIZE``) the run is a single process and no
    group is created, so the same code path serves both. The backend follows the
    device: NCCL for CUDA, gloo otherwise. The timeout bounds every collective, so
    a crashed peer ends the run instead of hanging it; joining and leaving the group
    are bounded by the same timeout through :func:`deadline`, so a restart by
    torchrun never hangs on a peer that did not come back.

    Args:
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        timeout_s: Seconds before a collective gives up, and the bound on joining
            and leaving the group.
        job: What this process runs (a sweep's job number and overrides): every
            rank must run the same, which is checked once the group exists.

    Yields:
        This process's place in the run.

    Raises:
        ExperimentError: The ranks disagree on the job (their sweeps differ).
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
    rank = os.environ.get("RANK", "?")
    timeout = datetime.timedelta(seconds=timeout_s)
    with deadline("init_process_group", timeout_s, rank):
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            device_id=torch_device if backend == "nccl" else None,
            **_attempt_store(timeout),
        )
    try:
        env = DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, torch_device)
        if job is not None:
            _check_same_job(env, job)
        yield env
    finally:
        with deadline("destroy_process_group", timeout_s, rank):
            dist.destroy_process_group()


def _check_same_job(env: DistEnv, job: str) -> None:
    """Fail fast, on every rank, when the ranks run different jobs (different sweeps)."""
    jobs = env.all_gather_objects(job)
    if len(set(jobs)) > 1:
        listed = "; ".join(f"rank {r}: {j!r}" for r, j in enumerate(jobs))
        raise ExperimentError(
            f"the ranks run different jobs ({listed}): start every rank with the same "
            "command line (the same sweep)"
        )


def wrap_ddp(
    model: nn.Module, device: torch.device, bucket_cap_mb: float | None = None
) -> nn.parallel.DistributedDataParallel:
    """``model`` in DistributedDataParallel, bucketed as the cost model prices it.

    ``bucket_cap_mb`` at DDP's default (25 MiB, or None) is left unset, so
    DDP keeps its small first bucket; any other cap is passed on, and then
    the first bucket has that cap too (torch's rule, mirrored by
    :func:`dpkfac.plan.fusion.ddp_first_cap`, which the prediction of plain
    data parallelism uses).

    Gradients are views of DDP's buckets (``gradient_as_bucket_view``): by
    default DDP keeps a second, persistent gradient-sized copy in its buckets.
    As views, the process holds one copy, so the whole-process tally
    (:func:`dpkfac.process_memory`) is what it really holds and matches the
    cost model's. It is not a speed choice: with ``zero_grad(set_to_none=True)``
    DDP still copies each gradient into its bucket, and measured interleaved
    (ResNet-32, two gloo ranks on this CPU, batch 16 and 32) views and copies
    differed by less than the run-to-run spread (-5% to +8%). The
    preconditioner writes its updates into ``.grad`` in place, which keeps the
    views intact.
    """
    from dpkfac.plan.fusion import DDP_DEFAULT_CAP_BYTES

    kwargs: dict[str, Any] = {}
    if bucket_cap_mb is not None and int(bucket_cap_mb * 2**20) != DDP_DEFAULT_CAP_BYTES:
        kwargs["bucket_cap_mb"] = bucket_cap_mb
    device_ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(
        model, device_ids=device_ids, gradient_as_bucket_view=True, **kwargs
    )


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
