"""Predicted bytes, phase seconds, memory and iteration time of one strategy; "auto" resolved.

:func:`predict` takes the preconditioner's own option dataclasses
(:class:`~dpkfac.options.KFACOptions` and the strategy's
:class:`~dpkfac.options.StrategyOptions`), so a run and its prediction are
described by the same values and validated by the same code. The strategy
is priced through its :class:`~dpkfac.plan.Plan`, the object the runtime
executes: its traits, placement, roles and one-time collectives; nothing here
branches on a strategy's name. Bytes, calls, wire bytes and memory come from
:mod:`dpkfac.costmodel.traffic` and are exact; seconds come from
:mod:`dpkfac.costmodel.timing` (work per phase and rank, priced by a
:class:`~dpkfac.plan.hardware.Hardware`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dpkfac.costmodel import traffic as tr
from dpkfac.costmodel.auto import Candidate, average_interval
from dpkfac.costmodel.optimizers import step_bytes
from dpkfac.costmodel.shapes import as_model_shapes
from dpkfac.costmodel.timing import (
    COMM_PHASES,
    COMPUTE_PHASES,
    Key,
    StepPrediction,
    pipelined_plan,
    step_prediction,
    timeline,
)
from dpkfac.options import KFACOptions, Schedule, StrategyOptions
from dpkfac.plan import Plan, Scheme, Traits, scheme_of, scheme_options
from dpkfac.plan.assignment import LayerShape
from dpkfac.plan.fusion import CommModel
from dpkfac.plan.hardware import Hardware, Sample
from dpkfac.plan.presets import PRESETS, hardware_option

__all__ = ["Prediction", "predict", "predict_sgd"]


@dataclass
class Prediction:
    """Everything predicted for one strategy, model and world size.

    Attributes:
        strategy: the strategy's registered name, or None for plain data parallelism.
        world_size: number of ranks.
        hardware: name of the hardware model.
        steps: (factor update?, decomposition?) -> :class:`StepPrediction`.
        memory: ``memory_usage()`` of every rank.
        setup: one-time collectives (placement agreement, fusion planning).
        plan: the run's plan: placement, roles and groups (None without K-FAC).
        fusion_buckets: the fusion buckets of (layer, "A"/"G") keys of pipelined factor traffic.
        sgd_grad_comm: seconds of plain data parallelism's gradient all-reduce.
        kfac: the preconditioner's common options the prediction assumed.
        options: the strategy's options (None without K-FAC).
        traits: what the strategy does (None without K-FAC).
        ddp: the model is DDP-wrapped (DDP averages the gradients).
    """

    strategy: str | None
    world_size: int
    hardware: str
    steps: dict[tuple[bool, bool], StepPrediction]
    memory: list[dict[str, int]]
    setup: list[tr.Collective]
    plan: Plan | None
    fusion_buckets: list[list[Key]] | None
    sgd_grad_comm: float
    kfac: KFACOptions
    options: StrategyOptions | None = None
    traits: Traits | None = None
    ddp: bool = False

    @property
    def overlapped_phases(self) -> tuple[str, ...]:
        """Communication phases whose collectives run concurrently with the forward/backward.

        Their measured wait is not a transfer time (see :meth:`samples`).
        """
        phases: tuple[str, ...] = ()
        if self.strategy is None and self.world_size > 1:
            phases += ("grad_comm",)  # DDP's buckets, during the backward pass
        if self.traits is not None and self.traits.factor_comm == "pipelined":
            phases += ("factor_comm",)
        if self.traits is not None and self.traits.overlapped_precondition:
            phases += ("grad_comm", "precond_comm")
        return phases

    @property
    def update(self) -> StepPrediction:
        """A step that updates factors and decompositions (the papers' timing setting)."""
        return self.steps[(True, True)]

    @property
    def plain(self) -> StepPrediction:
        """A step with neither factor nor decomposition update."""
        return self.steps[(False, False)]

    @property
    def setup_comm(self) -> dict[str, dict[str, int]]:
        """The one-time "setup" collectives (first step, and the end of spd_kfac's profiling)."""
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
        return serial if self.ddp else serial - self.sgd_grad_comm

    @property
    def iteration(self) -> float:
        """Seconds of an update step along its critical path."""
        return self.update.iteration

    def _average(self, value: Callable[[StepPrediction], float]) -> float:
        f = _interval("factor_update_steps", self.kfac.factor_update_steps)
        i = _interval("inv_update_steps", self.kfac.inv_update_steps)
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

    def comm_per_step(self, key: str = "bytes") -> float:
        """Bytes handed to collectives (``key="wire_bytes"``: sent on the wire) per step and
        rank, mean over ranks, averaged like :attr:`iteration_avg`."""

        def mean(step: StepPrediction) -> float:
            ranks = range(self.world_size)
            return sum(c[key] for r in ranks for c in step.comm_of(r).values()) / self.world_size

        return self._average(mean)

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
        waits only for the transfer. Communication that overlaps the
        forward/backward (:attr:`overlapped_phases`) is left out.
        """
        out = []
        for phase in (*COMPUTE_PHASES, *COMM_PHASES):
            ranks = range(self.world_size) if phase in COMPUTE_PHASES else [0]
            for r in ranks:
                work = self.update.work[r].get(phase)
                if not work or phase in self.overlapped_phases:
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


def _interval(name: str, value: Schedule) -> int:
    """An update interval as an int; schedules cannot be averaged without their steps."""
    if callable(value):
        raise ValueError(
            f"predict averages over fixed update intervals; {name} is a callable schedule "
            "(pass the int interval of the steps to predict)"
        )
    return int(value)


def _fusion_comm(options: StrategyOptions, hw: Hardware, p: int) -> tuple[str, CommModel]:
    """Fusion rule and alpha-beta model a pipelined strategy plans its buckets with.

    Read from the options' ``fusion`` and fixed ``comm_alpha``/``comm_beta``
    when it has them; otherwise dynamic fusion on the model the strategy would
    measure (the hardware's all-reduce link at ``p`` ranks).
    """
    link = hw.link("allreduce")
    measured = CommModel(link.latency(p), link.beta * 2 * (p - 1) / p)
    alpha = getattr(options, "comm_alpha", None)
    beta = getattr(options, "comm_beta", None)
    comm = CommModel(alpha, beta) if alpha is not None and beta is not None else measured
    return str(getattr(options, "fusion", "dynamic")), comm


def _per_group(
    world_size: int,
    group_of: Callable[[int], Hashable],
    price: Callable[[int], list[tr.Collective]],
) -> list[list[tr.Collective]]:
    """Each rank's collectives, priced once per group (the ranks of a group send the same)."""
    priced: dict[Hashable, list[tr.Collective]] = {}
    for r in range(world_size):
        if group_of(r) not in priced:
            priced[group_of(r)] = price(r)
    return [priced[group_of(r)] for r in range(world_size)]


def predict(
    shapes: Sequence[LayerShape],
    *,
    strategy: str | None,
    world_size: int,
    hardware: Hardware,
    kfac: KFACOptions | None = None,
    options: StrategyOptions | Mapping[str, Any] | None = None,
    param_itemsize: int = 4,
    fusion_plan: Sequence[Sequence[Key]] | None = None,
    ready_times: Mapping[Key, float] | None = None,
    ddp: bool = False,
    bias: Sequence[bool] | None = None,
    other_params: int | Sequence[int] = 0,
    optimizer: str = "sgd_momentum",
) -> Prediction:
    """Predict one strategy's traffic, phase times and memory from the preconditioner's options.

    Args:
        shapes: K-FAC layers in module order; a :class:`ModelShapes` (from
            :func:`shapes_from_model`) also carries biases, capture and the
            other parameters, which exact bucket counts need.
        strategy: a registered strategy name (any accepted spelling), or
            None for plain data parallelism: DDP, whose bucketed gradient
            all-reduces (:func:`~dpkfac.costmodel.traffic.ddp_collectives`,
            accounted as ``grad_allreduce``) overlap the backward pass
            (:func:`~dpkfac.costmodel.timing.ddp_comm`).
        kfac: the preconditioner's common options (default: its defaults).
            Used: compute_method, kl_clip (on unless None), weight_sharing,
            bucket_cap_mb, factor_dtype (default: the parameters' itemsize),
            decomposition_dtype (decompositions run in at least float32 and
            never below the factor dtype) and the int update intervals of the
            per-step averages. Without K-FAC only the bucket cap matters.
        options: the strategy's options, as its ``Options`` dataclass or as
            keyword arguments (validated as the preconditioner validates them).
        fusion_plan: the fusion plan of a pipelined strategy as the run fixed
            it (``pre.strategy.fusion_plan``), instead of replanning from modelled
            ready times.
        ready_times: measured factor ready times to plan from.
        ddp: the model is DDP-wrapped (gradients are not counted by K-FAC;
            the exposed wait on DDP's buckets is the breakdown's ``ddp_grad_comm``).
        bias / other_params: see :func:`as_model_shapes` (plain shapes only).
        optimizer: the first-order optimizer whose step ends each iteration
            (a key of :data:`dpkfac.costmodel.optimizers.OPTIMIZER_STATE`;
            ``"none"``: no step is priced).

    Raises:
        ValueError: an unknown strategy or option, a bad option value, a
            callable update interval, or strategy options without a strategy.
        TypeError: options of another strategy's class.
    """
    kfac = KFACOptions() if kfac is None else kfac
    f_every = _interval("factor_update_steps", kfac.factor_update_steps)
    i_every = _interval("inv_update_steps", kfac.inv_update_steps)
    model = as_model_shapes(shapes, bias=bias, other_params=other_params)
    p, hw = int(world_size), hardware
    name = roles = opts = None
    if strategy is None:
        if options:
            raise ValueError(f"strategy options {options!r} given without a strategy")
    else:
        scheme = scheme_of(strategy)
        name = scheme.name
        given = scheme_options(name, options)
        # Placed by the step's batch, k micro-batches of the shapes' batch, as at run time.
        # Each layer with the overlapped mode's bucket that completes it, which dp_kfac's
        # placement balances (as the run's first step does).
        step_shapes = tr.with_buckets(
            [replace(s, batch_size=s.batch_size * kfac.accumulation_steps) for s in model],
            model,
            itemsize=param_itemsize,
            cap_bytes=kfac.bucket_cap_bytes,
            ddp=ddp,
        )
        # What the run would fill in at start-up (a measured hardware model, "auto").
        opts, _ = choose_options(
            scheme, given, shapes=model, world_size=p, kfac=kfac, hardware=hw, ddp=ddp
        )
        roles = scheme.plan(
            step_shapes, p, opts, given=given, num_factors=len(tr.factor_keys(model))
        )
    traits = None if roles is None else roles.traits
    optimizer_bytes = step_bytes(model.num_params, param_itemsize, optimizer)
    fi = kfac.factor_dtype.itemsize if kfac.factor_dtype is not None else param_itemsize
    di = max(4, fi, kfac.decomposition_dtype.itemsize)
    cap = kfac.bucket_cap_bytes
    method, sharing = kfac.compute_method, kfac.weight_sharing
    active = p > 1
    sgd_grads = tr.grad_collectives(model, p, itemsize=param_itemsize, cap_bytes=cap)
    # DDP's buckets: plain data parallelism's averaging, or a DDP-wrapped K-FAC run's.
    ddp_buckets = (
        tr.ddp_bucket_params(model, itemsize=param_itemsize, cap_bytes=cap)
        if (ddp or strategy is None) and active
        else None
    )
    sgd_grad_comm = (
        sum(hw.link(c.kind).time(1, c.wire_bytes, p) for c in sgd_grads) if active else 0.0
    )
    plan = None
    overlap: list[tr.OverlapBucket] | None = None
    # Every step's gradient traffic that the run accounts: DDP's buckets for SGD, none
    # for a DDP-wrapped K-FAC run (DDP's are not the preconditioner's), else its own.
    every: list[tr.Collective] = []
    if strategy is None:
        every = tr.ddp_collectives(ddp_buckets or [], p, itemsize=param_itemsize)
    elif not ddp:
        every = list(sgd_grads)
    setup: list[tr.Collective] = []
    no_colls: list[list[tr.Collective]] = [[] for _ in range(p)]
    updates, factor_colls, decomp_colls = no_colls, no_colls, no_colls
    kinds = ("factors_bytes", "decompositions_bytes", "buffers_bytes")
    memory = [dict.fromkeys(kinds, 0) for _ in range(p)]
    if roles is not None and traits is not None and opts is not None:
        kl_clip = kfac.kl_clip is not None
        if traits.overlapped_precondition and active:
            # Under DDP the mode is DDP's communication hook: DDP's buckets, accounted.
            overlap = tr.overlap_buckets(
                model,
                roles,
                itemsize=param_itemsize,
                cap_bytes=cap,
                kl_clip=kl_clip,
                ddp=ddp,
            )
            every, shared = tr.overlap_collectives(overlap)
            updates = [shared] * p
            ddp_buckets = None
        else:
            if traits.owner_grad_reduction and active and not ddp:
                every = tr.grad_collectives(
                    model, p, itemsize=param_itemsize, cap_bytes=cap, plan=roles
                )
            updates = _per_group(
                p,
                roles.update_group,
                lambda r: tr.precond_collectives(
                    model,
                    roles,
                    r,
                    itemsize=param_itemsize,
                    cap_bytes=cap,
                    kl_clip=kl_clip,
                ),
            )
        setup = [tr.Collective("setup", kind, nbytes, p) for kind, nbytes in roles.setup]
        if traits.factor_comm == "pipelined":
            fusion, comm = _fusion_comm(opts, hw, p)
            if fusion_plan is not None:
                plan = [[(k[0], k[1]) for k in bucket] for bucket in fusion_plan]
            else:
                ready = ready_times or timeline(model, hw, sharing, fi)[0]
                plan = pipelined_plan(model, ready, comm, fi, fusion, traits.triangle)
        factor_colls = _per_group(
            p,
            roles.factor_group,
            lambda r: tr.factor_collectives(
                model,
                len(roles.factor_group(r)),
                roles.traits,
                itemsize=fi,
                cap_bytes=cap,
                plan=plan,
                include=[roles.captures(r, i) for i in range(len(model))],
            ),
        )
        decomp_colls = _per_group(
            p,
            roles.decomposition_group,
            lambda r: tr.decomposition_collectives(
                model, roles, r, compute_method=method, itemsize=di, cap_bytes=cap
            ),
        )
        memory = tr.memory_per_rank(
            model,
            roles,
            compute_method=method,
            factor_itemsize=fi,
            decomposition_itemsize=di,
        )
    # Lazy synchronisation sends the running factors before each decomposition
    # instead of the batch factors of each factor update.
    lazy = traits is not None and traits.lazy_factor_sync
    steps = {}
    for factor, decomp in itertools.product((True, False), repeat=2):
        # Lazy: on decomposition steps whose factors changed since the last sync
        # (exact when factors are updated at least as often as decomposed).
        sync = decomp and (factor or f_every <= i_every) if lazy else factor
        rank_colls = [
            every
            + updates[r]
            + (factor_colls[r] if sync else [])
            + (decomp_colls[r] if decomp else [])
            for r in range(p)
        ]
        steps[(factor, decomp)] = step_prediction(
            model,
            p,
            roles,
            hw,
            rank_colls if active else [],
            factor=factor,
            decomp=decomp,
            compute_method=method,
            weight_sharing=sharing,
            factor_itemsize=fi,
            fusion_plan=plan,
            ddp=ddp_buckets,
            param_itemsize=param_itemsize,
            overlap=overlap,
            ddp_hook=ddp,
            optimizer_bytes=optimizer_bytes,
            kl_clip=kfac.kl_clip is not None,
        )
    return Prediction(
        strategy=name,
        world_size=p,
        hardware=hw.name,
        steps=steps,
        memory=memory,
        setup=setup if active else [],
        plan=roles,
        fusion_buckets=plan,
        sgd_grad_comm=sgd_grad_comm,
        kfac=replace(kfac, factor_update_steps=f_every, inv_update_steps=i_every),
        options=opts,
        traits=traits,
        ddp=ddp,
    )


def predict_sgd(shapes: Sequence[LayerShape], **kwargs: Any) -> Prediction:
    """Plain data parallelism as DDP runs it: forward/backward and the bucketed gradient
    all-reduces overlapped with the backward pass."""
    return predict(shapes, strategy=None, **kwargs)


def choose_options(
    scheme: type[Scheme],
    options: StrategyOptions,
    *,
    shapes: Sequence[LayerShape],
    world_size: int,
    kfac: KFACOptions | None = None,
    hardware: Hardware | None = None,
    allow: Callable[[StrategyOptions], bool] | None = None,
    ddp: bool = False,
) -> tuple[StrategyOptions, list[Candidate]]:
    """The options a run ends up with, and every candidate priced on the way.

    Args:
        shapes: the layers with the step's batch (all its micro-batches); a
            :class:`ModelShapes` also carries the model's other parameters and their
            order, whose gradients travel beside the layers' (BERT's word embedding,
            which the overlapped mode hides and the others wait for). Priced from the
            K-FAC layers alone, a run's "auto" chose the owner mode without overlap in
            3 of 12 BERT-base jobs on the emulated network, which measured up to 29%
            slower than with it.
        kfac: the preconditioner's common options (the update schedule).
        hardware: the hardware a prediction assumes: where the run would
            measure its model at start-up, this stands for the measurement.
            None at run time (the options hold what was measured).
        allow: which candidates the run can take (None: all); the preconditioner
            leaves out the overlapped ones where it cannot overlap (a DDP model,
            a loss scaler).
        ddp: the model is DDP-wrapped (:func:`predict`'s).

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
            ddp=ddp,
        )
        bytes_, wire = pred.comm_per_step("bytes"), pred.comm_per_step("wire_bytes")
        candidates.append(Candidate(opts, label, pred.iteration_avg, bytes_, wire))
    fastest = min(c.iteration for c in candidates)
    near = [c for c in candidates if c.iteration <= fastest * (1 + tuning.tolerance)]
    best = min(near, key=lambda c: (c.comm_bytes, c.wire_bytes, scheme.preference(c.options)))
    return best.options, candidates
