"""Link probes at the start of a benchmark job: each collective timed as a training step meets it.

The cost model's links are alpha-beta fits. Fitted to a job's own phase
timings they describe that job well, but then they cannot be used to check
the model on the job ("held out"). Micro-benchmarks of the machine's links
can, if they time the collectives the way a step meets them; a tight loop on
one hot buffer does not (in a step the buffer was just written by compute
and the ranks were just apart), and on this machine it under-predicts
in-step communication by 30-50%. So each job of the benchmark starts with a
few probes in the step's conditions:

* a fresh buffer per call, and a large scratch buffer touched first, so the
  collective reads memory the caches do not hold;
* the ranks meet at a barrier first, as ``isolate_comm`` makes them meet
  before each communication phase;
* one collective at a time, timed to completion, and per repeat the least
  time over ranks (the rank that arrived last waited only for the transfer,
  as a phase's least wait), the median over repeats.

They take well under a second per job and are stored in the job's rows
(``link_probes``). :func:`experiments.bench.predict.probe_links` fits them;
the scaling table's held-out predictions take their links from the probes of
the world size they predict, never from that world size's phase timings.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LINK_PROBE_KINDS", "LINK_PROBE_NUMELS", "probe_links", "sync"]

#: Collective kinds probed (those of the strategies the tables measure on gloo).
LINK_PROBE_KINDS = ("allreduce", "broadcast")
#: float32 elements per probe: 64 KiB, 2 MiB and 16 MiB buffers, the range of a step's buffers
#: (per-layer broadcasts, gradient buckets, fused factors under the 25 MiB cap).
LINK_PROBE_NUMELS = (16384, 524288, 4194304)
#: Timed repeats per kind and size (after one untimed).
LINK_PROBE_REPEATS = 7
#: Bytes of scratch memory written before each probe (beyond this machine's caches).
FLUSH_BYTES = 64 * 2**20


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _op(kind: str) -> Callable[[torch.Tensor], object]:
    if kind == "allreduce":
        return dist.all_reduce
    if kind == "broadcast":
        return lambda t: dist.broadcast(t, src=0)
    raise ValueError(f"unknown probe kind {kind!r}; expected one of {LINK_PROBE_KINDS}")


def probe_links(
    device: torch.device,
    *,
    kinds: tuple[str, ...] = LINK_PROBE_KINDS,
    numels: tuple[int, ...] = LINK_PROBE_NUMELS,
    repeats: int = LINK_PROBE_REPEATS,
) -> list[dict[str, Any]]:
    """Time each kind and size on the default group; every rank calls it and gets the same list.

    Returns:
        One entry per (kind, size): ``kind``, ``nbytes`` (the buffer),
        ``seconds`` (median over repeats of the least time over ranks) and
        ``world_size``. Empty without a process group of more than one rank.
    """
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return []
    p = dist.get_world_size()
    scratch = torch.zeros(FLUSH_BYTES // 4, device=device)
    out = []
    for kind in kinds:
        op = _op(kind)
        for n in numels:
            times = []
            for _ in range(repeats + 1):
                buf = torch.ones(n, device=device)
                scratch.add_(1.0)
                sync(device)
                dist.barrier()
                start = time.perf_counter()
                op(buf)
                sync(device)
                times.append(time.perf_counter() - start)
            least = torch.tensor(times[1:], dtype=torch.float64, device=device)
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
            seconds = statistics.median(least.tolist())
            out.append({"kind": kind, "nbytes": 4 * n, "seconds": seconds, "world_size": p})
    return out
