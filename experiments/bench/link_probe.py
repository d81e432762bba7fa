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
  as a phase's least wait), the median over repeats; broadcasts one per root,
  launched through the communicator together, as a step's owners and decomposers
  broadcast their shares (a lone root returns once its bytes are in the socket's
  buffers, before the transfer: probes recorded before this, without ``calls``,
  timed that). Probes recorded before the roots' calls took turns launched each
  root's broadcast whole, and the two crossed on the links only sometimes: 16 MiB
  from each of two ranks took 139 ms in some jobs and 247 ms in others at 1 Gbit/s.

They take well under a second per job on loopback (a few seconds on a 1 Gbit/s
emulated link) and are stored in the job's rows
(``link_probes``). :func:`experiments.bench.predict.probe_links` fits them;
the scaling table's held-out predictions take their links from the probes of
the world size they predict, never from that world size's phase timings. On an
emulated network (:mod:`experiments.network`) they time that network at the job's
rate, and are all the network table's predictions take from the run.

There, every job also measures the highest rate the host carries faithfully
(:func:`faithful_rate`): above some rate the cores cannot push the bytes through
veth, bridge and gloo fast enough, and an "emulated" 10 Gbit/s link is really a
few. Each node reshapes its link along a ladder of rates and times a 16 MiB
all-reduce at each; the job's rate is restored before anything else runs.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dpkfac.comm import Communicator
from dpkfac.plan.hardware import wire_bytes
from experiments.network import NodeLink

__all__ = [
    "FAITHFUL_LADDER",
    "LINK_PROBE_KINDS",
    "LINK_PROBE_NUMELS",
    "faithful_rate",
    "highest_faithful",
    "network_record",
    "probe_links",
    "sync",
]

#: Collective kinds probed (those of the strategies the tables measure on gloo).
LINK_PROBE_KINDS = ("allreduce", "broadcast")
#: float32 elements per probe: 64 KiB, 2 MiB and 16 MiB buffers, the range of a step's buffers
#: (per-layer broadcasts, gradient buckets, fused factors under the 25 MiB cap).
LINK_PROBE_NUMELS = (16384, 524288, 4194304)
#: Timed repeats per kind and size (after one untimed).
LINK_PROBE_REPEATS = 7
#: Bytes of scratch memory written before each probe (beyond this machine's caches).
FLUSH_BYTES = 64 * 2**20


#: Rates (bits/s) of the faithful-rate ladder, the float32 elements timed at each (16 MiB),
#: its timed repeats, and how much slower than its wire time an all-reduce may be and
#: still count as carried faithfully.
FAITHFUL_LADDER = (5 * 10**8, 10**9, 2 * 10**9, 3 * 10**9, 4 * 10**9, 6 * 10**9, 10**10)
FAITHFUL_NUMEL = 4 * 2**20
FAITHFUL_REPEATS = 3
FAITHFUL_TOLERANCE = 1.15


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def evict(scratch: torch.Tensor, device: torch.device) -> None:
    """Write ``scratch`` (at least the caches' size) and wait: what a timed call then
    touches comes from memory, as after another strategy's step."""
    scratch.add_(1.0)
    sync(device)


def _every_root_broadcasts() -> Callable[[torch.Tensor], object]:
    """One broadcast rooted at every rank, each of its own ``1/P`` of the buffer, launched as a
    step's owners and decomposers launch theirs (:meth:`dpkfac.comm.Communicator.together`:
    on gloo cut into message calls, the roots' calls taking turns) and waited for."""
    comm = Communicator()

    def run(buf: torch.Tensor) -> None:
        with comm.together():
            handles = [
                comm.broadcast([part], root, "setup", async_op=True)
                for root, part in enumerate(buf.chunk(comm.size))
            ]
        for handle in handles:
            comm.wait(handle)

    return run


def _op(kind: str) -> Callable[[torch.Tensor], object]:
    if kind == "allreduce":
        return dist.all_reduce
    if kind == "broadcast":
        return _every_root_broadcasts()
    raise ValueError(f"unknown probe kind {kind!r}; expected one of {LINK_PROBE_KINDS}")


def _timed(
    op: Callable[[torch.Tensor], object],
    numel: int,
    repeats: int,
    device: torch.device,
    scratch: torch.Tensor,
) -> float:
    """Median over ``repeats`` (after one untimed) of the least time over ranks of ``op``
    on a fresh buffer of ``numel`` elements."""
    times = []
    for _ in range(repeats + 1):
        buf = torch.ones(numel, device=device)
        evict(scratch, device)
        dist.barrier()
        start = time.perf_counter()
        op(buf)
        sync(device)
        times.append(time.perf_counter() - start)
    least = torch.tensor(times[1:], dtype=torch.float64, device=device)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return statistics.median(least.tolist())


def probe_links(
    device: torch.device,
    *,
    kinds: tuple[str, ...] = LINK_PROBE_KINDS,
    numels: tuple[int, ...] = LINK_PROBE_NUMELS,
    repeats: int = LINK_PROBE_REPEATS,
) -> list[dict[str, Any]]:
    """Time each kind and size on the default group; every rank calls it and gets the same list.

    A broadcast is timed as a step meets its broadcasts: every rank roots one, of
    ``4 * numel`` bytes each, all launched together as the step launches them and waited
    for on every rank (:func:`_every_root_broadcasts`): gloo's binomial tree returns on a
    root once its bytes are in the socket's buffers, so a lone root's time is not the
    transfer's, while a rank that also receives waits for the link.

    Returns:
        One entry per (kind, size): ``kind``, ``nbytes`` (one buffer), ``seconds`` (median
        over repeats of the least time over ranks), ``world_size`` and ``calls`` (the
        collectives timed together: ``P`` broadcasts, one all-reduce). Empty without a
        process group of more than one rank.
    """
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return []
    p = dist.get_world_size()
    scratch = torch.zeros(FLUSH_BYTES // 4, device=device)
    out = []
    for kind in kinds:
        calls = p if kind == "broadcast" else 1
        for n in numels:
            seconds = _timed(_op(kind), calls * n, repeats, device, scratch)
            entry = {"kind": kind, "nbytes": 4 * n, "seconds": seconds, "world_size": p}
            out.append({**entry, "calls": calls})
    return out


def faithful_rate(
    device: torch.device,
    link: NodeLink,
    *,
    ladder: Sequence[int] = FAITHFUL_LADDER,
    numel: int = FAITHFUL_NUMEL,
    repeats: int = FAITHFUL_REPEATS,
) -> dict[str, Any]:
    """The highest rate of ``ladder`` this host carries faithfully, on the job's own network.

    At each rate every node's link (both ends) is reshaped by its first local rank and an
    all-reduce of ``numel`` floats is timed as :func:`probe_links` times one. A rate is
    faithful when that takes at most :data:`FAITHFUL_TOLERANCE` times its wire bytes at the
    rate; the answer is the highest rate below which every rung was faithful (0: not even
    the lowest). The link's own rate is restored before returning, also on error.

    Returns:
        ``faithful_bps`` and ``ladder``: per rung ``rate_bps``, ``seconds`` and
        ``wire_seconds`` (the buffer's wire bytes at the rate).
    """
    p = dist.get_world_size()
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    scratch = torch.zeros(FLUSH_BYTES // 4, device=device)
    rungs = []
    try:
        for rate in ladder:
            if first:
                link.set_rate(int(rate))
            dist.barrier()
            seconds = _timed(dist.all_reduce, numel, repeats, device, scratch)
            wire = wire_bytes("allreduce", 4 * numel, p) * 8 / rate
            rungs.append({"rate_bps": int(rate), "seconds": seconds, "wire_seconds": wire})
    finally:
        if first:
            link.set_rate(link.rate_bps)
        dist.barrier()
    return {"faithful_bps": highest_faithful(rungs), "ladder": rungs}


def highest_faithful(rungs: Sequence[dict[str, Any]], tolerance: float = FAITHFUL_TOLERANCE) -> int:
    """The highest ``rate_bps`` of the ladder (in order) below which every rung, itself
    included, took at most ``tolerance`` times its ``wire_seconds`` (0: not the first)."""
    faithful = 0
    for rung in rungs:
        if rung["seconds"] > tolerance * rung["wire_seconds"]:
            break
        faithful = int(rung["rate_bps"])
    return faithful


def network_record(link: NodeLink | None, faithful: dict[str, Any] | None) -> dict[str, Any]:
    """What a job's rows record of its network: loopback, or the emulated rate and the
    faithful maximum measured on it (:func:`faithful_rate`'s answer and ladder)."""
    if link is None:
        return {"network": "loopback", "network_rate_bps": None, "network_faithful_bps": None,
                "network_probe": None}  # fmt: skip
    return {
        "network": "emulated",
        "network_rate_bps": link.rate_bps,
        "network_faithful_bps": faithful["faithful_bps"] if faithful else None,
        "network_probe": faithful["ladder"] if faithful else None,
    }
