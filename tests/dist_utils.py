"""Run a function on several gloo ranks (forked processes on localhost) with timeouts.

Every process group gets a short timeout and the parent joins every rank with
a deadline, so a deadlock fails the test quickly and names the rank instead
of hanging CI.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import socket
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Optimizers import torch._dynamo lazily: 3 s in every forked rank unless done here.
import torch._dynamo
import torch.distributed as dist

PG_TIMEOUT_S = 60
JOIN_TIMEOUT_S = 180


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _leave_together() -> None:
    """Wait, after reporting, until every rank has finished its function.

    A rank whose part ends early (a non-member of a subgroup, say) would otherwise
    exit and close its gloo sockets while a slower rank is still completing its own
    side of the default group's connection handshake, which then fails with
    "Connection closed by peer" although nothing went wrong. The barrier runs only
    after this rank's result is on the queue: if another rank failed, this one is
    killed by the parent at the join, and the failure is reported as it was.
    """
    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):  # a peer failed: its own report names it
        dist.barrier()


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    queue: Any,
    args: tuple,
    backend: str = "gloo",
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # what torchrun tells its ranks
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            # Before the group exists: NCCL binds the group to the current device, and
            # object collectives send through it.
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
        result = fn(rank, world_size, *args)
        # Plain pickle: multiprocessing's pickler would pass tensors as shared-memory
        # handles that die with this process before the parent reads them.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report every failure, including assertion errors
        queue.put((rank, "error", traceback.format_exc()))
    else:
        queue.close()
        queue.join_thread()  # the result is in the pipe before anything else can fail
        _leave_together()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = JOIN_TIMEOUT_S,
    backend: str = "gloo",
    start_method: str = "fork",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks.

    CUDA tests pass ``start_method="spawn"`` (a forked child cannot use a CUDA
    context its parent created) and may pass ``backend="nccl"``.

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        AssertionError: naming the ranks that failed or did not finish in time.
    """
    ctx = mp.get_context(start_method)
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker, args=(fn, r, world_size, port, queue, args, backend), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    while len(results) + len(errors) < world_size:
        remaining = (deadline - datetime.datetime.now()).total_seconds()
        if remaining <= 0:
            break
        if all(not p.is_alive() for p in procs):
            remaining = min(remaining, 5.0)  # all exited: drain what they sent, then stop
        try:
            rank, status, payload = queue.get(timeout=min(remaining, 2.0))
        except Exception:  # queue.Empty
            if all(not p.is_alive() for p in procs) and remaining <= 2.0:
                break
            continue
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    missing = sorted(set(range(world_size)) - set(results) - set(errors))
    if errors or missing:
        msg = [f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())]
        if missing:
            msg.append(f"ranks {missing} did not report within {timeout}s (deadlock or crash?)")
        raise AssertionError("\n".join(msg))
    return [results[r] for r in range(world_size)]


@contextlib.contextmanager
def broadcast_roots() -> Iterator[list[int]]:
    """The root of every ``torch.distributed.broadcast`` call started inside the block, in
    the order they started (the communicator looks the function up at each call)."""
    started: list[int] = []
    real = dist.broadcast

    def recording(tensor: torch.Tensor, src: int, **kwargs: Any) -> Any:
        started.append(src)
        return real(tensor, src=src, **kwargs)

    dist.broadcast = recording  # type: ignore[assignment]
    try:
        yield started
    finally:
        dist.broadcast = real  # type: ignore[assignment]
