"""Start ``world_size`` ranks through torch.distributed's elastic launcher.

Each Hydra job of a sweep starts its own ranks, so ``-m world_size=1,2,4``
needs no shell loop and no torchrun wrapper. Ranks rendezvous on a free
localhost port through the c10d backend and return their results through the
launcher (which pickles each rank's return value back to this process).
World size 1 runs in this process without a process group: the library's
single-process path is exactly what a one-GPU user runs.

On an emulated network (``network=emulated``, :mod:`experiments.network`) the
ranks are the nodes of a multi-node elastic job instead: every node runs its own
elastic agent (``python -m experiments.bench.launch PAYLOAD``, as torchrun runs
one per node) in its own network namespace, the c10d rendezvous is hosted by
node 0 at its namespace address, and each agent pickles its ranks' results
into the job's scratch folder for this process to collect.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from experiments import network as network_lib

#: Environment variables that size the thread pools of every rank.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
#: Seconds the ranks may take to meet.
RDZV_TIMEOUT_S = 120
#: The rendezvous port on node 0 of an emulated network (its namespace has no other user).
NETWORK_RDZV_PORT = 29400


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
    fn: Callable[[dict[str, Any]], Any],
    spec: dict[str, Any],
    world_size: int,
    *,
    threads: int = 1,
    network: network_lib.Network | None = None,
    timeout_s: float | None = None,
) -> list[Any]:
    """Run ``fn(spec)`` on ``world_size`` ranks and return their results in rank order.

    Args:
        fn: a module-level function (workers are spawned, so it is pickled by name).
        spec: plain, picklable job description handed to every rank.
        world_size: number of ranks.
        threads: threads per rank.
        network: the emulated network to run the ranks on (None: local ranks, loopback).
        timeout_s: on a network, the bound on the whole run (None: the ranks' own
            collective and rendezvous timeouts only).

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: a
            local rank failed; the message carries the rank's traceback.
        RuntimeError: a node of the network failed (its ranks' tracebacks are on stderr).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if network is not None:
        return _launch_on_network(fn, spec, world_size, threads, network, timeout_s)
    if world_size == 1:
        import torch

        previous = torch.get_num_threads()
        try:
            return [fn(spec)]
        finally:
            torch.set_num_threads(previous)

    from torch.distributed.launcher.api import elastic_launch

    config = _config(1, world_size, "127.0.0.1", f"127.0.0.1:{free_port()}", None)
    with thread_env(threads):
        results = elastic_launch(config, fn)(spec)
    return [results[r] for r in sorted(results)]


def _config(
    nodes: int, nproc: int, local_addr: str, endpoint: str, is_host: bool | None, run_id: str = ""
) -> Any:
    """The elastic launcher's config: ``nodes`` agents of ``nproc`` ranks, no restarts.

    Joining is bounded by :data:`RDZV_TIMEOUT_S`; ``is_host`` says whether this agent
    hosts the rendezvous store (None: torch guesses from the host name, which on an
    emulated network names no namespace address).
    """
    from torch.distributed.launcher.api import LaunchConfig

    rdzv: dict[str, Any] = {"timeout": RDZV_TIMEOUT_S, "join_timeout": RDZV_TIMEOUT_S}
    if is_host is not None:
        rdzv["is_host"] = is_host
    return LaunchConfig(
        min_nodes=nodes,
        max_nodes=nodes,
        nproc_per_node=nproc,
        run_id=run_id or f"dpkfac-bench-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv,
        max_restarts=0,
        monitor_interval=0.05,
        start_method="spawn",
        local_addr=local_addr,
    )


def _launch_on_network(
    fn: Callable[[dict[str, Any]], Any],
    spec: dict[str, Any],
    world_size: int,
    threads: int,
    network: network_lib.Network,
    timeout_s: float | None,
) -> list[Any]:
    """:func:`launch` with one elastic agent per node of an emulated network."""
    nodes = network.nodes(world_size)
    with tempfile.TemporaryDirectory(prefix="dpkfac-launch-") as tmp:
        payload = Path(tmp) / "payload.pkl"
        job = {
            "fn": fn,
            "spec": spec,
            "nodes": nodes,
            "nproc": network.ranks_per_node,
            "threads": threads,
            "run_id": f"dpkfac-net-{uuid.uuid4().hex[:8]}",
            "out": tmp,
        }
        payload.write_bytes(pickle.dumps(job))
        argv = [sys.executable, "-m", "experiments.bench.launch", str(payload)]
        codes = network_lib.run_nodes(network, [argv] * nodes, timeout_s=timeout_s)
        if any(codes):
            failed = ", ".join(f"node {i}: exit {c}" for i, c in enumerate(codes) if c)
            raise RuntimeError(f"ranks on the emulated network failed ({failed}); see stderr")
        results: dict[int, Any] = {}
        for node in range(nodes):
            results.update(pickle.loads((Path(tmp) / f"results-{node}.pkl").read_bytes()))
    return [results[r] for r in sorted(results)]


def node_main(payload: str) -> None:
    """One node of an emulated network: its elastic agent, then its ranks' results to a file."""
    from torch.distributed.launcher.api import elastic_launch

    job = pickle.loads(Path(payload).read_bytes())
    here = network_lib.node_link()
    if here is None:
        raise RuntimeError(f"{network_lib.ENV} is not set: start nodes through launch(network=)")
    endpoint = f"{network_lib.address(0)}:{NETWORK_RDZV_PORT}"
    config = _config(
        job["nodes"], job["nproc"], here.address, endpoint, here.node == 0, job["run_id"]
    )
    with thread_env(job["threads"]):
        results = elastic_launch(config, job["fn"])(job["spec"])
    (Path(job["out"]) / f"results-{here.node}.pkl").write_bytes(pickle.dumps(results))


if __name__ == "__main__":
    node_main(sys.argv[1])
