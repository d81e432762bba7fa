"""Tensor fusion plans: which consecutive tensors share one collective.

Pure functions on ready times and byte sizes, no ``torch``. SPD-KFAC launches
each Kronecker factor's all-reduce as soon as the factor exists (A in the
forward hook, G in the backward hook). One collective per factor pays the
start-up latency ``alpha`` many times; one collective for all factors waits
for the last one and overlaps nothing. :func:`plan_buckets` implements the
dynamic fusion rule of SPD-KFAC (after MG-WFBP) between these extremes, under
the alpha-beta model ``t(n) = alpha + beta * n`` (:class:`CommModel`).

The timing model used throughout (:func:`bucket_schedule`): buckets are
consecutive runs of tensors, communicated one at a time in order. A bucket
starts when its last tensor is ready and the previous bucket has finished,
and takes ``model.time(sum of its bytes)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ALONE_BYTES",
    "DDP_DEFAULT_CAP_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "IN_PLACE_KINDS",
    "CommModel",
    "bucket_schedule",
    "ddp_buckets",
    "ddp_first_cap",
    "fused_buckets",
    "plan_buckets",
    "shard_rounds",
    "simulate",
    "size_cap_buckets",
    "travels_alone",
]

#: A tensor of at least this many bytes travels alone, in its own storage, wherever the
#: communicator would fuse it (:func:`fused_buckets`): gathering it into a flat buffer
#: and copying the result back are two passes over its bytes on the critical path (BERT's
#: word embedding gradient, 23 MB at a quarter of BERT-base's size: about 4 ms on a CPU
#: core before the all-reduce can start, as much after it), and one more collective costs
#: one start-up latency, which a GPU's memory outruns only below a few MB.
ALONE_BYTES = 8 * 2**20


@dataclass
class CommModel:
    """Alpha-beta model of one collective.

    Attributes:
        alpha: Start-up latency per collective, in seconds.
        beta: Seconds per byte (inverse bandwidth, including the collective's
            algorithmic factor, e.g. ``2 (P-1) / P`` for a ring all-reduce).
    """

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.beta >= 0):
            raise ValueError(f"alpha and beta must be >= 0, got {self.alpha}, {self.beta}")

    def time(self, nbytes: float) -> float:
        """Predicted seconds for one collective over ``nbytes`` bytes."""
        return self.alpha + self.beta * nbytes


def _check_inputs(ready_times: Sequence[float], sizes_bytes: Sequence[int]) -> None:
    if len(ready_times) != len(sizes_bytes):
        raise ValueError(f"{len(ready_times)} ready times for {len(sizes_bytes)} sizes")
    for i in range(1, len(ready_times)):
        if ready_times[i] < ready_times[i - 1]:
            raise ValueError(f"ready_times must be non-decreasing (index {i})")
    if any(s < 0 for s in sizes_bytes):
        raise ValueError("sizes must be >= 0")


def _check_partition(buckets: Sequence[Sequence[int]], n: int) -> None:
    flat = [i for b in buckets for i in b]
    if flat != list(range(n)) or any(len(b) == 0 for b in buckets):
        raise ValueError("buckets must be non-empty runs of consecutive indices covering 0..n-1")


def bucket_schedule(
    buckets: Sequence[Sequence[int]],
    ready_times: Sequence[float],
    sizes_bytes: Sequence[int],
    model: CommModel,
) -> list[tuple[float, float]]:
    """``(start, finish)`` of each bucket's collective under the timing model.

    A bucket starts at ``max(ready time of its last tensor, finish of the
    previous bucket)`` and lasts ``model.time(its bytes)``.
    """
    _check_inputs(ready_times, sizes_bytes)
    _check_partition(buckets, len(ready_times))
    out: list[tuple[float, float]] = []
    prev_finish = -math.inf
    for b in buckets:
        start = max(ready_times[b[-1]], prev_finish)
        prev_finish = start + model.time(sum(sizes_bytes[i] for i in b))
        out.append((start, prev_finish))
    return out


def simulate(
    buckets: Sequence[Sequence[int]],
    ready_times: Sequence[float],
    sizes_bytes: Sequence[int],
    model: CommModel,
) -> float:
    """Finish time of the last collective (0.0 when there are no tensors)."""
    schedule = bucket_schedule(buckets, ready_times, sizes_bytes, model)
    return schedule[-1][1] if schedule else 0.0


def plan_buckets(
    ready_times: Sequence[float],
    sizes_bytes: Sequence[int],
    model: CommModel,
) -> list[list[int]]:
    """SPD-KFAC's greedy dynamic tensor fusion (after MG-WFBP).

    Walk the tensors in the order they become ready, keeping a current
    bucket that holds the tensors merged so far. With the schedule
    recomputed from the current bucket (after every merge):

    * ``start`` = max(ready time of the bucket's last tensor, finish of
      the previous, already closed bucket),
    * ``finish`` = ``start + model.time(bucket bytes)``,

    the next tensor, ready at ``r``, is merged into the current bucket iff
    ``r < finish`` (it is ready before the current collective would end)
    and either

    1. ``r < start``: the current bucket is still queued behind the previous
       collective when the next tensor arrives, so merging delays nothing
       and saves one ``alpha``; or
    2. ``r - start < alpha``: delaying the current collective until the next
       tensor is ready costs less than the start-up latency it saves.

    Otherwise the current bucket is closed and the next tensor opens a new
    one. This is the reference rule (shyhuai/kfac_pytorch); note that (2)
    implies ``r < finish``, and that for the pair (current bucket, next
    tensor) it merges exactly when merging does not delay the pair's
    finish. By induction over the walk, the plan never finishes later than
    one bucket per tensor nor than one single bucket (the current bucket's
    finish stays within tensor ``i``'s separate finish and within
    ``ready[i] + alpha + beta * bytes[0..i]``). It is still greedy, not
    optimal (the tests compare it with an exact dynamic program).

    Args:
        ready_times: When each tensor is ready, non-decreasing, in the order
            the tensors are produced.
        sizes_bytes: Bytes each tensor sends.
        model: The communication model.

    Returns:
        Buckets of consecutive indices covering every tensor exactly once.
    """
    _check_inputs(ready_times, sizes_bytes)
    n = len(ready_times)
    if n == 0:
        return []
    buckets: list[list[int]] = []
    current = [0]
    current_bytes = sizes_bytes[0]
    prev_finish = -math.inf
    for i in range(1, n):
        start = max(ready_times[current[-1]], prev_finish)
        finish = start + model.time(current_bytes)
        r = ready_times[i]
        if r < finish and (r < start or r - start < model.alpha):
            current.append(i)
            current_bytes += sizes_bytes[i]
            continue
        buckets.append(current)
        prev_finish = finish
        current = [i]
        current_bytes = sizes_bytes[i]
    buckets.append(current)
    return buckets


#: DDP's first bucket cap when ``bucket_cap_mb`` is left at its default
#: (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``).
DDP_FIRST_BUCKET_BYTES = 2**20
#: DDP's default ``bucket_cap_mb`` in bytes (25 MiB), also the preconditioner's default cap.
DDP_DEFAULT_CAP_BYTES = 25 * 2**20


def ddp_first_cap(cap_bytes: int) -> int:
    """The first bucket's limit of the DDP this project builds for a bucket cap.

    A run wraps its model in DDP with ``bucket_cap_mb`` left unset when the
    cap is DDP's default (then DDP's small first bucket applies) and with the
    cap otherwise (then the first bucket has the cap too), as torch decides;
    :func:`experiments.distributed.wrap_ddp` is the runtime half.
    """
    return DDP_FIRST_BUCKET_BYTES if cap_bytes == DDP_DEFAULT_CAP_BYTES else cap_bytes


def ddp_buckets(
    sizes_bytes: Sequence[int], cap_bytes: int, first_cap_bytes: int | None = None
) -> list[list[int]]:
    """``DistributedDataParallel``'s buckets of gradients in the order they become ready.

    DDP's reducer (``compute_bucket_assignment_by_size``, as it rebuilds
    its buckets after the first iteration from the order the gradients were
    ready) adds each tensor to the open bucket and closes the bucket once it
    holds *at least* the limit: a bucket may exceed its cap by its last
    tensor, unlike :func:`size_cap_buckets`. The first bucket's limit is
    ``first_cap_bytes`` (1 MiB, :data:`DDP_FIRST_BUCKET_BYTES`, when
    ``bucket_cap_mb`` is not given; the cap otherwise), every later one's
    ``cap_bytes``. One dtype and device is assumed (DDP buckets them apart).

    Args:
        sizes_bytes: bytes of each gradient, in the order they become ready.
        cap_bytes: DDP's ``bucket_cap_mb`` in bytes, positive.
        first_cap_bytes: the first bucket's limit (None: ``cap_bytes``).

    Returns:
        Buckets of consecutive indices covering every tensor exactly once.
    """
    first = cap_bytes if first_cap_bytes is None else first_cap_bytes
    if cap_bytes <= 0 or first <= 0:
        raise ValueError(f"bucket caps must be > 0, got {first_cap_bytes}, {cap_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes, limit = 0, first
    for i, s in enumerate(sizes_bytes):
        if s < 0:
            raise ValueError(f"sizes must be >= 0, got {s} at {i}")
        current.append(i)
        current_bytes += s
        if current_bytes >= limit:
            buckets.append(current)
            current, current_bytes, limit = [], 0, cap_bytes
    if current:
        buckets.append(current)
    return buckets


def size_cap_buckets(sizes_bytes: Sequence[int], cap_bytes: int) -> list[list[int]]:
    """Consecutive bucketing under a byte cap (like DDP's ``bucket_cap_mb``).

    Tensors are added to the current bucket while its total stays within
    ``cap_bytes``; a tensor bigger than the cap gets a bucket of its own.

    Args:
        sizes_bytes: Bytes of each tensor, in order.
        cap_bytes: Largest bucket total, positive.

    Returns:
        Buckets of consecutive indices covering every tensor exactly once.
    """
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be > 0, got {cap_bytes}")
    if any(s < 0 for s in sizes_bytes):
        raise ValueError("sizes must be >= 0")
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i, s in enumerate(sizes_bytes):
        if current and current_bytes + s > cap_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += s
    if current:
        buckets.append(current)
    return buckets


def fused_buckets(sizes_bytes: Sequence[int], cap_bytes: int | None) -> list[list[int]]:
    """The fused buffers of one collective over tensors of ``sizes_bytes``, in order.

    Every tensor of at least :data:`ALONE_BYTES` is a bucket of its own
    (:func:`travels_alone`: the collective runs on its storage); the runs of
    smaller tensors between them are cut by :func:`size_cap_buckets` (one bucket
    per run where ``cap_bytes`` is None). The order of the tensors is kept, so
    every rank launches the same collectives in the same order.
    """
    if any(s < 0 for s in sizes_bytes):
        raise ValueError("sizes must be >= 0")
    buckets: list[list[int]] = []
    run: list[int] = []

    def close() -> None:
        if not run:
            return
        if cap_bytes is None:
            buckets.append(list(run))
        else:
            sizes = [sizes_bytes[i] for i in run]
            buckets.extend([run[j] for j in b] for b in size_cap_buckets(sizes, cap_bytes))
        run.clear()

    for i, s in enumerate(sizes_bytes):
        if s >= ALONE_BYTES:
            close()
            buckets.append([i])
        else:
            run.append(i)
    close()
    return buckets


#: The collectives whose buffer may be a tensor's own storage: every rank's buffer holds
#: the result. (A reduce may use a non-root's buffer as scratch, and the communicator leaves
#: those copies as they are.)
IN_PLACE_KINDS = ("allreduce", "broadcast")


def travels_alone(kind: str, bucket_bytes: Sequence[int]) -> bool:
    """Whether a bucket of :func:`fused_buckets` (its tensors' bytes) of a ``kind``
    collective is one tensor that travels in its own storage: nothing packed before the
    collective, nothing copied back after it (an average is divided where it lies)."""
    return kind in IN_PLACE_KINDS and len(bucket_bytes) == 1 and bucket_bytes[0] >= ALONE_BYTES


def shard_rounds(
    sizes_bytes: Sequence[Sequence[int]], cap_bytes: int | None
) -> list[list[list[int]]]:
    """Owner-contiguous rounds of a reduce-scatter or an all-gather, under a byte cap.

    ``sizes_bytes[r]`` are the bytes of the tensors rank ``r`` owns, in order. A
    round takes from every rank its next run of consecutive tensors within
    ``cap_bytes / P`` (:func:`size_cap_buckets`), so that the round's buffers
    stay within the cap. A rank with nothing left contributes an empty shard.

    Returns:
        Per round, per rank, the indices of that rank's tensors in the round.
    """
    world = len(sizes_bytes)
    if world == 0:
        return []
    runs = [
        [list(range(len(sizes)))]
        if cap_bytes is None
        else size_cap_buckets(sizes, max(1, cap_bytes // world))
        for sizes in sizes_bytes
    ]
    runs = [[run for run in r if run] for r in runs]
    rounds = max((len(r) for r in runs), default=0)
    return [[r[j] if j < len(r) else [] for r in runs] for j in range(rounds)]
