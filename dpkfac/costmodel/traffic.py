"""Which collectives a strategy launches, buffer by buffer, and what each rank holds.

This is the exact half of the cost model. It never asks which strategy it
prices: it reads the run's :class:`~dpkfac.plan.Plan` (traits, placement,
roles and rank groups), the very object the runtime strategy executes. This
module replays those answers with the
communicator's bucket rule (:func:`dpkfac.plan.fusion.fused_buckets`, the
single-dtype case of :func:`dpkfac.comm.bucket_plan`) and the fusion plans of
pipelined factor traffic, so the predicted bytes, calls and wire bytes are
what :meth:`dpkfac.KFACPreconditioner.comm_stats` reports on every rank. All
tensors of one category are assumed to share one dtype.

The gradients' reduction, the factors' all-reduces, the decompositions' broadcasts and the
updates' exchange are priced from the runtime's own descriptions of them
(:mod:`dpkfac.plan.exchange`), which the runtime launches, and so are the tensors within a
buffer: an update's matrix and KL scalars (:func:`~dpkfac.plan.exchange.update_shapes`), a
decomposition's tensors (the method's own ``Decomposition.shapes``, factors in
:data:`~dpkfac.curvature.layer.FACTORS` order). A layer's parameters go weight, then bias
(:meth:`~dpkfac.costmodel.shapes.ModelShapes.param_numels`, as its module helper yields them),
and the other parameters after the layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from dpkfac.comm import triangle_numel
from dpkfac.costmodel.shapes import ModelShapes
from dpkfac.curvature.decomposition import DECOMPOSITIONS
from dpkfac.curvature.layer import FACTORS
from dpkfac.plan.assignment import LayerShape
from dpkfac.plan.exchange import (
    decomposition_transfers,
    factor_transfers,
    gradient_transfers,
    update_nbytes,
    update_transfers,
    waited_by_layers,
)
from dpkfac.plan.fusion import (
    ddp_buckets,
    ddp_first_cap,
    fused_buckets,
    shard_rounds,
    travels_alone,
)
from dpkfac.plan.hardware import (
    landing_bytes,
    wire_bytes,
)
from dpkfac.plan.roles import Plan
from dpkfac.plan.traits import Traits
from dpkfac.stats import COMM_CATEGORIES

__all__ = [
    "Collective",
    "OverlapBucket",
    "comm_counts",
    "completing_buckets",
    "ddp_bucket_params",
    "ddp_collectives",
    "decomposition_collectives",
    "decomposition_numel",
    "factor_collectives",
    "factor_dim",
    "factor_keys",
    "fused_collectives",
    "grad_collectives",
    "memory_per_rank",
    "overlap_buckets",
    "overlap_collectives",
    "overlap_param_buckets",
    "precond_collectives",
    "sharded_collectives",
    "with_buckets",
]

Key = tuple[str, str]


@dataclass(frozen=True)
class Collective:
    """One buffer handed to torch.distributed.

    ``unpack_bytes``: bytes of full matrices rebuilt from a triangle-packed
    buffer once it arrives (a gather as large as the matrices, timed in the
    collective's phase, in place of a plain buffer's copy back). ``in_place``:
    the buffer is the tensors' own storage (DDP's bucket views), so nothing lands.
    ``own_storage``: one tensor travelling alone in its own storage
    (:func:`~dpkfac.plan.fusion.travels_alone`): nothing is packed, and landing it is
    a mean's division only.
    """

    category: str
    kind: str
    nbytes: int
    world_size: int
    unpack_bytes: int = 0
    in_place: bool = False
    own_storage: bool = False

    @property
    def wire_bytes(self) -> int:
        return wire_bytes(self.kind, self.nbytes, self.world_size)

    @property
    def landing_bytes(self) -> float:
        """Bytes a rank writes to land it (:func:`~dpkfac.plan.hardware.landing_bytes`)."""
        if self.in_place:
            return 0.0
        return landing_bytes(
            self.kind, self.nbytes, self.world_size, self.unpack_bytes, own=self.own_storage
        )

    @property
    def pack_bytes(self) -> int:
        """Bytes gathered into its flat buffer before it is launched (0: its tensors' own
        storage)."""
        return 0 if self.in_place or self.own_storage else self.nbytes


def fused_collectives(
    category: str, kind: str, sizes: Sequence[int], cap_bytes: int | None, p: int
) -> list[Collective]:
    """One ``kind`` collective per fused buffer of tensors of ``sizes`` bytes, as the
    communicator fuses them (:func:`dpkfac.plan.fusion.fused_buckets`: split at the cap, a
    large tensor alone and, where the kind allows, in its own storage)."""
    out = []
    for bucket in fused_buckets(sizes, cap_bytes):
        nbytes = [sizes[i] for i in bucket]
        own = travels_alone(kind, nbytes)
        out.append(Collective(category, kind, sum(nbytes), p, own_storage=own))
    return out


def _update_exchange(
    model: ModelShapes,
    plan: Plan,
    senders: Sequence[Sequence[int]],
    *,
    itemsize: int,
    cap_bytes: int,
    kl_clip: bool,
) -> list[Collective]:
    """The update exchange the runtime launches for ``senders[i]``'s layers
    (:func:`dpkfac.plan.exchange.update_transfers`, the one description of it), priced
    transfer by transfer: a broadcast as its capped buckets, an all-gather round by round.
    Each update travels as
    :func:`~dpkfac.plan.exchange.update_shapes` says (with its KL scalars when the clip is
    on)."""

    def sizes(layers: Sequence[int]) -> list[int]:
        shapes = [model[i] for i in layers]
        return [
            n
            for s in shapes
            for n in update_nbytes(s.g_dim, s.a_dim, with_kl=kl_clip, itemsize=itemsize)
        ]

    p, cat = len(senders), "precond_broadcast"
    out: list[Collective] = []
    for transfer in update_transfers(plan.traits.owner_grad_reduction, senders):
        shards = [sizes(shard) for shard in transfer.shards]
        if transfer.kind == "broadcast":
            out += fused_collectives(cat, "broadcast", shards[0], cap_bytes, p)
        else:
            out += sharded_collectives(cat, "all_gather", shards, cap_bytes)
    return out


def sharded_collectives(
    category: str, kind: str, sizes: Sequence[Sequence[int]], cap_bytes: int | None
) -> list[Collective]:
    """A reduce-scatter or all-gather of owner-contiguous shards of ``sizes[r]`` bytes, round
    by round (:func:`dpkfac.plan.fusion.shard_rounds`); shards of different sizes, unpadded."""
    rounds = shard_rounds(sizes, cap_bytes)
    nbytes = [sum(sizes[r][i] for r, idx in enumerate(rnd) for i in idx) for rnd in rounds]
    return [Collective(category, kind, n, len(sizes)) for n in nbytes]


def grad_collectives(
    model: ModelShapes,
    world_size: int,
    *,
    itemsize: int,
    cap_bytes: int,
    plan: Plan | None = None,
) -> list[Collective]:
    """Gradient averaging in ``step()``: the reduction the runtime launches
    (:func:`dpkfac.plan.exchange.gradient_transfers`), each transfer capped.

    The K-FAC layers' gradients (layer by layer, weight then bias), then the other
    parameters': one all-reduce of all of them, or under ``plan``'s owner reduction one
    reduce-scatter of the owners' shards (each owner's layers in module order) and one
    all-reduce of the others (None: plain data parallelism, as SGD).
    """
    items = [(i, n) for i in range(len(model)) for n in model.param_numels(i)]
    items += [(-1, n) for n in model.other_params]
    owners = None
    if plan is not None and plan.traits.owner_grad_reduction:
        owners = [plan.preconditioners[i][0] for i in range(len(model))]
    transfers = _gradients(items, owners, world_size, itemsize, cap_bytes)
    return [c for _, colls in transfers for c in colls]


def _gradients(
    items: Sequence[tuple[int, int]],
    owners: Sequence[int] | None,
    world_size: int,
    itemsize: int,
    cap_bytes: int | None,
    *,
    kfac_first: bool = False,
) -> list[tuple[bool, list[Collective]]]:
    """The collectives of :func:`~dpkfac.plan.exchange.gradient_transfers` over ``items``
    ((layer index or -1, elements); ``owners``: each layer's owner under the owner
    reduction, None without it; ``kfac_first``: as the overlapped engine splits its buckets)
    as the communicator runs them, per transfer with whether a K-FAC layer waits for it
    (:func:`~dpkfac.plan.exchange.waited_by_layers`): an all-reduce in capped buckets, or a
    reduce-scatter round by round."""
    cat = "grad_allreduce"

    def owner(item: tuple[int, int]) -> int | None:
        """None for a parameter of no K-FAC layer; without the owner reduction only that
        matters (which gradients a layer waits for), so any rank stands for the others."""
        if item[0] < 0:
            return None
        return 0 if owners is None else owners[item[0]]

    out: list[tuple[bool, list[Collective]]] = []
    transfers = gradient_transfers(
        owners is not None, items, owner, world_size, kfac_first=kfac_first
    )
    for t in transfers:
        sizes = [[n * itemsize for _, n in shard] for shard in t.shards]
        if t.kind == "allreduce":
            colls = fused_collectives(cat, "allreduce", sizes[0], cap_bytes, world_size)
        else:
            colls = sharded_collectives(cat, "reduce_scatter", sizes, cap_bytes)
        out.append((waited_by_layers(t, owner), colls))
    return out


def ddp_bucket_params(
    model: ModelShapes, *, itemsize: int, cap_bytes: int
) -> list[list[tuple[int, int]]]:
    """DDP's gradient buckets: per bucket, (layer index or -1, elements) of its parameters.

    The parameters are taken in the order the backward pass makes their gradients
    ready (:meth:`~dpkfac.costmodel.shapes.ModelShapes.backward_order`), the order DDP
    rebuilds its buckets in after the first iteration, and cut by DDP's own rule
    (:func:`dpkfac.plan.fusion.ddp_buckets`, first cap :func:`~dpkfac.plan.fusion.ddp_first_cap`).
    """
    return _ddp_cut(model.backward_order(), itemsize, cap_bytes)


def _ddp_cut(
    params: Sequence[tuple[int, int]], itemsize: int, cap_bytes: int
) -> list[list[tuple[int, int]]]:
    """``params`` (layer index or -1, elements) cut into buckets by DDP's rule."""
    sizes = [n * itemsize for _, n in params]
    return [[params[i] for i in b] for b in ddp_buckets(sizes, cap_bytes, ddp_first_cap(cap_bytes))]


def ddp_collectives(
    buckets: Sequence[Sequence[tuple[int, int]]], world_size: int, *, itemsize: int
) -> list[Collective]:
    """DDP's gradient averaging: one all-reduce per bucket of :func:`ddp_bucket_params`."""
    nbytes = [sum(n for _, n in b) * itemsize for b in buckets]
    return [Collective("grad_allreduce", "allreduce", n, world_size, in_place=True) for n in nbytes]


def precond_collectives(
    model: ModelShapes,
    plan: Plan,
    rank: int,
    *,
    itemsize: int,
    cap_bytes: int,
    kl_clip: bool,
) -> list[Collective]:
    """The update exchange ``rank`` takes part in.

    Per sender of its update group, one capped broadcast bucket; under owner
    reduction (``Traits.owner_grad_reduction``) one all-gather of the owners' updates per
    round instead.
    """
    group = plan.update_group(rank)
    if group is None:
        return []
    senders = [[i for i in range(len(model)) if plan.sends_update(src, i)] for src in group]
    return _update_exchange(
        model,
        plan,
        senders,
        itemsize=itemsize,
        cap_bytes=cap_bytes,
        kl_clip=kl_clip,
    )


def factor_keys(model: ModelShapes) -> list[Key]:
    """Factors that exist (captured layers), in layer order, A before G."""
    return [(s.name, w) for s, c in zip(model, model.captured, strict=True) if c for w in "AG"]


def factor_dim(model: ModelShapes, key: Key) -> int:
    """Side of the factor ``key`` = (layer name, "A"/"G")."""
    s = next(s for s in model if s.name == key[0])
    return s.a_dim if key[1] == "A" else s.g_dim


def factor_collectives(
    model: ModelShapes,
    world_size: int,
    traits: Traits,
    *,
    itemsize: int,
    cap_bytes: int,
    plan: Sequence[Sequence[Key]] | None = None,
    include: Sequence[bool] | None = None,
) -> list[Collective]:
    """Factor averaging within a group of ``world_size`` ranks, as ``traits.factor_comm`` says.

    "none": nothing. "allreduce": the factors in capped buckets, from
    ``step()`` (batch factors on factor steps, or with
    ``traits.lazy_factor_sync`` the running factors on decomposition steps:
    the same buffers; the caller decides on which steps they travel).
    "pipelined": one collective per fusion bucket of ``plan`` (None: the
    profiling steps, where each factor travels alone), launched from the
    capture hooks. With ``traits.triangle`` only upper triangles
    travel and the full matrices are rebuilt on arrival (``unpack_bytes``).
    ``include`` (per layer) restricts the factors to those of the group's
    layers; a group of one rank sends nothing.
    """
    keys = factor_keys(model)
    if include is not None:
        held = {s.name for s, keep in zip(model, include, strict=True) if keep}
        keys = [k for k in keys if k[0] in held]
    if traits.factor_comm == "none" or not keys or world_size < 2:
        return []
    tri = traits.triangle
    dims = [factor_dim(model, k) for k in keys]
    numels = [triangle_numel(d) if tri else d * d for d in dims]
    index = {k: i for i, k in enumerate(keys)}
    runs: list[list[int]] = []
    for t in factor_transfers(traits.factor_comm, keys, plan):
        sent = [index[k] for k in t.shards[0]]
        if traits.factor_comm == "allreduce":  # fused into capped buffers, as the runtime's
            sizes = [numels[i] * itemsize for i in sent]
            runs += [[sent[j] for j in b] for b in fused_buckets(sizes, cap_bytes)]
        else:
            runs.append(sent)
    out = []
    for run in filter(None, runs):
        nbytes = [numels[i] * itemsize for i in run]
        out.append(
            Collective(
                "factor_allreduce",
                "allreduce",
                sum(nbytes),
                world_size,
                unpack_bytes=sum(dims[i] ** 2 for i in run) * itemsize if tri else 0,
                own_storage=not tri and travels_alone("allreduce", nbytes),
            )
        )
    return out


def decomposition_numel(dim: int, compute_method: str) -> list[int]:
    """Elements of each tensor of one decomposition, in the order it travels: the tensors
    of the method's own :meth:`~dpkfac.curvature.decomposition.Decomposition.shapes` (eigen:
    vectors, then values), which the runtime broadcasts and receives into."""
    return [math.prod(shape) for shape in DECOMPOSITIONS[compute_method].shapes(dim)]


def decomposition_collectives(
    model: ModelShapes,
    plan: Plan,
    rank: int,
    *,
    compute_method: str,
    itemsize: int,
    cap_bytes: int,
) -> list[Collective]:
    """The decomposition broadcasts ``rank`` takes part in: per decomposer of its group, one
    capped bucket (layer by layer, A before G, eigenvectors before eigenvalues)."""
    group = plan.decomposition_group(rank)
    if group is None:
        return []
    sent = [
        [
            n * itemsize
            for i, s in enumerate(model)
            if model.captured[i]
            for which in FACTORS  # the runtime's order: layer by layer, A before G
            if plan.sends_decomposition(src, i, which)
            for n in decomposition_numel(s.a_dim if which == "A" else s.g_dim, compute_method)
        ]
        for src in group
    ]
    cat, p = "decomposition_broadcast", len(group)
    return [
        c
        for t in decomposition_transfers(sent)
        for c in fused_collectives(cat, "broadcast", t.shards[0], cap_bytes, p)
    ]


def comm_counts(collectives: Sequence[Collective]) -> dict[str, dict[str, int]]:
    """``comm_stats()``-shaped totals: every contract category, then extra ones."""
    out: dict[str, dict[str, int]] = {
        c: {"bytes": 0, "calls": 0, "wire_bytes": 0} for c in COMM_CATEGORIES
    }
    for c in collectives:
        entry = out.setdefault(c.category, {"bytes": 0, "calls": 0, "wire_bytes": 0})
        entry["bytes"] += c.nbytes
        entry["calls"] += 1
        entry["wire_bytes"] += c.wire_bytes
    return out


def memory_per_rank(
    model: ModelShapes,
    plan: Plan,
    *,
    compute_method: str,
    factor_itemsize: int,
    decomposition_itemsize: int,
) -> list[dict[str, int]]:
    """``memory_usage()`` of each rank after a factor and decomposition step.

    A rank holds the factors and batch factors of the layers its factor
    group captures (every layer where the group is the world, its own
    layers' where it is the rank alone); a rank holds the decompositions
    of the layers it preconditions. ``buffers`` is the peak of batch factors
    awaiting their fold: all of them, which wait for ``step()`` (or, under an
    overlapped strategy, for the last bucket's launch).
    """
    out = []
    captured = [i for i in range(len(model)) if model.captured[i]]
    for r in range(plan.world_size):
        # (A bytes, G bytes) of the layers this rank captures, in module order
        sizes = {
            i: (model[i].a_dim ** 2 * factor_itemsize, model[i].g_dim ** 2 * factor_itemsize)
            for i in captured
            if plan.captures(r, i)
        }
        factors = buffers = sum(a + g for a, g in sizes.values())
        decomps = decomposition_itemsize * sum(
            sum(decomposition_numel(d, compute_method))
            for i in captured
            if plan.preconditions(r, i)
            for d in (model[i].a_dim, model[i].g_dim)
        )
        out.append(
            {"factors_bytes": factors, "decompositions_bytes": decomps, "buffers_bytes": buffers}
        )
    return out


@dataclass(frozen=True)
class OverlapBucket:
    """One backward bucket of the overlapped mode (``Traits.overlapped_precondition``).

    Attributes:
        params: (layer index or -1, elements) of the parameters it holds, in
            backward order.
        grads: the reduction its K-FAC layers wait for: the all-reduce of their
            gradients, or under the owner reduction a reduce-scatter onto their
            owners.
        rest: launched after it, the all-reduce of its other gradients, which no
            layer waits for (empty where it holds none).
        layers: the layers whose last parameter it holds: they are
            preconditioned once its ``grads`` are reduced.
        updates: the exchange of those layers' updates (per owner a capped
            broadcast, or under the owner reduction an all-gather per round).
    """

    params: tuple[tuple[int, int], ...]
    grads: tuple[Collective, ...]
    rest: tuple[Collective, ...]
    layers: tuple[int, ...]
    updates: tuple[Collective, ...]


def overlap_param_buckets(
    model: ModelShapes, *, itemsize: int, cap_bytes: int, ddp: bool = False
) -> list[list[tuple[int, int]]]:
    """The overlapped mode's backward buckets, in launch order: per bucket, (layer index or
    -1, elements) of its parameters. Without DDP the parameters in reverse model order (the
    order a sequential backward produces them) cut by DDP's rule
    (:func:`dpkfac.overlap.backward_buckets`, one dtype); under DDP, DDP's own buckets
    (:func:`ddp_bucket_params`), which its communication hook hands over."""
    order = model.backward_order() if ddp else model.param_order()[::-1]
    return _ddp_cut(order, itemsize, cap_bytes)


def completing_buckets(buckets: Sequence[Sequence[tuple[int, int]]]) -> dict[int, int]:
    """The bucket that completes each K-FAC layer's gradient: the last one holding one of
    its parameters (layer index -> bucket index)."""
    return {layer: b for b, held in enumerate(buckets) for layer, _ in held if layer >= 0}


def with_buckets(
    shapes: Sequence[LayerShape],
    model: ModelShapes,
    *,
    itemsize: int,
    cap_bytes: int,
    ddp: bool = False,
) -> list[LayerShape]:
    """``shapes`` (the layers of ``model``, in its order) with the overlapped mode's bucket
    that completes each (:attr:`~dpkfac.plan.assignment.LayerShape.bucket`), as placement
    balances them (the run's first step computes them from the same parameters)."""
    last = completing_buckets(
        overlap_param_buckets(model, itemsize=itemsize, cap_bytes=cap_bytes, ddp=ddp)
    )
    return [replace(s, bucket=last.get(i)) for i, s in enumerate(shapes)]


def overlap_buckets(
    model: ModelShapes,
    plan: Plan,
    *,
    itemsize: int,
    cap_bytes: int,
    kl_clip: bool,
    ddp: bool = False,
) -> list[OverlapBucket]:
    """The overlapped mode's backward buckets, each with its reduction and update exchange.

    The buckets are :func:`overlap_param_buckets`'. A layer is sent once the last
    bucket holding one of its parameters is reduced (:func:`completing_buckets`); under
    the owner reduction (``Traits.owner_grad_reduction``) the updates are all-gathered
    per round.
    """
    p = plan.world_size

    def reduction(held: Sequence[tuple[int, int]]) -> tuple[list[Collective], list[Collective]]:
        """One bucket's gradient collectives, as ``OverlapEngine._reduce`` launches them:
        what its layers wait for, and the rest."""
        owners = owner_of if plan.traits.owner_grad_reduction else None
        parts = _gradients(held, owners, p, itemsize, None, kfac_first=True)
        waited = [c for w, colls in parts if w for c in colls]
        return waited, [c for w, colls in parts if not w for c in colls]

    buckets = [
        tuple(b)
        for b in overlap_param_buckets(model, itemsize=itemsize, cap_bytes=cap_bytes, ddp=ddp)
    ]
    owner_of = [plan.preconditioners[i][0] for i in range(len(model))]
    last = completing_buckets(buckets)
    out = []
    for b, held in enumerate(buckets):
        layers = tuple(i for i in range(len(model)) if last.get(i) == b)
        senders = [[i for i in layers if owner_of[i] == owner] for owner in range(p)]
        updates = _update_exchange(
            model,
            plan,
            senders,
            itemsize=itemsize,
            cap_bytes=cap_bytes,
            kl_clip=kl_clip,
        )
        waited, rest = reduction(held)
        out.append(OverlapBucket(held, tuple(waited), tuple(rest), layers, tuple(updates)))
    return out


def overlap_collectives(
    buckets: Sequence[OverlapBucket],
) -> tuple[list[Collective], list[Collective]]:
    """The overlapped mode's gradient reductions, in launch order, and update exchanges (one
    rank's view)."""
    grads = [c for b in buckets for c in (*b.grads, *b.rest)]
    return grads, [c for b in buckets for c in b.updates]
