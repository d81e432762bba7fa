"""Micro-benchmarks that calibrate a :class:`Hardware` model on this machine.

Collectives are timed on ``world_size`` forked gloo ranks on localhost, each
over a range of buffer sizes; compute kinds are timed by running the
package's own kernels (:func:`dpkfac.curvature.a_factor`, the two
decompositions, :func:`dpkfac.curvature.precondition`, a Linear layer's
forward and backward) at several sizes, with the thread count one rank gets.
:func:`dpkfac.costmodel.calibrate` then fits alpha/beta and rates/latencies.
The benchmark may refine the result with phase timings from real runs
(:meth:`dpkfac.costmodel.Prediction.samples`).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import socket
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dpkfac.costmodel.fitting import calibrate
from dpkfac.plan.hardware import Hardware, Sample
from dpkfac.probes import median_time

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

__all__ = [
    "calibrate_local",
    "measure_collectives",
    "measure_compute",
]

SIZES = (256, 4096, 65536, 262144, 1048576, 4194304)  # float32 elements


def _sync_time(op: Callable[[], object], repeats: int, inner: int = 5) -> float:
    """Seconds per ``op``: ``inner`` back-to-back runs between two barriers, less one
    barrier, best of ``repeats`` rounds (noise on a shared machine only adds time)."""
    times = []
    for _ in range(repeats + 1):  # the first round is a warm-up
        dist.barrier()
        start = time.perf_counter()
        for _ in range(inner):
            op()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return min(times[1:]) / inner


def _rank(
    rank: int,
    world_size: int,
    port: int,
    sizes: Sequence[int],
    repeats: int,
    q: Queue[tuple[int, bytes]],
) -> None:
    from dpkfac.comm import Communicator

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        comm = Communicator()
        out = []
        barrier = _sync_time(lambda: None, 3 * repeats, inner=1)
        for n in sizes:
            buf = torch.zeros(n)
            # Sharded kinds over the same buffer: a shard of n / P elements per rank, as the
            # communicator runs them (on gloo by alltoallv: every rank sends each owner its
            # part, or its own shard to every rank; dpkfac.plan.hardware.sharded_by_alltoall).
            shards = [[torch.zeros(n // world_size)] for _ in range(world_size)]
            nsharded = world_size * (n // world_size)
            ops: dict[str, Callable[[], object]] = {
                "allreduce": partial(dist.all_reduce, buf),
                "broadcast": partial(dist.broadcast, buf, src=0),
                "reduce": partial(dist.reduce, buf, dst=0),
                "reduce_scatter": partial(comm.reduce_scatter_mean, shards, "setup"),
                "all_gather": partial(comm.all_gather, shards, "setup"),
            }
            for kind, op in ops.items():
                secs = _sync_time(op, repeats) - barrier / 5
                nbytes = nsharded * 4 if kind in ("reduce_scatter", "all_gather") else n * 4
                out.append((kind, nbytes, secs))
        q.put((rank, pickle.dumps(out)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure_collectives(
    world_size: int = 2, sizes: Sequence[int] = SIZES, repeats: int = 9
) -> list[Sample]:
    """Time all-reduce, broadcast and reduce on forked gloo ranks (median, barrier-corrected)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, world_size, port, sizes, repeats, q), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=10)
    # The slowest rank's view: a collective is done when every rank has it.
    per_rank = [pickle.loads(results[r]) for r in range(world_size)]
    samples = [
        Sample.collective(kind, nbytes, max(pr[i][2] for pr in per_rank), world_size)
        for i, (kind, nbytes, _) in enumerate(per_rank[0])
    ]
    return [s for s in samples if s.seconds > 0]


#: (in channels, out channels, kernel, output side, batch) of timed Conv2d layers,
#: from CIFAR ResNets (tall, narrow patch matrices) to wide ones.
_CONVS = (
    (3, 16, 3, 32, 32),
    (16, 16, 3, 32, 32),
    (32, 32, 3, 16, 32),
    (64, 64, 3, 8, 32),
    (128, 128, 3, 8, 8),
    (256, 256, 1, 8, 8),
)
#: (d_in, d_out, rows) of timed Linear layers.
_LINEARS = ((64, 10, 32), (512, 512, 256), (1024, 1024, 1024), (256, 2048, 2048))
#: (rows, d_in, d_out) of timed Linear forward and backward passes.
_FORWARD_BACKWARD = ((256, 64, 64), (1024, 256, 128), (4096, 512, 256), (2048, 1024, 512))


def _factor_samples(gen: torch.Generator, repeats: int) -> list[Sample]:
    """Time the capture path (``KFACLayer.accumulate_a/g``) of real layers."""
    from torch import nn

    from dpkfac.costmodel.timing import factor_work
    from dpkfac.curvature import KFACLayer, helper_for
    from dpkfac.plan.assignment import LayerShape

    cases: list[tuple[nn.Linear | nn.Conv2d, torch.Tensor, torch.Tensor, LayerShape]] = []
    for c_in, c_out, k, side, n in _CONVS:
        conv = nn.Conv2d(c_in, c_out, k, padding=k // 2, bias=False)
        x = torch.randn(n, c_in, side, side, generator=gen)
        shape = LayerShape.conv2d("c", c_in, c_out, (k, k), (side, side), batch_size=n)
        cases.append((conv, x, torch.randn(n, c_out, side, side, generator=gen), shape))
    for d_in, d_out, n in _LINEARS:
        shape = LayerShape.linear("l", d_in, d_out, batch_size=n)
        x, go = torch.randn(n, d_in, generator=gen), torch.randn(n, d_out, generator=gen)
        cases.append((nn.Linear(d_in, d_out), x, go, shape))
    out = []
    for module, x, go, shape in cases:
        helper = helper_for(module)
        assert helper is not None, "Linear and Conv2d have helpers"
        layer = KFACLayer("layer", module, helper)
        for which, capture, t in (("A", layer.accumulate_a, x), ("G", layer.accumulate_g, go)):

            def fn(
                capture: Callable = capture, t: torch.Tensor = t, layer: KFACLayer = layer
            ) -> None:
                layer.clear_pending()
                capture(t, "expand", torch.float32)

            out.append(Sample(factor_work(shape, which, "expand", 4), median_time(fn, repeats)))
    return out


def measure_compute(threads: int = 1, repeats: int = 5) -> list[Sample]:
    """Time the package's factor, decomposition, unpacking and preconditioning kernels."""
    from dpkfac.comm import pack_triangle, unpack_triangle
    from dpkfac.curvature import EigenDecomposition, InverseDecomposition, precondition
    from dpkfac.device import TableCache

    tables = TableCache()  # the indices are made once per size, as in a run

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    out: list[Sample] = []

    def timed(kind: str, work: float, fn: Callable[[], object], runs: int = repeats) -> None:
        out.append(Sample.compute(kind, work, median_time(fn, runs)))

    try:
        out += _factor_samples(gen, repeats)
        for d in (32, 64, 128, 256, 512, 1024):
            x = torch.randn(d, 2 * d, generator=gen)
            factor = x @ x.t() / (2 * d)
            eigh = partial(EigenDecomposition.compute, factor, damping=1e-3, dtype=torch.float32)
            inverse = partial(
                InverseDecomposition.compute, factor, damping=1e-3, dtype=torch.float32
            )
            timed("eigh", 9.0 * d**3, eigh, max(3, repeats // (1 + d // 256)))
            timed("inverse", 2.0 * d**3, inverse)
        for d in (65, 145, 289, 577, 1025):
            packed = pack_triangle(torch.randn(d, d, generator=gen), tables)
            timed("unpack", 4.0 * d * d, partial(unpack_triangle, packed, d, tables))
        for g, a in ((16, 64), (64, 128), (128, 256), (256, 512), (512, 1024)):
            qa = EigenDecomposition(
                torch.linalg.qr(torch.randn(a, a, generator=gen))[0], torch.rand(a)
            )
            qg = EigenDecomposition(
                torch.linalg.qr(torch.randn(g, g, generator=gen))[0], torch.rand(g)
            )
            grad = torch.randn(g, a, generator=gen)
            apply = partial(precondition, grad, qa, qg, damping=1e-3)
            timed("precondition", 4.0 * g * a * (g + a), apply)
        for rows, d_in, d_out in _FORWARD_BACKWARD:
            layer = torch.nn.Linear(d_in, d_out)
            x = torch.randn(rows, d_in, generator=gen)

            def fwd_bwd(layer: torch.nn.Module = layer, x: torch.Tensor = x) -> None:
                layer.zero_grad()
                layer(x.requires_grad_()).sum().backward()

            timed("forward_backward", 6.0 * rows * (d_in + 1) * d_out, fwd_bwd)
    finally:
        torch.set_num_threads(before)
    return out


def calibrate_local(
    world_size: int = 2, threads: int = 1, name: str = "cpu_gloo_local"
) -> Hardware:
    """Measure this machine (gloo on localhost, ``threads`` per rank) and fit a model."""
    samples = measure_collectives(world_size) + measure_compute(threads)
    hw = calibrate(samples, name=name)
    stamp = time.strftime("%Y-%m-%d")
    source = (
        f"dpkfac.costmodel.calibrate_local(world_size={world_size}, threads={threads}) "
        f"on {os.uname().nodename} ({os.cpu_count()} CPUs, torch {torch.__version__}), {stamp}"
    )
    # Micro-benchmarks cannot observe overlap: take the value fitted for CPU
    # ranks with a core each (see the cpu_gloo_local preset); refit it from
    # measured runs with dpkfac.costmodel.fitting.fit_overlap.
    return Hardware(
        hw.name, hw.links, hw.engines, (source, *hw.sources), overlap=0.9, backend="gloo"
    )
