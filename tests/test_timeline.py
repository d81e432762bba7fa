"""The per-step timeline (dpkfac/timeline.py): a valid Chrome trace, in causal order.

* the trace is JSON Perfetto reads: every event has a name, a phase, a time, a process
  and a thread; every collective's slice begins once and ends once, not before it began,
  when its work's future completes or, without one, when the timeline sees it done;
* the benchmark's ``trace=true`` writes one trace of both ranks and both strategies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dpkfac.timeline import Timeline, merge

ROOT = Path(__file__).resolve().parents[1]


def check_valid(trace: dict[str, Any]) -> None:
    """The trace is what the Chrome trace format requires; slices begin and end once."""
    json.loads(json.dumps(trace))  # plain JSON
    begun: dict[tuple[Any, ...], float] = {}
    ended: set[tuple[Any, ...]] = set()
    for e in trace["traceEvents"]:
        assert {"name", "ph", "pid", "tid"} <= set(e), e
        assert e["ph"] in {"X", "i", "b", "e", "M"}, e
        if e["ph"] == "M":
            continue
        assert isinstance(e["ts"], float)
        if e["ph"] == "X":
            assert e["dur"] >= 0
        key = (e["pid"], e.get("cat"), e.get("id"))
        if e["ph"] == "b":
            assert key not in begun, e
            begun[key] = e["ts"]
        elif e["ph"] == "e":
            assert key in begun and key not in ended and e["ts"] >= begun[key], e
            ended.add(key)
    assert ended == set(begun), "a collective's slice never ended"


# ------------------------------------------------------------------ unit
class _Work:
    """A work of torch.distributed, as the timeline sees it."""

    def __init__(self, future: torch.futures.Future[Any] | None) -> None:
        self.future = future
        self.done = False

    def get_future(self) -> torch.futures.Future[Any]:
        if self.future is None:
            raise RuntimeError("Work::getFuture not implemented.")
        return self.future

    def is_completed(self) -> bool:
        return self.done


def test_a_collective_ends_when_its_future_completes_or_when_it_is_seen_done() -> None:
    tl = Timeline(rank=3)
    future: torch.futures.Future[Any] = torch.futures.Future()
    with_future, without = _Work(future), _Work(None)
    with tl.tags(bucket=1):
        tl.collective("grad_allreduce all_reduce", "group main", with_future, bytes=8)
    tl.collective("grad_allreduce reduce_scatter", "group main", without, bytes=8)
    with tl.span("precondition", "phase", layer="fc"):
        pass
    assert not [e for e in tl.events if e["ph"] == "e"]
    future.set_result(None)  # its callback ends the slice
    without.done = True
    tl.instant("bucket K-FAC gradients reduced", "overlap", bucket=1)  # sweeps: ends it
    trace = tl.trace()
    check_valid(trace)
    ends = [e for e in trace["traceEvents"] if e["ph"] == "e"]
    assert [e["args"] for e in ends] == [{}, {"seen": "polled"}]
    launch = next(e for e in trace["traceEvents"] if e["ph"] == "b")
    assert launch["args"] == {"bucket": 1, "bytes": 8} and launch["pid"] == 3
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"rank 3", "main 0"}


def test_a_paused_timeline_records_nothing_and_merged_ranks_stay_apart() -> None:
    quiet = Timeline(rank=0, enabled=False)
    with quiet.span("step", "step"):
        quiet.instant("x", "overlap")
    assert quiet.collective("c", "group main", _Work(None)) is None and not quiet.events
    a, b = Timeline(rank=0), Timeline(rank=1)
    with b.span("step", "step"):
        pass
    with a.span("step", "step"):
        pass
    merged = merge([a.trace(), b.trace()])
    check_valid(merged)
    spans = [e for e in merged["traceEvents"] if e["ph"] == "X"]
    assert [e["pid"] for e in spans] == [1, 0]  # time-ordered, each rank its own process


@pytest.mark.distributed
def test_the_benchmark_writes_one_trace_of_every_rank_and_strategy(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [
        "model=mlp",
        "strategies=[none,dp_kfac_owner_overlap]",
        "world_size=2",
        "warmup=3",
        "steps=2",
        "trace=true",
        f"hydra.run.dir={tmp_path}",
    ]
    cmd = [sys.executable, "-m", "experiments.bench", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = json.loads((tmp_path / "trace.json").read_text())
    check_valid(trace)
    steps = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "step"]
    seen = {(e["pid"], e["args"]["strategy"], e["args"]["step"]) for e in steps}
    strategies = ("none", "dp_kfac_owner_overlap")
    assert seen == {(r, s, i) for r in (0, 1) for s in strategies for i in (3, 4)}
    tracks = {e["cat"] for e in trace["traceEvents"] if e["ph"] == "b"}
    assert tracks == {"group main", "group exchange"}
