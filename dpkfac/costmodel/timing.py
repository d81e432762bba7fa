"""The timing half of the cost model: work per phase and rank, and the critical path.

Work (``kind -> (calls, amount)``, see :mod:`dpkfac.costmodel.hardware`) per phase:

* ``factor_compute``: per factor, ``2·rows·d²`` flops of kind "factor"
  (``aᵀa`` and ``gᵀg``; rows = ``N·T`` for "expand", ``N`` for "reduce")
  plus ``3·rows·d·itemsize`` bytes of kind "memory" (im2col or reshape
  copy, scaling copy, the product's read), which dominates for tall, narrow
  convolution patch matrices on CPUs; "reduce" reads ``N·T·d`` once and
  works on ``N`` rows;
* ``decomposition``: per factor, ``9·d³`` flops of kind "eigh" (Golub & Van
  Loan, symmetric QR with vectors; :data:`dpkfac.assignment.EIGH_COEFF` in
  flops) or ``2·d³`` of kind "inverse" (Cholesky and its inverse);
* ``precondition``: per layer, ``4·g·a·(g+a)`` flops for eigen (four
  matmuls), ``2·g·a·(g+a)`` for inverse;
* ``forward_backward``: ``6·N·T·a·g`` flops per K-FAC layer (forward 2,
  backward 4); the rest of the network (normalisation, attention scores) is
  not modelled;
* communication phases: one call and its wire bytes per collective, plus
  "unpack" bytes for rebuilding full factors from triangle-packed buffers
  (spd_kfac), which happens when the collective is waited on.

Which rank does which work, and where the step synchronises, come from the
strategy's :class:`~dpkfac.strategies.Traits` and placement, never from its
name. The iteration is a critical path through the step's synchronisation
points (a collective completes when the slowest rank has joined it): the
busiest rank's forward/backward with factor construction, the gradient
collectives, the factor collectives, then decomposition (and its broadcast,
where decompositions are broadcast: a synchronisation point between
decomposing and preconditioning), preconditioning and the broadcast of
preconditioned gradients. Pipelined factor all-reduces overlap the forward
and backward passes: only what the fusion schedule leaves after the backward
pass is counted (the serial time stays in ``comm_serial``), to the extent the
hardware overlaps them (``Hardware.overlap``; the rest is serial).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dpkfac.assignment import EIGH_COEFF, INVERSE_COEFF, LayerShape, Placement
from dpkfac.costmodel import traffic as tr
from dpkfac.costmodel.hardware import Hardware, Work, add_work
from dpkfac.costmodel.shapes import ModelShapes
from dpkfac.fusion import CommModel, plan_buckets
from dpkfac.stats import PHASE_OF_CATEGORY
from dpkfac.strategies import Traits

__all__ = [
    "COMM_PHASES",
    "COMPUTE_PHASES",
    "StepPrediction",
    "factor_work",
    "forward_backward_work",
    "pipelined_plan",
    "step_prediction",
    "timeline",
]

COMPUTE_PHASES = ("factor_compute", "decomposition", "precondition")
COMM_PHASES = ("grad_comm", "factor_comm", "decomposition_comm", "precond_comm")
Key = tuple[str, str]


@dataclass
class StepPrediction:
    """One step: its collectives, per-rank work and seconds, and the critical path.

    Attributes:
        rank_collectives: per rank, every buffer it hands to torch.distributed
            (the same on every rank unless a strategy broadcasts within groups).
        work: per rank, phase -> work.
        phases_per_rank: per rank, phase -> seconds (the ``timings()`` keys).
        breakdown: critical-path seconds per phase plus ``forward_backward``
            (and ``ddp_grad_comm``); they sum to ``iteration``.
        comm_serial: phase -> seconds of its collectives run back to back.
    """

    rank_collectives: list[list[tr.Collective]]
    work: list[dict[str, Work]]
    phases_per_rank: list[dict[str, float]]
    breakdown: dict[str, float]
    comm_serial: dict[str, float]

    @property
    def collectives(self) -> list[tr.Collective]:
        """Rank 0's collectives (every rank's, unless ranks differ in groups)."""
        return self.rank_collectives[0] if self.rank_collectives else []

    @property
    def comm(self) -> dict[str, dict[str, int]]:
        """``comm_stats()`` of this step on rank 0 (see :meth:`comm_of` for the others)."""
        return self.comm_of(0)

    def comm_of(self, rank: int) -> dict[str, dict[str, int]]:
        """``comm_stats()`` of this step on ``rank``."""
        return tr.comm_counts(self.rank_collectives[rank] if self.rank_collectives else [])

    @property
    def phases(self) -> dict[str, float]:
        """Seconds per phase on the busiest rank for that phase."""
        return {p: max(r[p] for r in self.phases_per_rank) for p in self.phases_per_rank[0]}

    @property
    def iteration(self) -> float:
        """Seconds of the step along its critical path."""
        return sum(self.breakdown.values())

    @property
    def computation(self) -> float:
        """K-FAC compute seconds of the busiest rank."""
        return max(sum(r[p] for p in COMPUTE_PHASES) for r in self.phases_per_rank)


def factor_work(s: LayerShape, which: str, weight_sharing: str, itemsize: int) -> Work:
    """Work of building one batch factor ("A" or "G") of layer ``s``."""
    d = s.a_dim if which == "A" else s.g_dim
    if weight_sharing == "expand":
        rows = s.batch_size * s.positions
        nbytes = 3 * rows * d * itemsize
    else:
        rows = s.batch_size
        nbytes = (s.batch_size * s.positions + 2 * rows) * d * itemsize
    return {"factor": (1, 2.0 * rows * d * d), "memory": (0, float(nbytes))}


def _fb_flops(s: LayerShape) -> float:
    return 6.0 * s.batch_size * s.positions * s.a_dim * s.g_dim


def forward_backward_work(model: ModelShapes) -> Work:
    """Forward and backward work of all K-FAC layers (one call per layer)."""
    return {"forward_backward": (float(len(model)), sum(_fb_flops(s) for s in model))}


def timeline(
    model: ModelShapes, hw: Hardware, weight_sharing: str, itemsize: int
) -> tuple[dict[Key, float], float]:
    """Ready time of each factor (A in forward order, G in backward order) and the backward's end.

    A layer's forward is a third of its forward/backward work, its backward
    two thirds; A is built right after the layer's forward, G right after
    its backward, as the capture hooks do.
    """
    t, ready = 0.0, {}
    for s, c in zip(model, model.captured, strict=True):
        t += hw.time({"forward_backward": (1 / 3, _fb_flops(s) / 3)}, 1)
        if c:
            t += hw.time(factor_work(s, "A", weight_sharing, itemsize), 1)
            ready[(s.name, "A")] = t
    for s, c in zip(reversed(model), reversed(model.captured), strict=True):
        t += hw.time({"forward_backward": (2 / 3, 2 * _fb_flops(s) / 3)}, 1)
        if c:
            t += hw.time(factor_work(s, "G", weight_sharing, itemsize), 1)
            ready[(s.name, "G")] = t
    return ready, t


def pipelined_plan(
    model: ModelShapes,
    ready: Mapping[Key, float],
    comm: CommModel,
    itemsize: int,
    fusion: str,
    triangle: bool = True,
) -> list[list[Key]]:
    """The fusion plan of pipelined factor traffic, built as ``SPDKFAC._build_plan`` builds it.

    Factors are ordered by ready time; "dynamic" fusion merges consecutive
    ones by :func:`dpkfac.fusion.plan_buckets`, anything else sends each alone.
    """
    keys = tr.factor_keys(model)
    order = sorted(range(len(keys)), key=lambda i: (ready[keys[i]], i))
    dims = [tr.factor_dim(model, keys[i]) for i in order]
    sizes = [(tr.triangle_numel(d) if triangle else d * d) * itemsize for d in dims]
    times = [ready[keys[i]] for i in order]
    if fusion == "dynamic":
        buckets = plan_buckets(times, sizes, comm)
    else:
        buckets = [[i] for i in range(len(order))]
    return [[keys[order[i]] for i in b] for b in buckets]


def _rank_work(
    model: ModelShapes,
    rank: int,
    traits: Traits | None,
    placement: Placement | None,
    roles: tr.Roles | None,
    *,
    factor: bool,
    decomp: bool,
    compute_method: str,
    weight_sharing: str,
    itemsize: int,
) -> dict[str, Work]:
    dec_kind, dec_flops = (
        ("eigh", 2 * EIGH_COEFF) if compute_method == "eigen" else ("inverse", 2 * INVERSE_COEFF)
    )
    pre_coeff = 4.0 if compute_method == "eigen" else 2.0
    w: dict[str, Work] = {}
    for i, s in enumerate(model):
        if traits is None or placement is None or roles is None or not model.captured[i]:
            continue
        owned = placement.owner[i] == rank
        if factor and (traits.captures_all or owned):
            for which in "AG":
                for kind, (c, a) in factor_work(s, which, weight_sharing, itemsize).items():
                    add_work(w.setdefault("factor_compute", {}), kind, c, a)
        if decomp:
            for d, o in ((s.a_dim, placement.a_owner[i]), (s.g_dim, placement.g_owner[i])):
                if o is None or o == rank:
                    add_work(w.setdefault("decomposition", {}), dec_kind, 1, dec_flops * d**3)
        if rank in roles.preconditioners[i]:
            flops = pre_coeff * s.g_dim * s.a_dim * (s.g_dim + s.a_dim)
            add_work(w.setdefault("precondition", {}), "precondition", 1, flops)
    return w


def step_prediction(
    model: ModelShapes,
    p: int,
    traits: Traits | None,
    placement: Placement | None,
    roles: tr.Roles | None,
    hw: Hardware,
    rank_colls: list[list[tr.Collective]],
    *,
    factor: bool,
    decomp: bool,
    compute_method: str,
    weight_sharing: str,
    factor_itemsize: int,
    ddp_grad: float,
    plan: list[list[Key]] | None,
) -> StepPrediction:
    """Work, seconds and critical path of one step where each rank sends ``rank_colls[r]``.

    ``traits`` None is plain data parallelism (no K-FAC work).
    """
    rank_comm_work: list[dict[str, Work]] = []
    for colls in rank_colls or [[] for _ in range(p)]:
        comm_work: dict[str, Work] = {}
        for c in colls:
            phase = comm_work.setdefault(PHASE_OF_CATEGORY[c.category], {})
            add_work(phase, c.kind, 1, c.wire_bytes)
            if c.unpack_bytes:
                add_work(phase, "unpack", 0, c.unpack_bytes)
        rank_comm_work.append(comm_work)
    comm_work = rank_comm_work[0]
    colls = rank_colls[0] if rank_colls else []
    work, seconds = [], []
    for r in range(p):
        w = {k: dict(v) for k, v in rank_comm_work[r].items()}
        w.update(
            _rank_work(
                model,
                r,
                traits,
                placement,
                roles,
                factor=factor,
                decomp=decomp,
                compute_method=compute_method,
                weight_sharing=weight_sharing,
                itemsize=factor_itemsize,
            )
        )
        work.append(w)
        seconds.append({ph: hw.time(w.get(ph, {}), p) for ph in (*COMPUTE_PHASES, *COMM_PHASES)})
    serial = {ph: seconds[0][ph] for ph in COMM_PHASES}
    pipelined = traits is not None and traits.factor_comm == "pipelined"
    if pipelined and "factor_comm" in comm_work and plan:
        ready, backward_end = timeline(model, hw, weight_sharing, factor_itemsize)
        link, finish = hw.link("allreduce"), -math.inf
        factor_colls = [c for c in colls if c.category == "factor_allreduce"]
        for c, bucket in zip(factor_colls, plan, strict=True):
            start = max(finish, max(ready[k] for k in bucket))
            finish = start + link.time(1, c.wire_bytes, p)
        hidden = hw.overlap * max(0.0, finish - backward_end)
        # Unpacking happens in step(), after the backward pass: never hidden.
        unpack = hw.time({"unpack": comm_work["factor_comm"].get("unpack", (0.0, 0.0))}, p)
        for t in seconds:
            t["factor_comm"] = hidden + (1.0 - hw.overlap) * (t["factor_comm"] - unpack) + unpack

    def critical(phases: Sequence[str]) -> dict[str, float]:
        r = max(range(p), key=lambda r: sum(seconds[r][ph] for ph in phases))
        return {ph: seconds[r][ph] for ph in phases}

    breakdown = {"forward_backward": hw.time(forward_backward_work(model), p)}
    breakdown.update(critical(["factor_compute"]))
    if ddp_grad:
        breakdown["ddp_grad_comm"] = ddp_grad
    breakdown.update({ph: seconds[0][ph] for ph in ("grad_comm", "factor_comm")})
    if traits is not None and traits.decomposition_broadcast:
        # The broadcast waits for the slowest decomposer, and preconditioning for it.
        breakdown.update(critical(["decomposition"]))
        breakdown["decomposition_comm"] = seconds[0]["decomposition_comm"]
        breakdown.update(critical(["precondition"]))
    else:
        breakdown.update(critical(["decomposition", "precondition"]))
    breakdown["precond_comm"] = seconds[0]["precond_comm"]
    return StepPrediction(rank_colls, work, seconds, breakdown, serial)
