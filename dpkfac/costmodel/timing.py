"""The timing half of the cost model: work per phase and rank, and the critical path.

Work (``kind -> (calls, amount)``, see :mod:`dpkfac.plan.hardware`) per phase:

* ``factor_compute``: per factor, the kernels ``factor_method="auto"`` uses
  (:mod:`dpkfac.curvature.factors`): a Conv2d "expand" A factor by shifted
  correlations, ``2·C²·N·(H+k−1)²`` flops of kind "factor" per shift
  (``2k²−2k+1`` shifts) plus the border corrections, and
  ``3·C·N·(H+k−1)²·itemsize`` "memory" bytes (one flat copy, no im2col);
  LayerShape keeps neither kernel nor stride, so k and C are guessed from
  ``a_dim`` (:func:`~dpkfac.curvature.factors.guess_square_kernel`) and the
  input map is taken as the output map (stride 1). Every other product is
  the triangle-only ``XᵀX`` (about ``rows·d²`` flops for ``d ≥ 128``,
  ``2·rows·d²`` below; rows = ``N·T`` for "expand", ``N`` for "reduce")
  with ``2·rows·d·itemsize`` bytes (im2col or reshape copy and the
  product's read; a Conv2d G and reduce-mode reads are one pass). Each
  factor counts as one call: the shifted path's dozen small GEMMs are not
  priced per launch (that would make the fitted latency and overlap less
  identifiable);
* ``decomposition``: per factor, ``9·d³`` flops of kind "eigh" (Golub & Van
  Loan, symmetric QR with vectors; :data:`dpkfac.plan.assignment.EIGH_COEFF` in
  flops) or ``2·d³`` of kind "inverse" (Cholesky and its inverse);
* ``precondition``: per layer, ``4·g·a·(g+a)`` flops for eigen (four
  matmuls), ``2·g·a·(g+a)`` for inverse;
* ``forward_backward``: ``6·N·T·a·g`` flops per K-FAC layer (forward 2,
  backward 4); the rest of the network (normalisation, attention scores) is
  not modelled;
* ``optimizer``: the first-order optimizer's step, one memory-bound pass of
  :func:`dpkfac.costmodel.optimizers.step_bytes` bytes;
* ``step_other``: the K-FAC step's work outside its timed phases
  (:func:`step_other_work`): "pack" copies gathering every buffer handed to a
  collective and writing each layer's update back into ``.grad`` (scaled by the
  KL clip first), one "host" call per layer written back (its Python and
  small kernels; free unless the hardware has a measured "host" engine), and one
  "launch" call per collective the step launches (the Python around it: planning its
  buffer, launching it, landing it; free unless measured); on a
  factor step also the fold of every batch factor the rank built into its running
  average (:func:`fold_work`: a "fold" call of its non-finite check and average per
  factor; the overlapped mode runs it in the hook that launches the last bucket, inside the
  backward pass, so it is booked with the hooks' work (``hooks``), and it hides transfers
  there as preconditioning does);
* communication phases: one call and its wire bytes per collective, plus
  the "unpack" bytes that land it when it is waited on
  (:func:`~dpkfac.plan.hardware.landing_bytes`: averaging and copying back,
  or rebuilding full factors from triangle-packed buffers for spd_kfac).

Which rank does which work, and where the step synchronises, come from the
strategy's :class:`~dpkfac.plan.Traits` and placement, never from its
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
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from dpkfac.costmodel import traffic as tr
from dpkfac.costmodel.link import busy_periods, paced_end, share
from dpkfac.costmodel.shapes import ModelShapes
from dpkfac.options import KFACOptions
from dpkfac.plan.assignment import EIGH_COEFF, INVERSE_COEFF, CostFn, LayerShape
from dpkfac.plan.exchange import update_nbytes
from dpkfac.plan.fusion import CommModel, plan_buckets
from dpkfac.plan.hardware import Hardware, Work, add_work, drains_early, wire_bytes
from dpkfac.plan.roles import Plan
from dpkfac.stats import PHASE_OF_CATEGORY

__all__ = [
    "COMM_PHASES",
    "COMPUTE_PHASES",
    "StepPrediction",
    "compute_or_send_bound",
    "early_update_seconds",
    "factor_work",
    "fold_work",
    "forward_backward_work",
    "owner_seconds",
    "pipelined_plan",
    "precondition_seconds",
    "seconds_cost",
    "step_other_bytes",
    "step_other_work",
    "step_prediction",
    "timeline",
]

COMPUTE_PHASES = ("factor_compute", "decomposition", "precondition")
COMM_PHASES = ("grad_comm", "factor_comm", "decomposition_comm", "precond_comm")

# The overlapped mode's schedule is found by iterating it to its fixed point
# (:func:`_overlap_backward`); each pass at least halves the change, so 50 passes take a
# change of seconds below a picosecond.
_SCHEDULE_PASSES = 50

# One pass of it: exchange starts per bucket, the gradient group's transfers (launch,
# seconds), each rank's clock after its drain and its drain's seconds lost to the transfers.
_Schedule = tuple[dict[int, float], list[tuple[float, float]], list[float], list[float]]
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
    """Work of building one batch factor ("A" or "G") of layer ``s`` (see the module docstring)."""
    from dpkfac.curvature.factors import guess_square_kernel, shift_count, triangle_work

    d = s.a_dim if which == "A" else s.g_dim
    n, t = s.batch_size, s.positions
    if which == "A" and s.kind == "conv2d" and weight_sharing == "expand":
        k, c = guess_square_kernel(d)
        side = math.sqrt(t) + k - 1
        flat = n * side * side
        shifts = shift_count(k, k)
        border = n * 4 * (k - 1) * side * (2 * k - 1)  # positions in the corrections
        flops = 2.0 * c * c * (shifts * flat + border)
        return {"factor": (1, flops), "memory": (0, 3.0 * c * flat * itemsize)}
    if weight_sharing == "expand":
        rows = n * t
        nbytes = (1 if s.kind == "conv2d" else 2) * rows * d * itemsize
    else:
        rows = n
        nbytes = (n * t + rows) * d * itemsize
    _, flops = triangle_work(rows, d)
    return {"factor": (1, flops), "memory": (0, float(nbytes))}


#: Bytes per element of one factor's fold: the non-finite check reads the batch factor and
#: writes and reads a boolean per element; the running average ``decay·F + (1-decay)·F_b``
#: writes ``decay·F`` (read F, write) and adds the batch factor into it (read both, write).
FOLD_BYTES_PER_ITEM = 6
FOLD_BYTES_PER_ELEMENT = 2


def fold_work(model: ModelShapes, layers: Sequence[int], itemsize: int) -> Work:
    """Work of folding the batch factors of ``layers`` (indices into ``model``) into their
    running averages, as a factor step does: per factor one "fold" call of
    ``d²·(6·itemsize + 2)`` bytes (:data:`FOLD_BYTES_PER_ITEM`), its non-finite check and
    its running-average update (:meth:`dpkfac.curvature.KFACLayer.update_factors`)."""
    dims = [d for i in layers for d in (model[i].a_dim, model[i].g_dim)]
    per_element = FOLD_BYTES_PER_ITEM * itemsize + FOLD_BYTES_PER_ELEMENT
    if not dims:
        return {}
    return {"fold": (float(len(dims)), float(sum(d * d for d in dims) * per_element))}


def _fb_flops(s: LayerShape) -> float:
    return 6.0 * s.batch_size * s.positions * s.a_dim * s.g_dim


def forward_backward_work(model: ModelShapes) -> Work:
    """Forward and backward work of all K-FAC layers (one call per layer)."""
    return {"forward_backward": (float(len(model)), sum(_fb_flops(s) for s in model))}


def timeline(
    model: ModelShapes,
    hw: Hardware,
    weight_sharing: str,
    itemsize: int,
    factors: bool = True,
    built: Collection[int] | None = None,
) -> tuple[dict[Key, float], list[float], float]:
    """Ready time of each factor (A in forward order, G in backward order), each layer's
    backward end (module order) and the backward's end.

    A layer's forward is a third of its forward/backward work, its backward
    two thirds; A is built right after the layer's forward, G right after
    its backward, as the capture hooks do (only when ``factors``, and only for the
    layers in ``built``, where given: a rank of an owner scheme builds its own layers'
    factors alone, so its backward ends sooner; None: every captured layer).
    """
    t, ready = 0.0, {}
    ends = [0.0] * len(model)
    for i, (s, c) in enumerate(zip(model, model.captured, strict=True)):
        t += hw.time({"forward_backward": (1 / 3, _fb_flops(s) / 3)}, 1)
        if c and factors and (built is None or i in built):
            t += hw.time(factor_work(s, "A", weight_sharing, itemsize), 1)
            ready[(s.name, "A")] = t
    for i in reversed(range(len(model))):
        s = model[i]
        t += hw.time({"forward_backward": (2 / 3, 2 * _fb_flops(s) / 3)}, 1)
        if model.captured[i] and factors and (built is None or i in built):
            t += hw.time(factor_work(s, "G", weight_sharing, itemsize), 1)
            ready[(s.name, "G")] = t
        ends[i] = t
    return ready, ends, t


def exposed(serial: float, tail: float, overlap: float) -> float:
    """Seconds a step waits on traffic that ran during compute (``Hardware.overlap`` rule).

    ``tail`` is what a link serving the traffic as it becomes ready leaves
    after the compute ends; the hardware hides that fraction ``overlap`` of
    the traffic, the rest stays serial.
    """
    return overlap * min(serial, max(0.0, tail)) + (1.0 - overlap) * serial


def ddp_comm(
    model: ModelShapes,
    hw: Hardware,
    p: int,
    buckets: Sequence[Sequence[tuple[int, int]]],
    *,
    itemsize: int,
    weight_sharing: str,
    factor_itemsize: int,
    factors: bool,
) -> tuple[float, float]:
    """(exposed, serial) seconds of DDP's bucketed gradient all-reduces.

    DDP launches a bucket's all-reduce once the backward pass has made all
    its gradients ready and serves the buckets one after another on one
    link. A parameter of a K-FAC layer is ready at the end of that layer's
    backward (with its G factor when ``factors``, as the capture hook runs
    first; :func:`_ready_times`). Only the link's tail past the backward's
    end is waited on, by :func:`exposed`.
    """
    _, ends, backward_end = timeline(model, hw, weight_sharing, factor_itemsize, factors)
    link = hw.link("allreduce")
    t = serial = 0.0
    for bucket, ready in zip(buckets, _ready_times(buckets, ends), strict=True):
        nbytes = sum(n for _, n in bucket) * itemsize
        seconds = link.time(1, wire_bytes("allreduce", nbytes, p), p)
        t = max(t, ready) + seconds
        serial += seconds
    return exposed(serial, t - backward_end, hw.overlap), serial


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
    ones by :func:`dpkfac.plan.fusion.plan_buckets`, anything else sends each alone.
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


LayerAdds = tuple[tuple[str, str, float, float], ...]


def _layer_work(
    s: LayerShape,
    *,
    factors: bool,
    decomposes: str,
    preconditions: bool,
    compute_method: str,
    weight_sharing: str,
    itemsize: int,
) -> LayerAdds:
    """One layer's K-FAC work as ``(phase, kind, calls, amount)`` additions, in the order
    :func:`_add_layer_work` adds them: its batch factors (``factors``), the decompositions
    of the factors named in ``decomposes`` ("A", "G", "AG" or "") and its preconditioning
    (``preconditions``). A pure function of its arguments, so a step's prediction prices
    each (layer, role) once however many ranks share it."""
    adds: list[tuple[str, str, float, float]] = []
    if factors:
        for which in "AG":
            for kind, (c, a) in factor_work(s, which, weight_sharing, itemsize).items():
                adds.append(("factor_compute", kind, c, a))
    dec_kind, dec_flops = (
        ("eigh", 2 * EIGH_COEFF) if compute_method == "eigen" else ("inverse", 2 * INVERSE_COEFF)
    )
    for d, which in ((s.a_dim, "A"), (s.g_dim, "G")):
        if which in decomposes:
            adds.append(("decomposition", dec_kind, 1, dec_flops * d**3))
    if preconditions:
        adds.append(("precondition", "precondition", 1, _precondition_flops(s, compute_method)))
    return tuple(adds)


def _add_layer_work(w: dict[str, Work], adds: LayerAdds) -> None:
    """Add :func:`_layer_work`'s additions to ``w`` (phase -> work)."""
    for phase, kind, calls, amount in adds:
        add_work(w.setdefault(phase, {}), kind, calls, amount)


def step_other_bytes(
    model: ModelShapes, collectives: Sequence[tr.Collective], *, itemsize: int, kl_clip: bool
) -> float:
    """Bytes a rank's K-FAC step reads and writes outside its timed phases.

    * Packing: a collective's buffer is one flat tensor, gathered from the tensors it
      carries (``torch.cat`` of the gradients, the updates or the decompositions, the
      triangle-packing gather of a factor) before it is launched: the buffer's bytes read
      and written once (:attr:`~dpkfac.costmodel.traffic.Collective.pack_bytes`; a large
      tensor travels in its own storage instead). (The overlapped mode's reductions and
      update exchanges and the pipelined factor all-reduces are packed in the backward
      hooks instead, on the same thread: :func:`step_prediction` books those as ``hooks``.)
    * Write-back: every K-FAC layer's update is copied into its ``.grad``, read and
      written once, and with the KL clip multiplied by its scale first (once more).

    Landing a received buffer is its communication phase's (:func:`landing_bytes`); the
    optimizer's step is its own.
    """
    packed = sum(2 * c.pack_bytes for c in collectives)
    updates = sum(s.a_dim * s.g_dim for s, c in zip(model, model.captured, strict=True) if c)
    return float(packed + (4 if kl_clip else 2) * updates * itemsize)


def step_other_work(
    model: ModelShapes, collectives: Sequence[tr.Collective], *, itemsize: int, kl_clip: bool
) -> Work:
    """A rank's K-FAC step work outside its timed phases: :func:`step_other_bytes` of
    "pack" copies (the streaming copy a landing is too: a fit of the run's phases leaves
    that engine as timed alone), one "host" call per K-FAC layer written back, and one
    "launch" call per collective in ``collectives`` (the Python around each outside its
    phase's timer)."""
    nbytes = step_other_bytes(model, collectives, itemsize=itemsize, kl_clip=kl_clip)
    work: Work = {"pack": (0.0, nbytes), "host": (float(sum(model.captured)), 0.0)}
    if collectives:
        work["launch"] = (float(len(collectives)), 0.0)
    return work


def _precondition_flops(s: LayerShape, compute_method: str) -> float:
    return (4.0 if compute_method == "eigen" else 2.0) * s.g_dim * s.a_dim * (s.g_dim + s.a_dim)


def precondition_seconds(s: LayerShape, hw: Hardware, compute_method: str = "eigen") -> float:
    """Seconds ``hw`` takes to precondition one layer's gradient (one call)."""
    return hw.time({"precondition": (1, _precondition_flops(s, compute_method))}, 1)


def compute_or_send_bound(shares: Sequence[Sequence[tuple[float, float]]]) -> float:
    """A lower bound on what items add to a step when each rank must either compute each of
    its items before a point of the step or send it after that point: ``shares[r]`` holds,
    per item of rank ``r``, (seconds of compute, seconds on the rank's link).

    Whatever items each rank computes before the point (set ``A_r``, the rest ``R_r``), the
    step grows by ``max_r C(A_r) + max_r E(R_r)`` (the point waits for the slowest rank, the
    link after it for the busiest), which for any one rank is at least ``C(A_r) + E(R_r)``,
    so at least ``sum(min(c, e))`` over its items: the largest such sum over ranks, exact
    for one rank.
    """
    return max((sum(min(c, e) for c, e in share) for share in shares), default=0.0)


def early_update_seconds(
    model: ModelShapes,
    plan: Plan,
    late: set[int],
    hw: Hardware,
    *,
    seconds_per_byte: float,
    compute_method: str = "eigen",
    itemsize: int = 4,
    kl_clip: bool = True,
) -> float:
    """A lower bound on what the updates of the layers the backward pass completes before its
    last gradient bucket (every layer not in ``late``) add to a step after its end, on any
    schedule.

    The last bucket's gradients exist only when the backward pass ends, so its transfer
    starts then at the earliest. A rank that sends a layer's update to its update group
    either preconditions the layer before its backward pass ends, which a serial compute
    stream lengthens by that much (:func:`precondition_seconds`), or after it, when the
    update (:func:`~dpkfac.plan.exchange.update_nbytes`, which must leave the rank at least
    once) goes out on its link beside the last bucket's transfer
    (:func:`compute_or_send_bound`). Layers every rank preconditions for itself (no update
    group) add nothing. ``model[i]`` is layer ``i`` of ``plan``.
    """

    def share(rank: int) -> list[tuple[float, float]]:
        group = plan.update_group(rank)
        if group is None or len(group) < 2:
            return []
        return [
            (
                precondition_seconds(s, hw, compute_method),
                sum(update_nbytes(s.g_dim, s.a_dim, with_kl=kl_clip, itemsize=itemsize))
                * seconds_per_byte,
            )
            for i, s in enumerate(model)
            if i not in late and plan.sends_update(rank, i)
        ]

    return compute_or_send_bound([share(r) for r in range(plan.world_size)])


def owner_seconds(
    shape: LayerShape,
    hw: Hardware,
    *,
    factor_every: int = 1,
    decomp_every: int = 1,
    compute_method: str = "eigen",
    weight_sharing: str = "expand",
    itemsize: int = 4,
) -> float:
    """Seconds per step that owning one layer costs a rank, as the timing model prices them.

    The owner's work of :func:`step_prediction` (batch factors, both
    decompositions, preconditioning), each phase amortised over its update
    interval and priced by ``hw``, per-call latencies included (why: :func:`seconds_cost`).
    """
    w: dict[str, Work] = {}
    adds = _layer_work(
        shape,
        factors=True,
        decomposes="AG",
        preconditions=True,
        compute_method=compute_method,
        weight_sharing=weight_sharing,
        itemsize=itemsize,
    )
    _add_layer_work(w, adds)
    every = {"factor_compute": factor_every, "decomposition": decomp_every, "precondition": 1}
    return sum(hw.time(w[phase], 1) / n for phase, n in every.items())


def seconds_cost(hw: Hardware, kfac: KFACOptions | None = None, itemsize: int = 4) -> CostFn:
    """A placement cost (``assignment_cost``) in the timing model's seconds on ``hw``.

    ``DPKFACOptions(assignment_cost=seconds_cost(hw, kfac))`` makes LPT (and
    "best") balance what :func:`dpkfac.costmodel.predict` prices, rather than
    flops: the default cost (:func:`dpkfac.plan.assignment.compute_cost`) is
    hardware-free, so every rank computes the same placement with nothing
    measured, but it leaves out per-call latency. Where that latency dominates
    (small decompositions on a GPU), a flop-balanced placement can pile many small
    layers on one rank and be predicted slower than round robin (ResNet-32 at P=8 on
    ``v100_ib100``: LPT by flops puts 5 layers, 10 decompositions, on its busiest
    rank; ``tests/test_placement_cost.py``).
    """
    kfac = KFACOptions() if kfac is None else kfac
    factor_every, decomp_every = kfac.factor_update_steps, kfac.inv_update_steps
    if not (isinstance(factor_every, int) and isinstance(decomp_every, int)):
        raise ValueError("seconds_cost needs int update intervals, not schedules")
    return partial(
        owner_seconds,
        hw=hw,
        factor_every=factor_every,
        decomp_every=decomp_every,
        compute_method=kfac.compute_method,
        weight_sharing=kfac.weight_sharing,
        itemsize=itemsize,
    )


def _ready_times(
    buckets: Sequence[Sequence[tuple[int, int]]], ends: Sequence[float]
) -> list[float]:
    """When each bucket of (layer or -1, elements) parameters, in backward order, is complete.

    A K-FAC layer's parameters are ready at the end of its backward
    (``ends``); any other parameter (normalisation, embeddings) with the
    K-FAC layer whose backward ended last before it in backward order.
    """
    out, last = [], 0.0
    for bucket in buckets:
        ready = 0.0
        for layer, _ in bucket:
            if layer >= 0:
                last = ends[layer]
            ready = max(ready, last)
        out.append(ready)
    return out


def _overlap_backward(
    hw: Hardware,
    p: int,
    seconds: list[dict[str, float]],
    buckets: Sequence[tr.OverlapBucket],
    *,
    ends: Sequence[Sequence[float]],
    backward_end: Sequence[float],
    drain: Sequence[Mapping[int, tuple[float, float]]],
    in_hooks: bool = False,
    polls: Sequence[Sequence[float]] | None = None,
) -> None:
    """Hide gradient and update traffic behind the backward pass (``overlapped_precondition``).

    The engine's schedule (:mod:`dpkfac.overlap`): a bucket's reduction
    (:func:`dpkfac.costmodel.traffic.overlap_buckets`, the runtime's own buckets, in backward
    order) is launched once every rank's backward has made its gradients ready
    (:func:`_ready_times` of ``ends[r]``, each rank's backward with the factors it builds),
    its K-FAC part first. Each rank drains the buckets in order: it
    waits for a bucket's K-FAC part, decomposes (on a decomposition step) and preconditions
    the layers of it that it owns, launches their update exchange (the exchange starts when
    the slowest rank has launched it) and folds their batch factors (on a factor step):
    ``drain[r]`` holds, per layer, rank ``r``'s seconds before and after that launch. It
    drains once its last bucket is launched (``backward_end[r]``), or with ``in_hooks``
    (:meth:`~dpkfac.plan.traits.Traits.drains_in_hooks`) also from each hook before, the
    buckets already reduced then, their folds left to the end: that work holds back the
    rank's later launches by its seconds. The hooks: ``polls[r]``, the backward's times at
    which one runs (the engine's own hooks run at every parameter's gradient), or None
    for one per bucket, at its launch (DDP's communication hook). A traced ResNet-32 step
    (practical, 1 Gbit/s) launched the first bucket's exchange 68-77 ms after its gradients
    were reduced: the last-launch drain sends no exchange before the backward ends.

    The gradient buckets and the exchanges are two process groups, each serving its
    collectives in order, sharing the link (:func:`dpkfac.costmodel.link.share`): an
    exchange runs beside the bucket on the wire, not behind it (traced on BERT-base, paper
    setting, 1 Gbit/s: a 1.2 MB exchange launched during the 23 MB embedding bucket
    completed 7.8 ms later). Where the transfers take turns with the compute on a core
    (``hw.overlap`` below 1), the drain runs at that pace while the link is busy
    (:func:`dpkfac.costmodel.link.paced_end`): those seconds are booked in the
    decompositions and preconditioning, whose timers run while the core is shared (the
    same trace: 57 ms per 768-wide eigendecomposition beside the transfers, 45 ms without).
    The step then waits for the link past the end of the busiest rank's compute, plus
    what is a wait in the plain mode too: landing each collective (averaging, copying
    back: a bucket's K-FAC part in the drain, the other gradients and the updates after
    it) and the share of the core the transfers take from the backward pass beside them.
    The collectives, hence the bytes, are unchanged: only the ``grad_comm`` and
    ``precond_comm`` waits shrink (by the same factor on every rank).
    """
    serial = seconds[0]["grad_comm"] + seconds[0]["precond_comm"]
    if serial <= 0.0 or not buckets:
        return
    params = [b.params for b in buckets]
    ready = [_ready_times(params, mine) for mine in ends]  # per rank

    def link_times(collectives: Sequence[tr.Collective]) -> list[float]:
        return [hw.link(c.kind).time(1, c.wire_bytes, p) for c in collectives]

    # Per bucket, its transfers' seconds alone on the link (priced once, not in every pass).
    grad_seconds = [link_times(b.grads) for b in buckets]
    rest_seconds = [link_times(b.rest) for b in buckets]
    send_seconds = [sum(link_times(b.updates)) for b in buckets]

    def exchange_lane(starts: Mapping[int, float]) -> list[tuple[float, float]]:
        """The exchanges' lane: each bucket's, in bucket order, from its start."""
        return [(starts[j], send_seconds[j]) for j in sorted(starts)]

    def landing(collectives: Sequence[tr.Collective]) -> float:
        """Seconds of landing them (averaging, copying back) on the compute thread."""
        amount = sum(c.landing_bytes for c in collectives)
        return hw.time({"unpack": (0.0, amount)}, p) if amount else 0.0

    # Per rank and bucket, the drain's seconds before its exchange (landing its K-FAC part,
    # booked in the wait like every landing, then its layers' work) and after (the folds).
    lands = [landing(b.grads) for b in buckets]
    pre = [
        [
            land + sum(d.get(i, (0.0, 0.0))[0] for i in b.layers)
            for b, land in zip(buckets, lands, strict=True)
        ]
        for d in drain
    ]
    post = [[sum(d.get(i, (0.0, 0.0))[1] for i in b.layers) for b in buckets] for d in drain]

    def schedule(starts: Mapping[int, float], busy: Sequence[tuple[float, float]]) -> _Schedule:
        """One pass of the step, the update exchanges starting at ``starts`` (the previous
        pass's) and the drain paced beside the link's periods ``busy``: when each exchange
        starts as this pass drains (every rank has launched it), the gradient group's
        transfers (launch, seconds), each rank's clock after its drain, and each rank's
        seconds of drain lost to the transfers beside it."""
        exchanges = exchange_lane(starts)
        grads: list[tuple[float, float]] = []  # the gradient group's transfers, in launch order
        clock = [0.0] * p  # each rank's time
        at = [0.0] * p  # how far its backward has got, in the backward's own seconds
        drained = [0] * p  # each rank's next bucket to drain
        lost = [0.0] * p  # each rank's seconds of drain lost to the transfers beside it
        sent: dict[int, list[float]] = {}  # bucket -> each rank's launch of its exchange
        reduced: list[float] = []  # when each bucket's K-FAC part is reduced

        def run(rank: int, start: float, seconds: float) -> float:
            """When ``seconds`` of the rank's drain started at ``start`` end: at the pace
            ``hw.overlap`` while the link is busy, as the transfers take the rest of the core."""
            end = paced_end(start, seconds, busy, hw.overlap)
            lost[rank] += end - start - seconds
            return end

        def reach(rank: int, when: float) -> float:
            """The rank's time once its backward has got to ``when`` (its own seconds)."""
            clock[rank] += when - at[rank]
            at[rank] = when
            return clock[rank]

        for j, b in enumerate(buckets):
            launch = max(reach(r, ready[r][j]) for r in range(p))
            grads += [(launch, x) for x in grad_seconds[j]]
            reduced.append(share([grads, exchanges])[0][-1] if b.grads else launch)
            grads += [(launch, x) for x in rest_seconds[j]]
            if not in_hooks or j == len(buckets) - 1:
                continue
            hooks = [
                (r, h)
                for r, (when, upto) in enumerate((mine[j], mine[j + 1]) for mine in ready)
                for h in [when, *(x for x in (polls[r] if polls else ()) if when < x < upto)]
            ]
            for rank, hook in hooks:
                now = reach(rank, hook)
                while drained[rank] <= j and reduced[drained[rank]] <= now:
                    now = run(rank, now, pre[rank][drained[rank]])
                    sent.setdefault(drained[rank], []).append(now)
                    drained[rank] += 1
                clock[rank] = now
        cursors = [reach(r, e) for r, e in enumerate(backward_end)]  # after the last launch
        for rank in range(p):
            for j in range(drained[rank], len(buckets)):
                launched = run(rank, max(cursors[rank], reduced[j]), pre[rank][j])
                sent.setdefault(j, []).append(launched)
                cursors[rank] = run(rank, launched, post[rank][j])
            folds = sum(post[rank][: drained[rank]])
            cursors[rank] = run(rank, cursors[rank], folds)
        started = {j: max(sent[j]) for j, b in enumerate(buckets) if b.layers and b.updates}
        return started, grads, cursors, lost

    def link_busy(
        starts: Mapping[int, float], grads: Sequence[tuple[float, float]]
    ) -> list[tuple[float, float]]:
        exchanges = exchange_lane(starts)
        return busy_periods([grads, exchanges], share([grads, exchanges]))

    def settle(busy: Sequence[tuple[float, float]]) -> tuple[_Schedule, list[tuple[float, float]]]:
        """The schedule at its fixed point, the drain paced beside ``busy``, and the link's
        busy periods in it. An exchange slows the gradient transfers beside it, which
        delays the drain that launches the later exchanges: each pass starts from the
        last one's exchange starts, and at least halves the change (two lanes share the
        link; a paced drain moves no more than its start does)."""
        starts: dict[int, float] = {}
        for _ in range(_SCHEDULE_PASSES):
            found = schedule(starts, busy)
            settled = found[0].keys() == starts.keys() and all(
                abs(found[0][j] - starts[j]) <= 1e-9 for j in starts
            )
            starts = found[0]
            if settled:
                break
        else:
            warnings.warn(
                f"the overlapped mode's schedule did not settle in {_SCHEDULE_PASSES} passes; "
                "its last pass is priced",
                RuntimeWarning,
                stacklevel=3,
            )
        return found, link_busy(found[0], found[1])

    # Where the transfers take a share of the core (``overlap`` below 1), the drain is paced
    # beside the link's busy periods of the schedule without that pacing: pacing against its
    # own periods would feed back (a slower drain sends its exchanges later, which moves the
    # periods) without settling where the drain stops dead beside the link.
    (_, _, cursors, lost), busy = settle([])
    if hw.overlap < 1.0:
        (_, _, cursors, lost), busy = settle(busy)
    t = busy[-1][1] if busy else 0.0  # when the link is done
    # The step waits for the link past the end of the busiest rank's compute (its drain
    # slowed by the transfers beside it, ``lost``): that wait is the mode's whole
    # communication time, the lost seconds are booked in the phases whose timers ran
    # while the core was shared (decomposition and preconditioning).
    computed = [
        e + sum(x + y for x, y in d.values()) + extra
        for e, d, extra in zip(backward_end, drain, lost, strict=True)
    ]
    # After the drain, step() lands the other gradients and the exchanged updates. The
    # backward pass beside the transfers loses its share of the core too: not slowed in the
    # schedule (whose launches it would move, and which then need not settle), it is added
    # here, the busiest rank's, as a wait on the transfers.
    tail = landing([c for b in buckets for c in (*b.rest, *b.updates)])
    stalled = max(
        (1.0 - hw.overlap) * sum(max(0.0, min(b, end) - a) for a, b in busy if a < end)
        for end in backward_end
    )
    wait = max(0.0, max(t, *cursors) + tail + stalled - max(computed))
    scale = min(serial, wait) / serial
    for r, extra in zip(seconds, lost, strict=True):
        r["grad_comm"] *= scale
        r["precond_comm"] *= scale
        own = r.get("decomposition", 0.0) + r.get("precondition", 0.0)
        for ph in ("decomposition", "precondition") if own > 0.0 else ():
            r[ph] = r.get(ph, 0.0) * (1.0 + extra / own)


def _drain_seconds(
    model: ModelShapes,
    plan: Plan,
    hw: Hardware,
    p: int,
    rank: int,
    *,
    decomp: bool,
    folded: Sequence[int],
    compute_method: str,
    itemsize: int,
) -> dict[int, tuple[float, float]]:
    """Per layer, the seconds ``rank`` spends on it in the overlapped mode's drain
    (:func:`_overlap_backward`) before launching its update exchange (its decompositions on
    a decomposition step, its preconditioning) and after (its fold, where ``folded`` holds
    it)."""
    out = {}
    for i, s in enumerate(model):
        if not model.captured[i]:
            continue
        letters = "".join(x for x in "AG" if decomp and plan.decomposes(rank, i, x))
        adds = _layer_work(
            s,
            factors=False,
            decomposes=letters,
            preconditions=plan.preconditions(rank, i),
            compute_method=compute_method,
            weight_sharing="",
            itemsize=itemsize,
        )
        before = sum(hw.time({kind: (calls, amount)}, p) for _, kind, calls, amount in adds)
        after = hw.time(fold_work(model, [i], itemsize), p) if i in folded else 0.0
        if before or after:
            out[i] = (before, after)
    return out


def _built(model: ModelShapes, plan: Plan, rank: int) -> list[int]:
    """The layers whose batch factors ``rank`` builds (and folds)."""
    return [i for i in range(len(model)) if model.captured[i] and plan.captures(rank, i)]


def step_prediction(
    model: ModelShapes,
    p: int,
    plan: Plan | None,
    hw: Hardware,
    rank_colls: list[list[tr.Collective]],
    *,
    factor: bool,
    decomp: bool,
    compute_method: str,
    weight_sharing: str,
    factor_itemsize: int,
    fusion_plan: list[list[Key]] | None,
    ddp: Sequence[Sequence[tuple[int, int]]] | None = None,
    param_itemsize: int = 4,
    overlap: Sequence[tr.OverlapBucket] | None = None,
    ddp_hook: bool = False,
    optimizer_bytes: int = 0,
    kl_clip: bool = True,
) -> StepPrediction:
    """Work, seconds and critical path of one step where each rank sends ``rank_colls[r]``.

    ``plan`` None is plain data parallelism (no K-FAC work). ``ddp``: the
    gradients are averaged by DDP in these buckets (:func:`ddp_comm`),
    overlapped with the backward pass. Without K-FAC they are the step's
    accounted ``grad_comm`` (in ``rank_colls``), whose wait shrinks to what
    the backward leaves exposed; with K-FAC, DDP's all-reduces are not the
    preconditioner's (not in ``rank_colls``) and their exposed wait is the
    breakdown's ``ddp_grad_comm``. ``overlap``: the overlapped mode's
    backward buckets (:func:`_overlap_backward`); ``ddp_hook``: the mode runs as DDP's
    communication hook (one hook per bucket, not one per parameter). ``optimizer_bytes``: what the
    first-order optimizer's step reads and writes
    (:func:`dpkfac.costmodel.optimizers.step_bytes`), the breakdown's ``optimizer``.
    With K-FAC, ``step()``'s work outside its timed phases
    (:func:`step_other_work`; ``kl_clip``: the updates are scaled) is the breakdown's
    ``step_other``, on the busiest rank, and packing the buffers the backward hooks
    launch (the overlapped mode's, pipelined factors) its ``hooks``: the same copies,
    on the compute thread during the backward pass.
    """
    traits = None if plan is None else plan.traits
    work: list[dict[str, Work]] = []
    seconds = []
    priced: dict[tuple[int, bool, str, bool], LayerAdds] = {}  # (layer, role) -> its work
    for r in range(p):
        w: dict[str, Work] = {}
        for c in rank_colls[r] if rank_colls else []:
            phase = w.setdefault(PHASE_OF_CATEGORY[c.category], {})
            add_work(phase, c.kind, 1, c.wire_bytes)
            add_work(phase, "unpack", 0, c.landing_bytes)
        for i, s in enumerate(model):
            if plan is not None and model.captured[i]:
                role = (
                    i,
                    factor and plan.captures(r, i),
                    "".join(x for x in "AG" if decomp and plan.decomposes(r, i, x)),
                    plan.preconditions(r, i),
                )
                if role not in priced:
                    priced[role] = _layer_work(
                        s,
                        factors=role[1],
                        decomposes=role[2],
                        preconditions=role[3],
                        compute_method=compute_method,
                        weight_sharing=weight_sharing,
                        itemsize=factor_itemsize,
                    )
                _add_layer_work(w, priced[role])
        work.append(w)
        seconds.append({ph: hw.time(w.get(ph, {}), p) for ph in (*COMPUTE_PHASES, *COMM_PHASES)})
    serial = {ph: seconds[0][ph] for ph in COMM_PHASES}
    pipelined = traits is not None and traits.factor_comm == "pipelined"
    if pipelined and "factor_comm" in work[0] and fusion_plan:
        ready, _, backward_end = timeline(model, hw, weight_sharing, factor_itemsize)
        link, finish = hw.link("allreduce"), -math.inf
        factor_colls = [c for c in rank_colls[0] if c.category == "factor_allreduce"]
        for c, bucket in zip(factor_colls, fusion_plan, strict=True):
            start = max(finish, max(ready[k] for k in bucket))
            finish = start + link.time(1, c.wire_bytes, p)
        hidden = hw.overlap * max(0.0, finish - backward_end)
        # Unpacking happens in step(), after the backward pass: never hidden.
        unpack = hw.time({"unpack": work[0]["factor_comm"].get("unpack", (0.0, 0.0))}, p)
        for t in seconds:
            t["factor_comm"] = hidden + (1.0 - hw.overlap) * (t["factor_comm"] - unpack) + unpack
    # A factor step's folds, per rank: of the batch factors it built, into running averages.
    built = [tuple(_built(model, plan, r)) if plan is not None else () for r in range(p)]
    folds = [
        fold_work(model, built[r], factor_itemsize) if factor and plan is not None else {}
        for r in range(p)
    ]
    if plan is not None and plan.traits.overlapped_precondition and overlap:
        passes: dict[tuple[int, ...], tuple[list[float], float]] = {}
        for own in built:  # each rank's backward, with the factors it builds
            if own not in passes:
                _, ends, end = timeline(model, hw, weight_sharing, factor_itemsize, factor, own)
                passes[own] = ends, end
        lines = [passes[own] for own in built]
        _overlap_backward(
            hw,
            p,
            seconds,
            overlap,
            ends=[ends for ends, _ in lines],
            backward_end=[end for _, end in lines],
            in_hooks=plan.traits.drains_in_hooks(decomp) and drains_early(hw.backend),
            polls=None if ddp_hook else [sorted(ends) for ends, _ in lines],
            drain=[
                _drain_seconds(
                    model,
                    plan,
                    hw,
                    p,
                    r,
                    decomp=decomp,
                    folded=built[r] if factor else (),
                    compute_method=compute_method,
                    itemsize=factor_itemsize,
                )
                for r in range(p)
            ],
        )
    ddp_wait = 0.0
    if ddp and p > 1:
        ddp_wait, _ = ddp_comm(
            model,
            hw,
            p,
            ddp,
            itemsize=param_itemsize,
            weight_sharing=weight_sharing,
            factor_itemsize=factor_itemsize,
            factors=plan is not None and factor,
        )
        if plan is None:
            for t in seconds:
                t["grad_comm"] = ddp_wait

    def critical(phases: Sequence[str]) -> dict[str, float]:
        r = max(range(p), key=lambda r: sum(seconds[r][ph] for ph in phases))
        return {ph: seconds[r][ph] for ph in phases}

    breakdown = {"forward_backward": hw.time(forward_backward_work(model), p)}
    breakdown.update(critical(["factor_compute"]))
    if ddp_wait and plan is not None:
        breakdown["ddp_grad_comm"] = ddp_wait
    breakdown["grad_comm"] = seconds[0]["grad_comm"]
    breakdown["factor_comm"] = max(t["factor_comm"] for t in seconds)
    if traits is not None and traits.decomposition_broadcast:
        # The broadcast waits for the slowest decomposer, and preconditioning for it.
        breakdown.update(critical(["decomposition"]))
        breakdown["decomposition_comm"] = seconds[0]["decomposition_comm"]
        breakdown.update(critical(["precondition"]))
    else:
        breakdown.update(critical(["decomposition", "precondition"]))
    breakdown["precond_comm"] = seconds[0]["precond_comm"]
    if plan is not None:
        # Launched from the backward hooks: the overlapped mode's reductions and exchanges,
        # the pipelined factor all-reduces. Their packing lengthens the backward pass.
        hooked = {"grad_allreduce", "precond_broadcast"} if overlap else set()
        hooked |= {"factor_allreduce"} if pipelined else set()
        # The overlapped mode folds in the hook that launches the last bucket (inside the
        # backward pass, before step()); otherwise step() folds.
        folded_in = "hooks" if plan.traits.overlapped_precondition and overlap else "step_other"
        for r in range(p):
            colls = rank_colls[r] if rank_colls else []
            mine = [c for c in colls if c.category not in hooked]
            work[r]["step_other"] = step_other_work(
                model, mine, itemsize=param_itemsize, kl_clip=kl_clip
            )
            in_hooks = [c for c in colls if c.category in hooked]
            packed = sum(2.0 * c.pack_bytes for c in in_hooks)
            work[r]["hooks"] = {"pack": (0.0, packed)} if packed else {}
            if in_hooks:
                work[r]["hooks"]["launch"] = (float(len(in_hooks)), 0.0)
            for kind, (calls, amount) in folds[r].items():
                add_work(work[r][folded_in], kind, calls, amount)
        breakdown["step_other"] = max(hw.time(w["step_other"], p) for w in work)
        if any(w["hooks"] for w in work):
            breakdown["hooks"] = max(hw.time(w["hooks"], p) for w in work)
    if optimizer_bytes:
        breakdown["optimizer"] = hw.time({"optimizer": (1, optimizer_bytes)}, p)
    return StepPrediction(rank_colls, work, seconds, breakdown, serial)
