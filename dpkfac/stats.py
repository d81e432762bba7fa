"""Accounting of K-FAC work: seconds per phase, bytes and calls per collective category.

These back the inspection API (``comm_stats()``, ``timings()``) that the
benchmarks and the cost model read, so they count exactly what was handed to
torch.distributed, never an estimate.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

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
#: The phase in which waiting on a collective of each category is counted.
PHASE_OF_CATEGORY = {
    "grad_allreduce": "grad_comm",
    "factor_allreduce": "factor_comm",
    "decomposition_broadcast": "decomposition_comm",
    "precond_broadcast": "precond_comm",
    "setup": "setup",
}


class CommStats:
    """Bytes and calls of collectives per category on this rank."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._bytes: dict[str, int] = defaultdict(int)
        self._calls: dict[str, int] = defaultdict(int)
        self._wire: dict[str, int] = defaultdict(int)

    def record(self, category: str, nbytes: int, wire_bytes: int | None = None) -> None:
        """Count one collective over a buffer of ``nbytes``.

        Args:
            category: accounting category.
            nbytes: size of the buffer handed to torch.distributed.
            wire_bytes: bytes this rank sends under the bandwidth-optimal
                algorithm (ring all-reduce: 2(P-1)/P of the buffer; broadcast
                and reduce: (P-1)/P), so schemes can be compared on the wire.
        """
        self._bytes[category] += int(nbytes)
        self._calls[category] += 1
        self._wire[category] += int(nbytes if wire_bytes is None else wire_bytes)

    def as_dict(self) -> dict[str, dict[str, int]]:
        """Every contract category (zero when unused) plus any extra one that was used.

        Each entry holds ``bytes`` and ``calls`` (the contract) and ``wire_bytes``.
        """
        names = list(COMM_CATEGORIES) + sorted(set(self._calls) - set(COMM_CATEGORIES))
        return {
            c: {
                "bytes": self._bytes.get(c, 0),
                "calls": self._calls.get(c, 0),
                "wire_bytes": self._wire.get(c, 0),
            }
            for c in names
        }


class PhaseTimer:
    """Wall-clock seconds per phase; synchronises CUDA so GPU work is not hidden.

    Args:
        synchronize: call ``torch.cuda.synchronize()`` at phase boundaries;
            needed for honest GPU timings, pointless on CPU.
    """

    def __init__(self, synchronize: bool = False) -> None:
        self.synchronize = synchronize
        self.reset()

    def reset(self) -> None:
        self._seconds: dict[str, float] = defaultdict(float)

    def _sync(self) -> None:
        if self.synchronize and torch.cuda.is_available():
            torch.cuda.synchronize()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the enclosed block into ``name``."""
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._seconds[name] += time.perf_counter() - start

    def as_dict(self) -> dict[str, float]:
        return {p: float(self._seconds.get(p, 0.0)) for p in PHASES}
