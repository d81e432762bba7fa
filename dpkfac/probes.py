"""Start-up measurements over a communicator: the group's hardware model and link model.

A strategy that places work by predicted time (spd_kfac's local-or-broadcast
rule, grouped's "auto") needs a hardware model of the group it runs on; the
preconditioner measures it here when its options ask for it
(:meth:`dpkfac.plan.Scheme.measures_hardware`). spd_kfac's fusion rule needs
an alpha-beta model of the all-reduce, measured and fitted here at the end of
its profiling (:func:`fit_comm_model`: the plan floor holds the model, not the
fit). The sizes of every probe are fixed on the plan floor
(:mod:`dpkfac.plan.probes`), which books them as "setup" traffic, so the
prediction and the run cannot disagree on them. Every function here is a
collective: every rank of the communicator calls it, except the pure fit.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from dpkfac.comm import Communicator
from dpkfac.plan.fusion import CommModel
from dpkfac.plan.hardware import Engine, Hardware, Link, Sample, gloo_link
from dpkfac.plan.presets import PRESETS
from dpkfac.plan.probes import (
    ALLREDUCE_PROBE_NUMELS,
    BROADCAST_PROBE_NUMELS,
    EIGH_PROBE_DIMS,
    MEASURE_ALLREDUCE_NUMELS,
    PROBE_REPEATS,
)

__all__ = [
    "HardwareFit",
    "fit_comm_model",
    "measure_comm_model",
    "measure_in_group",
    "median_time",
    "start_up_hardware",
]

#: Fits a hardware model to samples, called as ``fit(samples, base=..., name=...)``: the
#: cost model's :func:`dpkfac.costmodel.fitting.calibrate`, handed in by the caller
#: because measurement sits on a floor below the cost model.
HardwareFit = Callable[..., Hardware]


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs, after one warm-up run."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_in_group(
    comm: Communicator, base: Hardware, fit: HardwareFit, name: str = "measured"
) -> Hardware:
    """This rank's ``eigh`` engine and the group's broadcast and all-reduce links, measured
    in-process.

    A collective: every rank of ``comm`` calls it. Each rank times ``eigh`` of
    a few factor sizes on its device, a few broadcasts of rank 0's buffers and a few
    all-reduces (the gradients' link: priced from the preset, a loopback's, the run's
    "auto" took a 1 Gbit/s network for a 14 Gbit/s one and chose a configuration 15%
    slower there). The reduce, reduce-scatter and all-gather links follow from the
    all-reduce's (:func:`~dpkfac.plan.hardware.gloo_link` on gloo).
    The ranks meet (a tiny all-reduce) before each probe size, and the
    fastest of the repeats counts, so a rank that arrives late (still timing
    its decompositions, or building another model) does not pass its delay
    off as transfer time. ``fit`` fits this rank's samples; the fitted
    parameters are then agreed by an element-wise maximum (the slowest rank's
    view), so every rank returns the same model and a placement computed from
    it is the same everywhere. The
    collectives are accounted in the "setup" category (:data:`MEASURE_COLLECTIVES`).

    Args:
        comm: the preconditioner's communicator.
        base: where the other links and engines come from.
        fit: the fit of samples to a hardware model (:data:`HardwareFit`).
        name: the result's name.
    """
    device = comm.device if comm.device.type == "cuda" else torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    samples: list[Sample] = []

    def synced(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            out = fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return out

        return run

    for d in EIGH_PROBE_DIMS:
        x = torch.randn(d, d, generator=gen).to(device)
        factor = x @ x.T / d + torch.eye(d, device=device)

        def decompose(f: torch.Tensor = factor) -> object:
            return torch.linalg.eigh(f)

        seconds = median_time(synced(decompose), PROBE_REPEATS)
        samples.append(Sample.compute("eigh", 9.0 * d**3, seconds))
    probes = (("broadcast", BROADCAST_PROBE_NUMELS), ("allreduce", MEASURE_ALLREDUCE_NUMELS))
    for kind, numels in probes:
        for numel in numels:
            buf = torch.zeros(numel, dtype=torch.float32, device=comm.device)
            comm.agree_max([0.0])  # meet first
            times = []
            for _ in range(PROBE_REPEATS):
                start = time.perf_counter()
                if kind == "broadcast":
                    comm.broadcast([buf], 0, "setup")
                else:
                    comm.allreduce_mean([buf], "setup")
                times.append(time.perf_counter() - start)
            samples.append(Sample.collective(kind, 4 * numel, min(times), comm.size))
    fitted = fit(samples, base=base, name=name)
    eigh, bcast, reduce = fitted.engine("eigh"), fitted.link("broadcast"), fitted.link("allreduce")
    inv_rate, latency, alpha, beta, ar_alpha, ar_beta = comm.agree_max(
        [1.0 / eigh.rate, eigh.latency, bcast.alpha, bcast.beta, reduce.alpha, reduce.beta]
    )
    allreduce = Link(ar_alpha, ar_beta)
    # The other kinds follow from the all-reduce as the backend runs them (gloo's own
    # algorithms; elsewhere the ring's, per accounted wire byte, as the all-reduce).
    derived = {
        kind: gloo_link(kind, allreduce, comm.size) if comm.backend == "gloo" else allreduce
        for kind in ("reduce", "reduce_scatter", "all_gather")
    }
    return replace(
        base,
        name=name,
        links={**base.links, **derived, "allreduce": allreduce, "broadcast": Link(alpha, beta)},
        engines={**base.engines, "eigh": Engine(1.0 / inv_rate if inv_rate > 0 else 1e30, latency)},
        sources=(f"measured in-process on {comm.size} ranks by measure_in_group",),
        backend=comm.backend,
    )


def start_up_hardware(comm: Communicator, fit: HardwareFit) -> Hardware:
    """The model a strategy measures when it starts: ``measure_in_group`` on this machine's preset.

    A collective over ``comm`` (nothing is measured on one rank: no
    collective would ever be timed there).
    """
    base = PRESETS["cpu_gloo_local"]
    if not comm.active:
        return base
    return measure_in_group(comm, base, fit)


def fit_comm_model(samples: Sequence[tuple[float, float]]) -> CommModel:
    """Least-squares fit of ``seconds = alpha + beta * bytes``.

    Measured timings are noisy, and a negative intercept or slope would make
    the fusion rule nonsensical, so the fit is constrained to non-negative
    parameters: if the unconstrained intercept is negative, the slope is
    refit through the origin; if the slope is negative, alpha is the mean.

    Args:
        samples: ``(bytes, seconds)`` pairs, with at least two distinct sizes.

    Returns:
        The fitted model.
    """
    if len(samples) < 2:
        raise ValueError("need at least two (bytes, seconds) samples")
    xs = [float(x) for x, _ in samples]
    ys = [float(y) for _, y in samples]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("need at least two distinct message sizes")
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    alpha = my - beta * mx
    if beta < 0:
        return CommModel(alpha=max(my, 0.0), beta=0.0)
    if alpha < 0:
        beta = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
        return CommModel(alpha=0.0, beta=max(beta, 0.0))
    return CommModel(alpha=alpha, beta=beta)


def measure_comm_model(comm: Communicator) -> CommModel:
    """Time blocking all-reduces of a few sizes on ``comm`` and fit alpha and beta.

    The fit is this rank's; the caller agrees on it with the others.
    """
    samples = []
    for numel in ALLREDUCE_PROBE_NUMELS:
        buf = torch.zeros(numel, dtype=torch.float32, device=comm.device)
        for _ in range(PROBE_REPEATS):
            start = time.perf_counter()
            comm.allreduce_sum(buf, "setup")
            samples.append((buf.numel() * buf.element_size(), time.perf_counter() - start))
    return fit_comm_model(samples)
