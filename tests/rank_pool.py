"""A pool of forked gloo ranks that stay up across many runs (for property-based tests).

``run_ranks`` forks P processes and joins a process group per call, about a
second each; a property-based test runs hundreds of small distributed runs.
A :class:`RankPool` forks its P ranks and joins the group once; each
:meth:`RankPool.run` hands every rank the same task and collects the P
results. Every run has a deadline: a rank that does not answer in time is
named, the pool is torn down (the next run starts a fresh one), and the run
fails, so a hang costs seconds, never CI's hour.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_lib
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from dist_utils import PG_TIMEOUT_S, free_port


class RankTimeout(AssertionError):
    """Ranks of a pool did not answer a run within its deadline."""


def _serve(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    try:
        while True:
            task = tasks.get()
            if task is None:
                return
            index, fn, args = task
            try:
                payload = ("ok", pickle.dumps(fn(rank, world_size, *args)))
            except BaseException:  # every failure goes back, assertion errors included
                payload = ("error", traceback.format_exc())
            results.put((index, rank, *payload))
    finally:
        dist.destroy_process_group()


class RankPool:
    """P forked gloo ranks serving tasks ``fn(rank, world_size, *args)`` in order."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._procs: list[Any] = []
        self._index = 0

    def _start(self) -> None:
        ctx = mp.get_context("fork")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        port = free_port()
        self._procs = [
            ctx.Process(
                target=_serve,
                args=(r, self.world_size, port, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> list[Any]:
        """Every rank's ``fn(rank, world_size, *args)``, indexed by rank.

        Raises:
            RankTimeout: naming the ranks that did not answer within ``timeout`` s
                (the pool is closed; the next run starts a new one).
            AssertionError: with the tracebacks of the ranks that raised.
        """
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        self._index += 1
        for q in self._tasks:
            q.put((self._index, fn, args))
        got: dict[int, tuple[str, Any]] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        while len(got) < self.world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0:
                break
            try:
                index, rank, status, payload = self._results.get(timeout=min(remaining, 1.0))
            except queue_lib.Empty:
                if not all(p.is_alive() for p in self._procs):
                    break
                continue
            if index == self._index:
                got[rank] = (status, payload)
        missing = sorted(set(range(self.world_size)) - set(got))
        errors = {r: p for r, (s, p) in got.items() if s == "error"}
        if missing:
            self.close()
            raise RankTimeout(
                f"ranks {missing} of {self.world_size} did not answer within {timeout:g} s "
                "(a hang or a crash)" + "".join(f"\nrank {r}:\n{tb}" for r, tb in errors.items())
            )
        if errors:
            # A failed collective may leave the group unusable: start afresh next time.
            self.close()
            raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in errors.items()))
        return [pickle.loads(got[r][1]) for r in range(self.world_size)]

    def close(self) -> None:
        """Stop the ranks (asked first, then killed)."""
        for q, p in zip(getattr(self, "_tasks", []), self._procs, strict=False):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
        self._procs = []
