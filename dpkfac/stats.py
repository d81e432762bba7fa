"""Accounting of K-FAC work: seconds per phase, bytes and calls per collective category.

These back the inspection API (``comm_stats()``, ``timings()``) that the
benchmarks and the cost model read, so they count exactly what was handed to
torch.distributed, never an estimate.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from dpkfac.plan.hardware import wire_bytes
from dpkfac.timeline import Timeline

COMM_CATEGORIES = (
    "grad_allreduce",
    "factor_allreduce",
    "decomposition_broadcast",
    "precond_broadcast",
)
PHASES = (
    "factor_compute",
    "factor_comm",
    "decomposition",
    "decomposition_comm",
    "precondition",
    "precond_comm",
    "grad_comm",
    "comm_sync",
)
#: Phases reported by ``timings()`` only when something was timed in them (the
#: curvature-fidelity probe's compute and communication, see dpkfac/fidelity.py).
OPTIONAL_PHASES = ("fidelity", "fidelity_comm")
#: The phase in which waiting on a collective of each category is counted.
PHASE_OF_CATEGORY = {
    "grad_allreduce": "grad_comm",
    "factor_allreduce": "factor_comm",
    "decomposition_broadcast": "decomposition_comm",
    "precond_broadcast": "precond_comm",
    "setup": "setup",
    "fidelity_allreduce": "fidelity_comm",
}


class CommStats:
    """Bytes and calls of collectives per category on this rank.

    Each collective is counted as it is launched (its category, kind, buffer size and group
    size); the bytes it sends on the wire are derived from those when they are read
    (:meth:`as_dict`), by the cost model's own formula, so that launching one costs a few
    dictionary updates and nothing else.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._bytes: dict[str, int] = defaultdict(int)
        self._calls: dict[str, int] = defaultdict(int)
        self._launched: Counter[tuple[str, str, int, int]] = Counter()

    def record(self, category: str, kind: str, nbytes: int, world_size: int) -> None:
        """Count one collective of ``kind`` (one of
        :data:`~dpkfac.plan.hardware.COLLECTIVE_KINDS`) over a buffer of ``nbytes`` (the
        size handed to torch.distributed) in a group of ``world_size`` ranks."""
        self._bytes[category] += int(nbytes)
        self._calls[category] += 1
        self._launched[category, kind, int(nbytes), world_size] += 1

    def _wire_bytes(self, category: str) -> int:
        """Bytes this rank sent for ``category`` under the bandwidth-optimal algorithm (ring
        all-reduce: 2(P-1)/P of the buffer; broadcast, reduce, reduce-scatter and
        all-gather: (P-1)/P), :func:`dpkfac.plan.hardware.wire_bytes` per collective (an
        integer floor each), so schemes can be compared on the wire and measured and
        predicted bytes agree exactly."""
        return sum(
            count * wire_bytes(kind, nbytes, world_size)
            for (cat, kind, nbytes, world_size), count in self._launched.items()
            if cat == category
        )

    def as_dict(self) -> dict[str, dict[str, int]]:
        """Every contract category (zero when unused) plus any extra one that was used.

        Each entry holds ``bytes`` and ``calls`` (the contract) and ``wire_bytes``.
        """
        names = list(COMM_CATEGORIES) + sorted(set(self._calls) - set(COMM_CATEGORIES))
        return {
            c: {
                "bytes": self._bytes.get(c, 0),
                "calls": self._calls.get(c, 0),
                "wire_bytes": self._wire_bytes(c),
            }
            for c in names
        }


#: Values of the ``timing`` option: how :class:`PhaseTimer` measures.
TIMING_MODES = ("auto", "events", "host", "off")


class PhaseTimer:
    """Seconds per phase: the host's wall clock on CPU, CUDA events on a GPU.

    On a GPU a phase records an event on the current stream at each boundary
    and never synchronises the device: a device-wide synchronisation in the
    capture hooks would tie the backward pass to every kernel in flight and
    defeat DDP's and spd_kfac's overlap of communication with the backward
    pass. The event pairs are turned into seconds when the timings are read
    (:meth:`as_dict`, which waits for them); pairs that have already completed
    are folded in as phases go, so a run that never reads its timings keeps
    only a short list.

    Args:
        device: the device the timed work runs on (None or CPU: wall clock).
        mode: "auto" (CUDA events on a CUDA device, the wall clock elsewhere),
            "events", "host" (the wall clock: on a GPU it measures launches,
            not kernels) or "off" (nothing is timed; ``as_dict`` reports
            zeros). "host" and "off" are the seams for runs that have no CUDA
            context, such as dry runs on fake CUDA tensors.

    Attributes:
        timeline: where every timed phase is also recorded as a span, with its
            arguments (None: nowhere). It survives :meth:`reset`, which the
            benchmark calls every step, and is shared by every communicator
            timed here, which records its collectives there too.
    """

    #: Unresolved event pairs above which completed ones are folded in.
    PENDING_LIMIT = 512

    def __init__(self, device: torch.device | str | None = None, mode: str = "auto") -> None:
        if mode not in TIMING_MODES:
            raise ValueError(f"unknown timing {mode!r}; expected one of {list(TIMING_MODES)}")
        on_cuda = device is not None and torch.device(device).type == "cuda"
        self.mode = ("events" if on_cuda else "host") if mode == "auto" else mode
        self.cuda = self.mode == "events"
        self.timeline: Timeline | None = None
        self.reset()

    def reset(self) -> None:
        self._seconds: dict[str, float] = defaultdict(float)
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def phase(self, name: str, **args: object) -> Iterator[None]:
        """Time the enclosed block into ``name``; ``args`` (the layer, the bucket) go to the
        :attr:`timeline` only."""
        if self.timeline is not None and self.timeline.enabled:
            with self.timeline.span(name, "phase", **args), self._timed(name):
                yield
            return
        with self._timed(name):
            yield

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        if self.mode == "off":
            yield
            return
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._pending.append((name, start, end))
                if len(self._pending) > self.PENDING_LIMIT:
                    self._resolve(block=False)
            return
        start_s = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] += time.perf_counter() - start_s

    def _resolve(self, *, block: bool) -> None:
        """Fold completed event pairs (all of them, waiting, when ``block``) into seconds."""
        keep = []
        for name, start, end in self._pending:
            if block:
                end.synchronize()
            elif not end.query():
                keep.append((name, start, end))
                continue
            self._seconds[name] += start.elapsed_time(end) / 1e3
        self._pending = keep

    def as_dict(self) -> dict[str, float]:
        """Seconds per phase (waits for the device's outstanding timed work)."""
        self._resolve(block=True)
        out = {p: float(self._seconds.get(p, 0.0)) for p in PHASES}
        out.update({p: float(self._seconds[p]) for p in OPTIONAL_PHASES if p in self._seconds})
        return out
