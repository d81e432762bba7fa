"""Fitting a :class:`~dpkfac.costmodel.Hardware` model to samples and to measured runs.

:func:`calibrate` fits links and engines to :class:`~dpkfac.costmodel.Sample`
records (work against seconds) by non-negative least squares (:func:`nnls`).
Micro-benchmarks (:mod:`dpkfac.costmodel.calibration`) time kernels and
collectives alone; a real run also pays Python overhead, allocator traffic
and contention that only its own phase timings show, so the model is also
fitted to measured runs (:class:`Measurement`, which
``experiments.bench.predict`` builds from a benchmark's rows).

Measured phase seconds are compared the way the cost model defines them:
compute phases on the busiest rank, communication phases on the rank that
waited least (the others also wait for slower ranks, which the model books
to those ranks' compute). The least wait is best taken step by step
(:attr:`Measurement.least_wait`), because which rank arrives last changes
from step to step.

**Shared cores.** The model gives every rank a device of its own. When P
single-threaded CPU ranks share C cores, above P = C each rank computes at
C/P of a core's speed on average: predictions for them use the engines
``scaled`` by ``min(1, C/P)``. The engines are fitted to the measurements
with a core per rank where there are any (a rank with little work on a
shared core often has the core to itself, so scaling its seconds by C/P
would pull the engines off); only without them are oversubscribed compute
seconds scaled by C/P and fitted. Their collectives do not follow that
rule: gloo's transfers slow down far less than C/P, while every all-reduce
gains milliseconds of start-up (ranks wait to be scheduled at each step of
the ring). So the links are fitted per regime: the one-core-per-rank model
takes its links from the measurements with a core per rank only, and each
oversubscribed world size gets a :class:`Regime` of links fitted to its own
communication phases (:func:`shared_core_links`). Without one (held-out
predictions) the links are slowed by C/P like the engines.

**Landing.** A communication phase also holds the memory passes that land
each buffer once it arrives (averaging, copying back, rebuilding triangle-
packed factors: :func:`~dpkfac.plan.hardware.landing_bytes`, kind
"unpack"). Their bytes are a fixed multiple of the collective's wire bytes
per kind, so fitted beside the links they could not be told apart from
them; they keep the base model's "unpack" engine (a kernel timed alone,
:mod:`dpkfac.costmodel.calibration`) and only the rest of each phase is
fitted to the links (``calibrate(fixed=...)``).

**Forward/backward.** The model derives the forward/backward time from the
K-FAC layers' flops alone, and a real network's normalisation and attention
kernels run at a very different rate, so that rate is fitted per model
(:func:`with_forward_backward`).

**Overlap.** Pipelined factor traffic runs during the forward/backward; the
fraction that truly overlaps is a property of the machine, fitted to the
measured wait (:func:`fit_overlap`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from dpkfac.costmodel.optimizers import step_bytes
from dpkfac.costmodel.predict import Prediction, choose_options, predict
from dpkfac.costmodel.shapes import ModelShapes
from dpkfac.costmodel.timing import COMM_PHASES, COMPUTE_PHASES, forward_backward_work
from dpkfac.options import KFACOptions, StrategyOptions
from dpkfac.plan import canonical_name, scheme_of, scheme_options
from dpkfac.plan.hardware import COLLECTIVE_KINDS, Engine, Hardware, Link, Sample
from dpkfac.plan.hardware import scaled as scaled_hardware

__all__ = [
    "Fit",
    "Measurement",
    "ModelFit",
    "Regime",
    "calibrate",
    "calibrate_measurements",
    "core_share",
    "fit",
    "fit_overlap",
    "hardware_for",
    "measured_phases",
    "nnls",
    "phase_samples",
    "phases_from_timings",
    "predict_measurement",
    "shared_core_links",
    "with_forward_backward",
]

Key = tuple[str, str]


def nnls(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """``argmin ||A x - y||`` subject to ``x >= 0`` (``scipy.optimize.nnls``).

    Columns are scaled to unit norm first, because latency columns (calls)
    and throughput columns (bytes, flops) differ by ten orders of magnitude.
    A negative latency or rate would be meaningless, hence the constraint.
    """
    # Imported here: scipy.optimize adds about a second to ``import dpkfac``.
    from scipy.optimize import nnls as scipy_nnls

    if not rows:
        return []
    a = np.asarray(rows, dtype=np.float64)
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0.0] = 1.0
    x, _ = scipy_nnls(a / norms, np.asarray(y, dtype=np.float64))
    return [float(v) for v in x / norms]


def calibrate(
    samples: Iterable[Sample],
    *,
    name: str = "calibrated",
    base: Hardware | None = None,
    relative: bool = True,
    log2p: bool | None = None,
    fixed: Sequence[str] = (),
) -> Hardware:
    """Fit links and engines to measurements by non-negative least squares.

    Every kind seen in the samples gets two unknowns (seconds per call and
    seconds per byte or flop); samples may mix kinds (a measured phase that
    ran several collective kinds), since the model is linear in all of them.
    Collective kinds get a third, ``alpha_log2p`` (start-up seconds per
    doubling of the world size), when the samples span more than one world
    size above 1: with a single one it cannot be told apart from ``alpha``.

    Args:
        base: source of the kinds the samples do not cover. Without it, a
            missing "reduce"/"broadcast" link copies the fitted all-reduce
            link, and missing engines raise ValueError.
        relative: minimise relative rather than absolute residuals, so short
            phases weigh as much as long ones (the model should be within a
            fixed percentage of every phase).
        log2p: fit ``alpha_log2p`` (None: when the collective samples span
            several world sizes above 1).
        fixed: compute kinds priced by ``base``, not fitted: their predicted
            seconds are taken off each sample first.
    """
    if fixed and base is None:
        raise ValueError(f"fixed kinds {list(fixed)} need a base hardware model")
    samples = [_without(s, fixed, base) for s in samples] if base and fixed else list(samples)
    samples = [s for s in samples if s.seconds > 0]
    kinds = sorted({k for s in samples for k in s.work})
    if not kinds:
        raise ValueError("no samples with positive seconds")
    if log2p is None:
        sizes = {s.world_size for s in samples if set(s.work) & set(COLLECTIVE_KINDS)}
        log2p = len(sizes - {1}) > 1
    rows, y = [], []
    for s in samples:
        weight = 1.0 / s.seconds if relative else 1.0
        row = []
        for k in kinds:
            calls, amount = s.work.get(k, (0.0, 0.0))
            row += [calls * weight, amount * weight]
            if log2p and k in COLLECTIVE_KINDS:
                row.append(calls * math.log2(max(s.world_size, 1)) * weight)
        rows.append(row)
        y.append(s.seconds * weight)
    x = iter(nnls(rows, y))
    links, engines = (dict(base.links), dict(base.engines)) if base else ({}, {})
    for k in kinds:
        per_call, per_unit = next(x), next(x)
        if k in COLLECTIVE_KINDS:
            links[k] = Link(per_call, per_unit, alpha_log2p=next(x) if log2p else 0.0)
        else:
            engines[k] = Engine(math.inf if per_unit == 0 else 1.0 / per_unit, latency=per_call)
    if "allreduce" not in links:
        raise ValueError("calibrate needs all-reduce samples (or a base hardware model)")
    stand_ins = [engines[k] for k in ("factor", "precondition", "forward_backward") if k in engines]
    if "matmul" not in engines and stand_ins:
        engines["matmul"] = stand_ins[0]
    missing = {"matmul", "eigh", "inverse"} - set(engines)
    if missing:
        raise ValueError(f"no samples for {sorted(missing)} and no base hardware model")
    source = f"calibrated from {len(samples)} samples of {', '.join(kinds)}"
    if base is None:
        return Hardware(name, links, engines, (source,))
    return Hardware(name, links, engines, (source, *base.sources), base.overlap, base.backend)


#: The kinds a run's phases are not fitted to (see "Landing" above).
LANDING = ("unpack",)


def _without(sample: Sample, kinds: Sequence[str], base: Hardware) -> Sample:
    """``sample`` less the work of ``kinds`` and the seconds ``base`` gives it."""
    known = {k: w for k, w in sample.work.items() if k in kinds}
    if not known:
        return sample
    rest = {k: w for k, w in sample.work.items() if k not in kinds}
    return replace(sample, work=rest, seconds=sample.seconds - base.time(known, sample.world_size))


@dataclass(frozen=True)
class Measurement:
    """One measured run: what ran, where, and what every rank's ``timings()`` said.

    Attributes:
        model: name grouping the runs of one model (its forward/backward
            rate is fitted per model).
        shapes: the model's K-FAC layer shapes as it ran.
        strategy: the strategy's name (normalised to the registered
            spelling), or None for plain data parallelism.
        world_size: number of ranks ``P``.
        kfac: the preconditioner's common options (without K-FAC the bucket
            cap still sets the gradient buckets).
        options: the strategy's options (default: its defaults; None
            without a strategy).
        timings: per rank, ``timings()`` seconds per phase of an update step
            (factors and decompositions every step), summed over ``steps``.
        least_wait: per communication phase, the least wait over ranks taken
            step by step (None: the smallest per-rank total instead).
        forward_backward: seconds of the forward and backward pass.
        steps: how many steps ``timings`` cover.
        cores: CPU cores the ranks shared (None: a device per rank).
        fusion_plan: the fusion buckets a pipelined strategy fixed in the run.
        param_itemsize: bytes per parameter element.
        measured_hardware: the hardware model the strategy measured at start-up
            (spd_kfac places decompositions from it), replayed when the run
            itself is predicted.
        optimizer: the first-order optimizer the run stepped
            (:data:`dpkfac.costmodel.optimizers.OPTIMIZER_STATE`).
        optimizer_seconds: seconds of its step, per step (0: not measured).
    """

    model: str
    shapes: ModelShapes
    strategy: str | None
    world_size: int
    kfac: KFACOptions = field(default_factory=KFACOptions)
    options: StrategyOptions | None = None
    timings: tuple[Mapping[str, float], ...] = ()
    least_wait: Mapping[str, float] | None = None
    forward_backward: float = 0.0
    steps: int = 1
    cores: int | None = None
    fusion_plan: tuple[tuple[Key, ...], ...] | None = None
    param_itemsize: int = 4
    measured_hardware: Hardware | None = None
    optimizer: str = "sgd_momentum"
    optimizer_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores must be >= 1 or None, got {self.cores}")
        if self.timings and len(self.timings) != self.world_size:
            raise ValueError(f"{len(self.timings)} ranks' timings for world size {self.world_size}")
        if self.strategy is None and self.options is not None:
            raise ValueError("strategy options given without a strategy")
        if self.strategy is not None:
            name = canonical_name(self.strategy)
            object.__setattr__(self, "strategy", name)
            if self.options is None:
                object.__setattr__(self, "options", scheme_options(name))


@dataclass(frozen=True)
class Regime:
    """Links (and overlap) fitted to the runs of one oversubscribed world size.

    Attributes:
        links: alpha-beta model per collective kind.
        overlap: fraction of pipelined traffic hidden (None: the hardware's).
    """

    links: Mapping[str, Link]
    overlap: float | None = None


@dataclass(frozen=True)
class ModelFit:
    """One model's runs and the hardware fitted for it (its own forward/backward rate)."""

    hardware: Hardware
    measurements: tuple[Measurement, ...]


@dataclass(frozen=True)
class Fit:
    """Everything :func:`fit` found.

    Attributes:
        hardware: the one-core-per-rank model (shared forward/backward rate).
        regimes: per oversubscribed world size, its links and overlap.
        models: per model, its runs and its hardware (forward/backward rate
            and the fitted overlap).
    """

    hardware: Hardware
    regimes: Mapping[int, Regime]
    models: Mapping[str, ModelFit]


def core_share(m: Measurement) -> float:
    """Fraction of a core each rank had: ``min(1, cores / P)`` (1 with a device per rank)."""
    return 1.0 if m.cores is None else min(1.0, m.cores / m.world_size)


def predict_measurement(
    m: Measurement,
    hardware: Hardware,
    *,
    world_size: int | None = None,
    replay_plan: bool = True,
) -> Prediction:
    """The cost model's prediction of a measured run (optionally at another world size).

    Args:
        world_size: predict at this many ranks instead.
        replay_plan: reuse the run's fusion plan and the hardware model it
            measured at start-up (at its own world size only; elsewhere a run
            would plan from its ready times and measure the hardware it runs on).
    """
    p = int(world_size or m.world_size)
    replay = replay_plan and p == m.world_size
    options = m.options
    if replay and m.strategy is not None and options is not None and m.measured_hardware:
        options, _ = choose_options(
            scheme_of(m.strategy),
            options,
            shapes=m.shapes,
            world_size=p,
            kfac=m.kfac,
            hardware=m.measured_hardware,
        )
    return predict(
        m.shapes,
        strategy=m.strategy,
        world_size=p,
        hardware=hardware,
        kfac=m.kfac,
        options=options,
        param_itemsize=m.param_itemsize,
        fusion_plan=m.fusion_plan if replay else None,
        optimizer=m.optimizer,
    )


def phases_from_timings(
    timings: Sequence[Mapping[str, float]], least_wait: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Seconds per phase as the cost model defines them, from per-rank timings.

    Compute phases: the busiest rank. Communication phases: ``least_wait``
    when given, else the smallest per-rank total.
    """
    out = {p: max(r[p] for r in timings) for p in COMPUTE_PHASES}
    for p in COMM_PHASES:
        out[p] = float(least_wait[p]) if least_wait else min(r[p] for r in timings)
    return out


def measured_phases(m: Measurement) -> dict[str, float]:
    """Seconds per phase of a run as the cost model defines them (see the module docstring)."""
    return phases_from_timings(m.timings, m.least_wait)


def phase_samples(m: Measurement, hardware: Hardware) -> tuple[list[Sample], list[Sample]]:
    """Compute and communication calibration samples of a run, as measured.

    ``hardware`` only decides a fusion plan the run did not record; the work
    of every phase is exact.
    """
    pred = predict_measurement(m, hardware)
    compute: list[Sample] = []
    comm: list[Sample] = []
    for s in pred.samples(list(m.timings), steps=m.steps, comm_seconds=measured_phases(m)):
        (comm if set(s.work) & set(COLLECTIVE_KINDS) else compute).append(s)
    nbytes = step_bytes(m.shapes.num_params, m.param_itemsize, m.optimizer)
    if m.optimizer_seconds > 0 and nbytes:
        compute.append(Sample({"optimizer": (1.0, float(nbytes))}, m.optimizer_seconds))
    return compute, comm


def calibrate_measurements(
    measurements: Iterable[Measurement], base: Hardware, name: str = "calibrated"
) -> Hardware:
    """The one-core-per-rank hardware fitted to the runs' phase timings.

    Engines and links come from the runs whose ranks had a core each; only
    without such runs do the engines come from oversubscribed ones, scaled to
    a full core (roughly: see the module docstring). Kinds the runs do not
    cover keep ``base``'s values.
    """
    ms = list(measurements)
    own = {id(m) for m in ms if core_share(m) >= 1.0} or {id(m) for m in ms}
    samples: list[Sample] = []
    for m in ms:
        share = core_share(m)
        compute, comm = phase_samples(m, base)
        if id(m) in own:
            samples += [Sample(s.work, s.seconds * share, s.world_size) for s in compute]
        if share >= 1.0:
            samples += comm
    # No per-doubling latency: runs on one machine span too few world sizes
    # with a core per rank to tell it from the constant start-up.
    return calibrate(samples, name=name, base=base, log2p=False, fixed=LANDING)


def shared_core_links(measurements: Iterable[Measurement], hardware: Hardware) -> dict[int, Regime]:
    """Links fitted to each oversubscribed world size's communication phases, as measured.

    Kinds its runs do not cover fall back to ``hardware``'s links slowed by
    the core share. Empty without runs whose ranks shared cores.
    """
    shared = [m for m in measurements if core_share(m) < 1.0]
    out: dict[int, Regime] = {}
    for p in dict.fromkeys(m.world_size for m in shared):
        mine = [m for m in shared if m.world_size == p]
        samples = [s for m in mine for s in phase_samples(m, hardware)[1]]
        if not samples:
            continue
        base = scaled_hardware(hardware, network=core_share(mine[0]))
        fitted = calibrate(
            samples, name=f"shared cores, P={p}", base=base, log2p=False, fixed=LANDING
        )
        out[p] = Regime(dict(fitted.links))
    return out


def hardware_for(
    m: Measurement, hardware: Hardware, regimes: Mapping[int, Regime] | None = None
) -> Hardware:
    """``hardware`` (one core per rank) as the run's ranks had it, with :func:`core_share`
    of a core each.

    Engines are slowed by the share; links come from the world size's
    :class:`Regime` when there is one, else are slowed alike.
    """
    share, regime = core_share(m), (regimes or {}).get(m.world_size)
    if share >= 1.0:
        return hardware
    out = scaled_hardware(hardware, compute=share, network=share)
    if regime is not None:
        overlap = hardware.overlap if regime.overlap is None else regime.overlap
        out = replace(out, links=dict(regime.links), overlap=overlap)
    # Pipelined factors are unpacked in step() as each all-reduce is waited
    # on: the ranks that finished the backward pass early unpack while the
    # last one still computes, so the rank that waits least (the last)
    # unpacks alone, on a core of its own.
    return replace(out, engines={**out.engines, "unpack": hardware.engine("unpack")})


def with_forward_backward(hardware: Hardware, measurements: Sequence[Measurement]) -> Hardware:
    """``hardware`` with the forward/backward rate that reproduces the runs' measured median.

    The runs should be of one model (the first one's shapes are priced);
    runs whose ranks shared cores are scaled to one core per rank first.
    Plain data parallelism at P > 1 is left out where other runs exist: it is
    DDP, whose forward/backward also waits on the all-reduces it left exposed.
    """
    plain = [m for m in measurements if m.strategy is not None or m.world_size == 1]
    measurements = plain or list(measurements)
    if not measurements:
        return hardware
    measured = statistics.median(m.forward_backward * core_share(m) for m in measurements)
    predicted = hardware.time(forward_backward_work(measurements[0].shapes), 1)
    if measured <= 0 or predicted <= 0:
        return hardware
    engine, scale = hardware.engine("forward_backward"), predicted / measured
    fb = Engine(rate=engine.rate * scale, latency=engine.latency * scale)
    return replace(hardware, engines={**hardware.engines, "forward_backward": fb})


def _best_overlap(
    models: Iterable[ModelFit], world_size: int | None, regimes: Mapping[int, Regime]
) -> float | None:
    """Least-squares overlap (relative error) over the runs with overlapped phases at
    ``world_size`` (None: the runs with a core per rank), priced with ``regimes``."""
    num = den = 0.0
    for fitted in models:
        for m in fitted.measurements:
            kept = core_share(m) >= 1.0 if world_size is None else m.world_size == world_size
            if m.world_size == 1 or not kept:
                continue
            hardware = hardware_for(m, fitted.hardware, regimes)
            serial_pred = predict_measurement(m, replace(hardware, overlap=0.0))
            if not serial_pred.overlapped_phases:
                continue
            hidden_pred = predict_measurement(m, replace(hardware, overlap=1.0))
            measured_all = measured_phases(m)
            for phase in serial_pred.overlapped_phases:
                measured = measured_all[phase]
                if measured <= 0:
                    continue
                serial = serial_pred.update.phases[phase]
                hidden = hidden_pred.update.phases[phase]
                d, w = hidden - serial, 1.0 / measured**2
                num += w * d * (measured - serial)
                den += w * d * d
    return min(1.0, max(0.0, num / den)) if den > 0 else None


def fit_overlap(
    models: Iterable[ModelFit], regimes: Mapping[int, Regime] | None = None
) -> tuple[float | None, dict[int, Regime]]:
    """The ``overlap`` that best explains the measured wait on pipelined traffic, per regime.

    The wait after the backward pass lies between the fully hidden
    prediction (overlap 1: only the fusion schedule's tail, then unpacking)
    and the serial one (overlap 0: every transfer after the compute). Least
    squares in relative error over the runs at P > 1 whose strategy
    pipelines gives the fraction, separately for the runs with a core per
    rank and for each oversubscribed world size (there the transfers take
    turns with compute on shared cores very differently). It is a property
    of the machine, so one value serves every model.

    Returns:
        The overlap for one core per rank (None without such runs: keep the
        hardware's), and the regimes with theirs.
    """
    models = list(models)
    out: dict[int, Regime] = {}
    for p, regime in (regimes or {}).items():
        best = _best_overlap(models, p, {p: regime})
        out[p] = regime if best is None else replace(regime, overlap=best)
    return _best_overlap(models, None, {}), out


def fit(measurements: Iterable[Measurement], base: Hardware, name: str = "calibrated") -> Fit:
    """Calibrate, fit the shared-core regimes, then each model's forward/backward and the overlap.

    Args:
        measurements: runs of update steps (factors and decompositions every step).
        base: source of the kinds the runs do not cover (and of the plans
            of runs that recorded none).
        name: name of the fitted hardware.
    """
    ms = list(measurements)
    hardware = calibrate_measurements(ms, base, name)
    by_model = {m.model: tuple(r for r in ms if r.model == m.model) for m in ms}
    models = {  # in order of first appearance
        model: ModelFit(with_forward_backward(hardware, runs), runs)
        for model, runs in by_model.items()
    }
    overlap, regimes = fit_overlap(models.values(), shared_core_links(ms, hardware))
    if overlap is not None:
        models = {
            model: replace(mf, hardware=replace(mf.hardware, overlap=overlap))
            for model, mf in models.items()
        }
    return Fit(hardware, regimes, models)
