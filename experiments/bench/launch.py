"""Start ``world_size`` local ranks through torch.distributed's elastic launcher.

Each Hydra job of a sweep starts its own ranks, so ``-m world_size=1,2,4``
needs no shell loop and no torchrun wrapper. Ranks rendezvous on a free
localhost port through the c10d backend and return their results through the
launcher (which pickles each rank's return value back to this process).
World size 1 runs in this process without a process group: the library's
single-process path is exactly what a one-GPU user runs.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from typing import Any

#: Environment variables that size the thread pools of every rank.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
#: Seconds the ranks may take to meet.
RDZV_TIMEOUT_S = 120


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def thread_env(threads: int) -> Iterator[None]:
    """Pin the ranks' BLAS/OpenMP pools (inherited by the workers), then restore.

    Several ranks on a 2-core machine oversubscribe the cores if each one
    starts a thread per core; one thread per rank keeps P ranks on P cores.
    """
    saved = {k: os.environ.get(k) for k in THREAD_VARS}
    os.environ.update({k: str(threads) for k in THREAD_VARS})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def launch(
    fn: Callable[[dict[str, Any]], Any], spec: dict[str, Any], world_size: int, *, threads: int = 1
) -> list[Any]:
    """Run ``fn(spec)`` on ``world_size`` local ranks and return their results in rank order.

    Args:
        fn: a module-level function (workers are spawned, so it is pickled by name).
        spec: plain, picklable job description handed to every rank.
        world_size: number of ranks.
        threads: threads per rank.

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a
            rank failed; the message carries the rank's traceback.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if world_size == 1:
        import torch

        previous = torch.get_num_threads()
        try:
            return [fn(spec)]
        finally:
            torch.set_num_threads(previous)

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"dpkfac-bench-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": RDZV_TIMEOUT_S},
        max_restarts=0,
        monitor_interval=0.05,
        start_method="spawn",
        local_addr="127.0.0.1",
    )
    with thread_env(threads):
        results = elastic_launch(config, fn)(spec)
    return [results[r] for r in sorted(results)]
