"""Resolving "auto": the cost model prices every candidate a scheme offers and picks one.

A scheme lists the resolved options it could run with
(:meth:`~dpkfac.plan.Scheme.candidates`); :func:`resolve` predicts each for
the measured layer shapes, the update schedule and the hardware, and takes
the fastest, letting traffic decide among near-ties. The preconditioner calls
it at the first step, once the ranks agree on the shapes, before the strategy
is configured; :func:`dpkfac.costmodel.predict` calls it to predict the
choice the run would make. No strategy imports this module.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from dpkfac.options import KFACOptions
from dpkfac.plan import LayerShape, Scheme, StrategyOptions
from dpkfac.plan.hardware import Hardware
from dpkfac.plan.options import checked_at
from dpkfac.plan.presets import PRESETS, hardware_option

__all__ = ["SCHEDULE_HORIZON", "Candidate", "average_interval", "log_choice", "resolve"]

log = logging.getLogger("dpkfac")

#: Steps over which a callable update schedule is averaged to price "auto".
SCHEDULE_HORIZON = 1000


def average_interval(schedule: int | Callable[[int], int], name: str = "inv_update_steps") -> int:
    """An update interval as an int: a callable schedule's mean over the first steps.

    The preconditioner updates at step ``s`` when ``s % schedule(s) == 0``;
    the mean interval is :data:`SCHEDULE_HORIZON` over the number of such
    steps (rounded, at least 1).
    """
    if not callable(schedule):
        return int(schedule)
    fires = sum(1 for s in range(SCHEDULE_HORIZON) if s % checked_at(name, schedule, s) == 0)
    return max(1, round(SCHEDULE_HORIZON / max(fires, 1)))


@dataclass(frozen=True)
class Candidate:
    """One configuration "auto" priced.

    Attributes:
        options: the resolved options.
        label: what they chose, in a few words (``k=2, f=1/2``).
        iteration: predicted seconds per step, averaged over the schedule.
        comm_bytes: predicted bytes handed to collectives per step and rank.
        wire_bytes: predicted bytes on the wire per step and rank.
    """

    options: StrategyOptions
    label: str
    iteration: float
    comm_bytes: float
    wire_bytes: float = 0.0


def resolve(
    scheme: type[Scheme],
    options: StrategyOptions,
    *,
    shapes: Sequence[LayerShape],
    world_size: int,
    kfac: KFACOptions | None = None,
    hardware: Hardware | None = None,
    allow: Callable[[StrategyOptions], bool] | None = None,
) -> tuple[StrategyOptions, list[Candidate]]:
    """The options a run ends up with, and every candidate priced on the way.

    Args:
        scheme: the run's scheme.
        options: the options it was given.
        shapes: the layers with the step's batch (all its micro-batches).
        world_size: number of ranks.
        kfac: the preconditioner's common options (the update schedule).
        hardware: the hardware a prediction assumes: where the run would
            measure its model at start-up, this stands for the measurement.
            None at run time (the options hold what was measured).
        allow: which candidates the run can take (None: all); the preconditioner
            leaves out the overlapped ones where it cannot overlap (a DDP model,
            a loss scaler).

    Among the candidates within the scheme's tolerance
    (:meth:`~dpkfac.plan.Scheme.tuning`) of the lowest predicted iteration
    time, the one handing the fewest bytes to collectives per step wins, then
    the one sending the fewest on the wire, then the scheme's preference.
    """
    kfac = KFACOptions() if kfac is None else kfac
    if hardware is not None and scheme.measures_hardware(options):
        options = scheme.with_hardware(options, hardware)
    if scheme.resolved(options):
        return options, []
    tuning = scheme.tuning(options)
    model = hardware_option(tuning.hardware) or PRESETS["cpu_gloo_local"]
    f_every, i_every = tuning.intervals or (
        average_interval(kfac.factor_update_steps, "factor_update_steps"),
        average_interval(kfac.inv_update_steps),
    )
    # The shapes hold the step's batch (all its micro-batches) already.
    fixed = replace(
        kfac, factor_update_steps=f_every, inv_update_steps=i_every, accumulation_steps=1
    )
    # predict() resolves the options it is given through here: imported at call time.
    from dpkfac.costmodel.predict import predict

    candidates = []
    offered = [c for c in scheme.candidates(options, world_size) if allow is None or allow(c)]
    if not offered:
        raise ValueError(f"strategy {scheme.name!r}: no candidate of {options!r} can run here")
    for opts in offered:
        label = scheme.describe(opts) or "as published"
        if world_size == 1:
            candidates.append(Candidate(opts, label, 0.0, 0.0))
            continue
        pred = predict(
            shapes,
            strategy=scheme.name,
            world_size=world_size,
            hardware=model,
            kfac=fixed,
            options=opts,
        )
        candidates.append(
            Candidate(
                opts, label, pred.iteration_avg, pred.bytes_per_step, pred.wire_bytes_per_step
            )
        )
    fastest = min(c.iteration for c in candidates)
    near = [c for c in candidates if c.iteration <= fastest * (1 + tuning.tolerance)]
    best = min(near, key=lambda c: (c.comm_bytes, c.wire_bytes, scheme.preference(c.options)))
    return best.options, candidates


def log_choice(
    scheme: type[Scheme], world_size: int, chosen: StrategyOptions, candidates: Sequence[Candidate]
) -> None:
    """Log the choice and every candidate's prediction (logger "dpkfac")."""
    if not candidates:
        return
    log.info(
        "%s: chose %s at P=%d (predicted %.2f ms/step; candidates: %s)",
        scheme.name,
        scheme.describe(chosen) or "as published",
        world_size,
        1e3 * min(c.iteration for c in candidates),
        ", ".join(f"{c.label}: {1e3 * c.iteration:.2f} ms" for c in candidates),
    )
