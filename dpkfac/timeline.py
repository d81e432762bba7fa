"""A per-step timeline of a run, in the Chrome trace format that Perfetto and chrome://tracing open.

The phase timer (:class:`dpkfac.stats.PhaseTimer`) sums seconds per phase: it says
how long a step waited for its gradients, not on what. Whether the overlapped mode
hides anything is a question of order (was a layer preconditioned while a later
bucket was on the wire, or only after it landed?), so this records when things
happen:

* **spans** (``ph: "X"``) on the thread that ran them: every phase the timer times
  (a :class:`Timeline` set as ``PhaseTimer.timeline`` records them all, with the
  layer or bucket as arguments), and whatever a caller wraps in :meth:`span`
  (the benchmark's forward, backward, ``pre.step()``, ``optimizer.step()``);
* **collectives** (async slices, ``ph: "b"``/``"e"``), one per buffer handed to
  torch.distributed, on a track per process group: launched when the
  communicator handed it over; completed when its work's future completed (gloo
  runs that callback on its own thread as the data lands, so the time is exact),
  or, for a work without a future (gloo's reduce-scatter), at the first moment
  the timeline saw it complete (any event recorded after it, or the wait);
* **instants** (``ph: "i"``): a bucket became ready, a bucket's reduction was
  noticed.

Timestamps are the host's monotonic clock (``time.perf_counter_ns``, one clock for
every process of a machine), so the traces of a job's ranks merge into one
(:func:`merge`), one process per rank. On a GPU the same clock records when the
host issued and observed work, never a device synchronisation: nothing here reads
a device value. A CUDA collective's future completes when it is enqueued, so its
future is not used (``future=False``): its end is when the host first sees the work
complete (``is_completed()``, an event query, at the next event recorded) or waits
for it (use ``torch.profiler`` beside it for kernel times).

Recording is cheap (a dict per event, no lock: appends to a list are atomic in
CPython) but not free; a run without a timeline records nothing.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

__all__ = ["Timeline", "merge"]


def _now_us() -> float:
    return time.perf_counter_ns() / 1e3


class Timeline:
    """Events of one process, in Chrome trace form (module docstring).

    Args:
        rank: the process's rank (its ``pid`` in the trace, so ranks merge side by side).
        enabled: record events (False: every call returns at once; see :attr:`enabled`).

    Attributes:
        enabled: set to False to pause recording (the benchmark skips its warm-up steps).
        events: the recorded trace events.
    """

    def __init__(self, *, rank: int = 0, enabled: bool = True) -> None:
        self.rank = rank
        self.enabled = enabled
        self.events: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._threads: dict[int, int] = {}
        self._local = threading.local()
        # Works without a future, each with its slice's id: ended when first seen complete.
        # Guarded by a lock: a collective may be launched from a future's callback.
        self._unwatched: list[tuple[Any, int, str, str]] = []
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- records
    def _tid(self) -> int:
        ident = threading.get_ident()
        tid = self._threads.get(ident)
        if tid is None:
            tid = self._threads[ident] = len(self._threads)
            name = "main" if threading.current_thread() is threading.main_thread() else "callback"
            self._meta("thread_name", tid, {"name": f"{name} {tid}"})
        return tid

    def _meta(self, kind: str, tid: int, args: dict[str, Any]) -> None:
        self.events.append({"name": kind, "ph": "M", "pid": self.rank, "tid": tid, "args": args})

    def _args(self, args: Mapping[str, Any]) -> dict[str, Any]:
        tags: dict[str, Any] = getattr(self._local, "tags", {})
        return {**tags, **args}

    @contextmanager
    def span(self, name: str, cat: str, **args: Any) -> Iterator[None]:
        """Record the enclosed block as a span on this thread."""
        if not self.enabled:
            yield
            return
        start = _now_us()
        try:
            yield
        finally:
            end = _now_us()
            self.events.append(
                {
                    "name": name,
                    "cat": cat,
                    "ph": "X",
                    "ts": start,
                    "dur": end - start,
                    "pid": self.rank,
                    "tid": self._tid(),
                    "args": self._args(args),
                }
            )
            self.sweep()

    def instant(self, name: str, cat: str, **args: Any) -> None:
        """Record a moment on this thread."""
        if not self.enabled:
            return
        self.sweep()
        self.events.append(
            {
                "name": name,
                "cat": cat,
                "ph": "i",
                "s": "t",
                "ts": _now_us(),
                "pid": self.rank,
                "tid": self._tid(),
                "args": self._args(args),
            }
        )

    @contextmanager
    def tags(self, **args: Any) -> Iterator[None]:
        """Add ``args`` to every event this thread records inside the block (e.g. the bucket
        a collective belongs to, which the communicator does not know)."""
        old: dict[str, Any] = getattr(self._local, "tags", {})
        self._local.tags = {**old, **args}
        try:
            yield
        finally:
            self._local.tags = old

    def collective(
        self, name: str, track: str, work: Any, *, future: bool = True, **args: Any
    ) -> int | None:
        """Record a collective launched now on ``track`` (its process group); its end is
        recorded when ``work`` completes (module docstring): from its future's callback,
        or with ``future=False`` (a CUDA work, whose future completes at enqueue) when
        the timeline sees it complete or it is waited for. Returns the slice's id (None
        when not recording)."""
        if not self.enabled:
            return None
        ident = next(self._ids)
        self.events.append(self._async("b", name, track, ident, _now_us(), self._args(args)))
        done: Any = None
        if future:
            with suppress(RuntimeError, AttributeError):  # gloo's reduce-scatter has none
                done = work.get_future()
        if done is None:
            with self._lock:
                self._unwatched.append((work, ident, name, track))
            return ident

        def ended(_: object) -> None:
            self.events.append(self._async("e", name, track, ident, _now_us(), {}))

        done.then(ended)
        return ident

    def _async(
        self, ph: str, name: str, track: str, ident: int, ts: float, args: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "name": name,
            "cat": track,
            "ph": ph,
            "id": ident,
            "ts": ts,
            "pid": self.rank,
            "tid": 0,
            "args": args,
        }

    def sweep(self) -> None:
        """End the slices of futureless works that have completed (as of now)."""
        if not self._unwatched:
            return
        now = _now_us()
        with self._lock:
            for entry in [e for e in self._unwatched if e[0].is_completed()]:
                self._unwatched.remove(entry)
                _, ident, name, track = entry
                self.events.append(self._async("e", name, track, ident, now, {"seen": "polled"}))

    def observed(self, works: Sequence[Any]) -> None:
        """``works`` were waited for: end their slices now where no future ended them."""
        if not self._unwatched:
            return
        ids = {id(w) for w in works}
        now = _now_us()
        with self._lock:
            for entry in [e for e in self._unwatched if id(e[0]) in ids]:
                self._unwatched.remove(entry)
                _, ident, name, track = entry
                self.events.append(self._async("e", name, track, ident, now, {"seen": "waited"}))

    # ---------------------------------------------------------------- output
    def trace(self) -> dict[str, Any]:
        """The events as a Chrome trace (``{"traceEvents": [...]}``), ready for ``json.dump``."""
        self.sweep()
        meta = {"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0}
        events = [{**meta, "args": {"name": f"rank {self.rank}"}}, *self.events]
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save(self, path: str | Path) -> Path:
        """Write :meth:`trace` as JSON to ``path``."""
        return write(self.trace(), path)

    def clear(self) -> None:
        """Drop the recorded events (collectives still in flight end in the next trace)."""
        self.events = []
        self._threads = {}


def merge(traces: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One trace of several processes' (each rank its own ``pid``), time-ordered."""
    events = [e for t in traces for e in t["traceEvents"]]
    events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0.0)))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write(trace: Mapping[str, Any], path: str | Path) -> Path:
    """Write a trace as JSON (open it at https://ui.perfetto.dev or chrome://tracing)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace))
    return out
