"""Predicted bytes, phase seconds, memory and iteration time of one strategy.

Bytes, calls, wire bytes and memory come from :mod:`dpkfac.costmodel.traffic`
and are exact; seconds come from :mod:`dpkfac.costmodel.timing` (work per
phase and rank, priced by a :class:`~dpkfac.costmodel.hardware.Hardware`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dpkfac.assignment import LayerShape
from dpkfac.costmodel import traffic as tr
from dpkfac.costmodel.hardware import Hardware, Sample
from dpkfac.costmodel.shapes import as_model_shapes
from dpkfac.costmodel.timing import (
    COMM_PHASES,
    COMPUTE_PHASES,
    StepPrediction,
    spd_plan,
    step_prediction,
    timeline,
)
from dpkfac.fusion import CommModel

__all__ = ["STRATEGIES", "Prediction", "predict", "predict_sgd"]

STRATEGIES = ("dp-kfac", "d-kfac", "spd-kfac", "sgd")


@dataclass
class Prediction:
    """Everything predicted for one strategy, model and world size.

    Attributes:
        steps: (factor update?, decomposition?) -> :class:`StepPrediction`.
        memory: ``memory_usage()`` of every rank.
        setup: one-time collectives (placement agreement, fusion planning).
        placement: owners and decomposers.
        plan: spd-kfac's fusion buckets of (layer, "A"/"G") keys.
        sgd_grad_comm: seconds of plain data parallelism's gradient all-reduce.
    """

    strategy: str
    world_size: int
    hardware: str
    steps: dict[tuple[bool, bool], StepPrediction]
    memory: list[dict[str, int]]
    setup: list[tr.Collective]
    placement: tr.Placement | None
    plan: list[list[tuple[str, str]]] | None
    sgd_grad_comm: float
    factor_update_steps: int = 1
    inv_update_steps: int = 1
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def update(self) -> StepPrediction:
        """A step that updates factors and decompositions (the papers' timing setting)."""
        return self.steps[(True, True)]

    @property
    def plain(self) -> StepPrediction:
        """A step with neither factor nor decomposition update."""
        return self.steps[(False, False)]

    def comm_stats(self, factor: bool = True, decomposition: bool = True) -> dict:
        """What ``pre.comm_stats()`` reports on every rank after one such step."""
        return self.steps[(factor, decomposition)].comm

    @property
    def setup_comm(self) -> dict[str, dict[str, int]]:
        """The one-time "setup" collectives (first step, and the end of spd-kfac's profiling)."""
        return tr.comm_counts(self.setup)

    @property
    def memory_max(self) -> int:
        """K-FAC bytes on the busiest rank."""
        return max(sum(m.values()) for m in self.memory)

    @property
    def computation(self) -> float:
        """K-FAC compute seconds of the busiest rank per update step."""
        return self.update.computation

    @property
    def communication(self) -> float:
        """Communication seconds K-FAC adds to plain data parallelism, per update step.

        The collectives' serial time (overlap with computation is the
        iteration's business, not the cost's) minus the gradient all-reduce
        that plain data parallelism pays too.
        """
        serial = sum(self.update.comm_serial.values())
        return serial if self.options.get("ddp") else serial - self.sgd_grad_comm

    @property
    def iteration(self) -> float:
        """Seconds of an update step along its critical path."""
        return self.update.iteration

    def _average(self, value: Callable[[StepPrediction], float]) -> float:
        f, i = self.factor_update_steps, self.inv_update_steps
        cycle = math.lcm(f, i)
        n_f, n_i = cycle // f, cycle // i
        return (
            value(self.steps[(True, True)])
            + (n_f - 1) * value(self.steps[(True, False)])
            + (n_i - 1) * value(self.steps[(False, True)])
            + (cycle - n_f - n_i + 1) * value(self.steps[(False, False)])
        ) / cycle

    @property
    def iteration_avg(self) -> float:
        """Seconds per step averaged over the factor and decomposition intervals."""
        return self._average(lambda s: s.iteration)

    @property
    def wire_bytes_avg(self) -> float:
        """Wire bytes per step and rank, averaged over the intervals."""
        return self._average(lambda s: sum(c.wire_bytes for c in s.collectives))

    def samples(
        self,
        timings: Sequence[Mapping[str, float]],
        steps: int = 1,
        comm_seconds: Mapping[str, float] | None = None,
    ) -> list[Sample]:
        """Calibration samples pairing measured ``timings()`` of each rank with this work.

        Args:
            timings: ``pre.timings()`` of every rank, summed over ``steps``
                update steps (factors and decompositions every step).
            steps: how many steps the timings cover.
            comm_seconds: measured seconds per communication phase, when the
                caller has a better figure than the smallest per-rank total
                (the benchmark takes the minimum over ranks step by step).

        Compute phases give one sample per rank. A communication phase gives
        one sample with the *smallest* time over ranks: waiting on a
        collective also waits for slower ranks, and the last rank to arrive
        waits only for the transfer. spd-kfac's overlapped factor
        communication is left out. The same holds when comparing predicted
        with measured phases: compute phases against the busiest rank,
        communication phases against the rank that waited least.
        """
        out = []
        step = self.update
        for phase in (*COMPUTE_PHASES, *COMM_PHASES):
            if phase == "factor_comm" and self.strategy == "spd-kfac":
                continue
            ranks = range(self.world_size) if phase in COMPUTE_PHASES else [0]
            for r in ranks:
                work = step.work[r].get(phase)
                if not work:
                    continue
                if phase in COMPUTE_PHASES:
                    seconds = timings[r][phase]
                elif comm_seconds is not None and phase in comm_seconds:
                    seconds = comm_seconds[phase]
                else:
                    seconds = min(t[phase] for t in timings)
                scaled = {k: (c * steps, a * steps) for k, (c, a) in work.items()}
                out.append(Sample(scaled, seconds, self.world_size))
        return out


def predict(
    shapes: Sequence[LayerShape],
    *,
    strategy: str,
    world_size: int,
    hardware: Hardware,
    compute_method: str = "eigen",
    kl_clip: bool | float | None = True,
    grad_reduction: str = "allreduce",
    assignment: str = "lpt",
    assignment_cost: str = "compute",
    bucket_cap_mb: float = 25.0,
    param_itemsize: int = 4,
    factor_itemsize: int | None = None,
    decomposition_itemsize: int = 4,
    local_threshold: int = 1024,
    fusion: str = "dynamic",
    comm_alpha: float | None = None,
    comm_beta: float | None = None,
    fusion_plan: Sequence[Sequence[tuple[str, str]]] | None = None,
    ready_times: Mapping[tuple[str, str], float] | None = None,
    weight_sharing: str = "expand",
    ddp: bool = False,
    bias: Sequence[bool] | None = None,
    other_params: int | Sequence[int] = 0,
    factor_update_steps: int = 1,
    inv_update_steps: int = 1,
) -> Prediction:
    """Predict one strategy's traffic, phase times and memory (options mirror the preconditioner).

    Args:
        shapes: K-FAC layers in module order; a :class:`ModelShapes` (from
            :func:`shapes_from_model`) also carries biases, capture and the
            other parameters, which exact bucket counts need.
        strategy: "dp-kfac", "d-kfac", "spd-kfac" (or "sgd": gradients only).
        world_size: number of ranks ``P``.
        hardware: device and network model.
        compute_method: "eigen" or "inverse".
        kl_clip: whether the KL clip is on (a float counts as on, None as off).
        grad_reduction / assignment / assignment_cost: dp-kfac options.
        bucket_cap_mb: the preconditioner's bucket cap.
        param_itemsize / factor_itemsize / decomposition_itemsize: bytes per
            element of parameters, factors (default: parameters) and the
            ``decomposition_dtype`` (decompositions run in at least float32
            and never below the factor dtype).
        local_threshold / fusion / comm_alpha / comm_beta: spd-kfac options.
        fusion_plan: spd-kfac's plan (``pre.strategy.plan``) instead of
            replanning from modelled ready times.
        ready_times: measured factor ready times to plan from.
        weight_sharing: "expand" or "reduce" (rows of the factor products).
        ddp: the model is DDP-wrapped (gradients are not counted by K-FAC).
        bias / other_params: see :func:`as_model_shapes` (plain shapes only).
        factor_update_steps / inv_update_steps: intervals for per-step averages.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if compute_method not in ("eigen", "inverse"):
        raise ValueError(f"unknown compute_method {compute_method!r}")
    if grad_reduction not in ("allreduce", "owner"):
        raise ValueError(f"unknown grad_reduction {grad_reduction!r}")
    model = as_model_shapes(shapes, bias=bias, other_params=other_params)
    p, hw = int(world_size), hardware
    fi = factor_itemsize or param_itemsize
    di = max(4, fi, decomposition_itemsize)
    cap = int(bucket_cap_mb * 2**20)
    kfac = strategy != "sgd"
    placement = (
        tr.place(
            model,
            p,
            strategy,
            assignment=assignment,
            assignment_cost=assignment_cost,
            local_threshold=local_threshold,
        )
        if kfac
        else None
    )
    active = p > 1
    owner_reduce = strategy == "dp-kfac" and grad_reduction == "owner" and active
    grads = tr.grad_collectives(
        model,
        p,
        itemsize=param_itemsize,
        cap_bytes=cap,
        owners=placement.owner if owner_reduce else None,
    )
    sgd_grads = tr.grad_collectives(model, p, itemsize=param_itemsize, cap_bytes=cap)
    sgd_grad_comm = (
        sum(hw.link(c.kind).time(1, c.wire_bytes, p) for c in sgd_grads) if active else 0.0
    )
    every = [] if ddp else list(grads)
    if strategy == "dp-kfac":
        every += tr.precond_collectives(
            model,
            p,
            placement.owner,
            itemsize=param_itemsize,
            cap_bytes=cap,
            kl_clip=bool(kl_clip),
        )
    plan = None
    setup: list[tr.Collective] = []
    if strategy == "dp-kfac" and assignment == "lpt":
        setup.append(tr.Collective("setup", "allreduce", 16 * len(model), p))
    if strategy == "spd-kfac":
        link = hw.link("allreduce")
        measured = CommModel(link.latency(p), link.beta * 2 * (p - 1) / p)
        fixed = comm_alpha is not None and comm_beta is not None
        comm = CommModel(comm_alpha, comm_beta) if fixed else measured
        plan = (
            [list(b) for b in fusion_plan]
            if fusion_plan is not None
            else spd_plan(
                model, ready_times or timeline(model, hw, weight_sharing, fi)[0], comm, fi, fusion
            )
        )
        n_keys = len(tr.factor_keys(model))
        setup.append(tr.Collective("setup", "allreduce", 8 * (n_keys + 2), p))
        if not fixed:
            setup += [
                tr.Collective("setup", "allreduce", 4 * n, p)
                for n in (256, 16384, 262144)
                for _ in range(3)
            ]
    factor_colls = tr.factor_collectives(model, p, strategy, itemsize=fi, cap_bytes=cap, plan=plan)
    decomp_colls = (
        tr.decomposition_collectives(
            model, p, placement, compute_method=compute_method, itemsize=di, cap_bytes=cap
        )
        if strategy in ("d-kfac", "spd-kfac")
        else []
    )
    ddp_grad = sgd_grad_comm if ddp else 0.0  # DDP all-reduces, whatever grad_reduction says
    steps = {}
    for factor in (True, False):
        for decomp in (True, False):
            colls = every + (factor_colls if factor else []) + (decomp_colls if decomp else [])
            steps[(factor, decomp)] = step_prediction(
                model,
                p,
                strategy,
                placement,
                hw,
                colls if active else [],
                factor=factor,
                decomp=decomp,
                compute_method=compute_method,
                weight_sharing=weight_sharing,
                factor_itemsize=fi,
                ddp_grad=ddp_grad,
                plan=plan,
            )
    memory = (
        tr.memory_per_rank(
            model,
            p,
            strategy,
            placement,
            compute_method=compute_method,
            factor_itemsize=fi,
            decomposition_itemsize=di,
        )
        if kfac
        else [{"factors": 0, "decompositions": 0, "buffers": 0}] * p
    )
    return Prediction(
        strategy,
        p,
        hw.name,
        steps,
        memory,
        setup if active else [],
        placement,
        plan,
        sgd_grad_comm,
        factor_update_steps,
        inv_update_steps,
        {
            "compute_method": compute_method,
            "kl_clip": bool(kl_clip),
            "grad_reduction": grad_reduction,
            "weight_sharing": weight_sharing,
            "ddp": ddp,
        },
    )


def predict_sgd(shapes: Sequence[LayerShape], **kwargs: Any) -> Prediction:
    """Plain data parallelism: forward/backward and the gradient all-reduce only."""
    return predict(shapes, strategy="sgd", **kwargs)
