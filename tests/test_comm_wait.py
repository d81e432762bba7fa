"""Communicator.wait on works that refuse a finite timeout (in-process groups' works).

gloo's and NCCL's works take the collective timeout themselves; a work that wraps
a future (``experiments.c10d_seam.work_from_future``, what experiments/threads.py's group and
torch's own threaded group return) raises on any finite timeout. The communicator
then polls it up to the same deadline, so such a collective still completes, and
one that never does still fails, naming the rank and the phase.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from dpkfac.comm import CollectiveTimeout, Communicator, Handle
from experiments.c10d_seam import work_from_future


def _work(result: object | None = None, pending: bool = False) -> tuple[Any, Any]:
    """A work wrapping a future (done with ``result``, or ``pending``) and its future."""
    future: torch.futures.Future = torch.futures.Future()
    if not pending:
        future.set_result(result)
    return work_from_future(future), future


def test_a_completed_future_work_is_waited_on_without_a_timeout() -> None:
    comm = Communicator(timeout=5)
    work, _ = _work([torch.ones(1)])
    seen = []
    handle = Handle("grad_allreduce", works=[work], finish=[lambda: seen.append("unpacked")])
    comm.wait(handle)
    assert handle.done and seen == ["unpacked"]


def test_a_future_work_completed_later_is_polled_until_done() -> None:
    comm = Communicator(timeout=5)
    work, future = _work(pending=True)
    threading.Timer(0.05, lambda: future.set_result([])).start()
    started = time.monotonic()
    comm.wait(Handle("factor_allreduce", works=[work]))
    assert 0.04 < time.monotonic() - started < 2.0


def test_a_future_work_that_never_completes_times_out_naming_the_phase() -> None:
    comm = Communicator(timeout=0.05)
    work, _ = _work(pending=True)
    with pytest.raises(CollectiveTimeout, match=r"precond_broadcast .* within 0.05s on rank 0"):
        comm.wait(Handle("precond_broadcast", works=[work]))


def test_completed_asks_the_works_without_blocking_even_of_a_done_handle() -> None:
    """The overlapped mode's ready drain asks ``completed`` in its hooks. It reads each work's
    ``is_completed()``, never waits, and does not trust ``done``: NCCL completes a work's
    future once the collective is queued, so a DDP hook's callback marks a handle done
    before the device has run its transfer."""
    comm = Communicator(timeout=5)
    work, future = _work(pending=True)
    handle = Handle("grad_allreduce", works=[work], done=True)
    started = time.monotonic()
    assert not comm.completed(handle)
    assert time.monotonic() - started < 0.5
    future.set_result([])
    assert comm.completed(handle)
    assert comm.completed(Handle("grad_allreduce", done=True))  # nothing launched
