"""The per-step timeline (dpkfac/timeline.py): a valid Chrome trace, in causal order.

* the trace is JSON Perfetto reads: every event has a name, a phase, a time, a process
  and a thread; every collective's slice begins once and ends once, not before it began,
  when its work's future completes or, without one, when the timeline sees it done;
* on an overlapped owner-reduction step at P=2 (own hooks and DDP's), on a model whose
  last bucket is a large non-K-FAC embedding, the events are in causal order: a bucket
  is ready, then its collectives launch, complete and are seen reduced; its layers are
  preconditioned after that, their updates launched after that and landed before
  ``step()`` returns; and the engine launches every update exchange before it waits for
  the embedding's all-reduce, and (without DDP, whose backward pass waits for every
  bucket) lands and writes the updates before it waits for that all-reduce;
* the benchmark's ``trace=true`` writes one trace of both ranks and both strategies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from strategy_cases import VOCAB, embed_batch, embed_net, make_preconditioner
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dpkfac.timeline import Timeline, merge

ROOT = Path(__file__).resolve().parents[1]
CAP_MB = 256 / 2**20  # a bucket cap that gives each layer a bucket of its own


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


def test_a_cuda_collective_ends_when_seen_done_not_when_its_future_completes() -> None:
    """An NCCL work's future completes when it is enqueued: not the collective's end."""
    tl = Timeline()
    future: torch.futures.Future[Any] = torch.futures.Future()
    work = _Work(future)
    tl.collective("grad_allreduce all_reduce", "group main", work, future=False)
    future.set_result(None)
    tl.sweep()
    assert not [e for e in tl.events if e["ph"] == "e"]
    work.done = True
    tl.sweep()
    (end,) = [e for e in tl.events if e["ph"] == "e"]
    assert end["args"] == {"seen": "polled"}
    check_valid(tl.trace())


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


# --------------------------------------------------------------- distributed
def _traced(rank: int, world_size: int, how: str | None) -> list[dict[str, Any]]:
    """Four overlapped owner-reduction steps (the first places the layers, DDP rebuilds its
    buckets after it); the trace of the last two and the layers each rank owns."""
    inner = embed_net()
    model: nn.Module = inner
    if how == "ddp":
        model = DistributedDataParallel(inner, bucket_cap_mb=CAP_MB)
    pre = make_preconditioner(
        model, "dp_kfac", grad_reduction="owner", overlap=True, bucket_cap_mb=CAP_MB
    )
    tl = Timeline(rank=rank, enabled=False)
    pre.timeline = tl
    for step in range(4):
        tl.enabled = step >= 2  # DDP rebuilds its buckets after the first iteration
        ids, y = embed_batch(step, rank)
        with tl.span("step", "step", step=step):
            with tl.span("backward", "step"):
                F.cross_entropy(model(ids), y).backward()
            with tl.span("pre.step()", "step"):
                pre.step()
        inner.zero_grad()
    owned = [name for name, layer in pre.layers.items() if layer.owner == rank]
    return [tl.trace(), owned]


def _by_step(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    steps = [e for e in events if e["ph"] == "X" and e["name"] == "step"]
    return [[e for e in events if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]] for s in steps]


@pytest.mark.distributed
@pytest.mark.parametrize("how", [None, "ddp"])
def test_an_overlapped_steps_events_are_in_causal_order(how: str | None) -> None:
    results = run_ranks(_traced, 2, how)
    merged = merge([trace for trace, _ in results])
    check_valid(merged)
    for rank, (trace, owned) in enumerate(results):
        events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
        ends = {e["id"]: e for e in events if e["ph"] == "e"}
        steps = _by_step(events)
        assert len(steps) == 2
        for step in steps:
            assert _causal(step, ends, owned, ddp=how is not None), rank


def _causal(
    step: list[dict[str, Any]], ends: dict[int, dict[str, Any]], owned: list[str], *, ddp: bool
) -> bool:
    def one(name: str, **args: Any) -> dict[str, Any]:
        (event,) = [e for e in step if e["name"] == name and args.items() <= e["args"].items()]
        return event

    backward, pre_step = one("backward"), one("pre.step()")
    step_end = pre_step["ts"] + pre_step["dur"]
    ready = [e for e in step if e["name"] == "bucket ready"]
    buckets = [e["args"]["bucket"] for e in ready]
    assert len(buckets) >= 3 and buckets == sorted(buckets)
    launches = defaultdict(list)
    for e in step:
        if e["ph"] == "b":
            launches[(e["args"].get("bucket"), e["args"]["part"])].append(e)
    embedding = buckets[-1]  # the last bucket holds the embedding alone: no K-FAC layer
    assert ready[-1]["args"]["params"] == 1 and not launches[(embedding, "kfac")]
    (rest,) = launches[(embedding, "rest")]
    assert rest["args"]["bytes"] == VOCAB * 8 * 8
    preconditioned = [e for e in step if e["name"] == "precondition"]
    assert sorted(e["args"]["layer"] for e in preconditioned) == sorted(owned)
    for b, mark in zip(buckets, ready, strict=True):
        assert backward["ts"] <= mark["ts"] <= backward["ts"] + backward["dur"]
        kfac = launches[(b, "kfac")]
        reduced = [e for e in step if e["name"] == "bucket K-FAC gradients reduced"]
        (seen,) = [e for e in reduced if e["args"]["bucket"] == b]
        for launch in kfac + launches[(b, "rest")]:
            assert mark["ts"] <= launch["ts"] <= ends[launch["id"]]["ts"] <= step_end
        assert all(ends[launch["id"]]["ts"] <= seen["ts"] for launch in kfac)
        mine = [e for e in preconditioned if e["args"]["bucket"] == b]
        assert all(seen["ts"] <= e["ts"] for e in mine)
        for launch in launches[(b, "updates")]:
            assert all(e["ts"] + e["dur"] <= launch["ts"] for e in mine)
    # Every exchange is launched before the engine waits for the embedding's all-reduce.
    waits = [e for e in step if e["name"] == "grad_comm" and e["args"].get("part") == "rest"]
    (wait,) = [e for e in waits if e["args"]["bucket"] == embedding]
    exchanges = [e for (_, part), es in launches.items() if part == "updates" for e in es]
    assert exchanges and all(e["ts"] <= wait["ts"] for e in exchanges)
    if not ddp:  # (DDP waits for every bucket before its backward pass ends)
        # The updates land, and are written, before step() waits for the embedding.
        landed = [e for e in step if e["name"] == "precond_comm"]
        assert landed and all(e["ts"] + e["dur"] <= wait["ts"] for e in landed)
    return True


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
        "probes=false",
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
