"""Which collectives each strategy launches, buffer by buffer, and what each rank holds.

This is the exact half of the cost model: it replays the strategies'
placement (:func:`dpkfac.assignment.assign_layers` /
:func:`~dpkfac.assignment.assign_factors`), their fusion plans
(:func:`dpkfac.fusion.plan_buckets`) and the communicator's bucket rule
(:func:`dpkfac.fusion.size_cap_buckets`, the single-dtype case of
``dpkfac.comm._bucket_plan``), so the predicted bytes, calls and wire bytes
are what :meth:`dpkfac.KFACPreconditioner.comm_stats` reports on every rank.
All tensors of one category are assumed to share one dtype.

Orders mirrored from the code: gradients go layer by layer (weight, then
bias), then the other parameters; dp-kfac broadcasts per owner rank, each
layer's update matrix followed by its two KL scalars; decompositions go per
source rank, layer by layer, A before G, eigenvectors before eigenvalues.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dpkfac.assignment import assign_factors, assign_layers
from dpkfac.comm import triangle_numel
from dpkfac.costmodel.hardware import wire_bytes
from dpkfac.costmodel.shapes import ModelShapes
from dpkfac.fusion import size_cap_buckets
from dpkfac.stats import COMM_CATEGORIES

__all__ = [
    "Collective",
    "Placement",
    "bucket_bytes",
    "comm_counts",
    "decomposition_collectives",
    "decomposition_numel",
    "factor_collectives",
    "grad_collectives",
    "memory_per_rank",
    "place",
    "precond_collectives",
]

Key = tuple[str, str]


@dataclass(frozen=True)
class Collective:
    """One buffer handed to torch.distributed.

    ``unpack_bytes``: bytes of full matrices rebuilt from a triangle-packed
    buffer once it arrives (a gather as large as the matrices, timed in the
    collective's phase; plain buffers are copied back at negligible cost).
    """

    category: str
    kind: str
    nbytes: int
    world_size: int
    unpack_bytes: int = 0

    @property
    def wire_bytes(self) -> int:
        return wire_bytes(self.kind, self.nbytes, self.world_size)


@dataclass(frozen=True)
class Placement:
    """Who does what: per layer ``owner`` (dp-kfac) and per factor decomposer.

    ``a_owner``/``g_owner`` entries are None for factors every rank
    decomposes itself (spd-kfac below the local threshold).
    """

    owner: tuple[int, ...]
    a_owner: tuple[int | None, ...]
    g_owner: tuple[int | None, ...]


def place(
    model: ModelShapes,
    world_size: int,
    strategy: str,
    *,
    assignment: str = "lpt",
    assignment_cost: str = "compute",
    local_threshold: int | None = None,
) -> Placement:
    """The placement the strategy computes from the same shapes."""
    if strategy == "dp-kfac":
        owners = tuple(assign_layers(list(model), world_size, assignment_cost, assignment))
        return Placement(owners, owners, owners)
    dims = [d for s in model for d in (s.a_dim, s.g_dim)]
    threshold = local_threshold if strategy == "spd-kfac" else None
    placed = assign_factors(dims, world_size, local_threshold=threshold)
    a, g = tuple(placed[0::2]), tuple(placed[1::2])
    owner = tuple(next((o for o in pair if o is not None), -1) for pair in zip(a, g, strict=True))
    return Placement(owner, a, g)


def bucket_bytes(sizes: Sequence[int], cap_bytes: int | None) -> list[int]:
    """Bytes of each fused buffer for tensors of ``sizes`` bytes (split at the cap)."""
    if not sizes:
        return []
    if cap_bytes is None:
        return [sum(sizes)]
    return [sum(sizes[i] for i in b) for b in size_cap_buckets(sizes, cap_bytes)]


def _collectives(
    category: str, kind: str, sizes: Sequence[int], cap: int | None, p: int
) -> list[Collective]:
    return [Collective(category, kind, n, p) for n in bucket_bytes(sizes, cap)]


def grad_collectives(
    model: ModelShapes,
    world_size: int,
    *,
    itemsize: int,
    cap_bytes: int,
    owners: Sequence[int] | None = None,
) -> list[Collective]:
    """Gradient averaging: one capped all-reduce, or (owners given) reduces to owners.

    With ``owners`` (dp-kfac, ``grad_reduction="owner"``), each rank's K-FAC
    layer gradients are reduced onto it, then the other parameters are
    all-reduced.
    """
    cat = "grad_allreduce"
    layer_sizes = [[n * itemsize for n in model.param_numels(i)] for i in range(len(model))]
    others = [n * itemsize for n in model.other_params]
    if owners is None:
        flat = [n for sizes in layer_sizes for n in sizes] + others
        return _collectives(cat, "allreduce", flat, cap_bytes, world_size)
    out: list[Collective] = []
    for r in range(world_size):
        owned = [n for i, sizes in enumerate(layer_sizes) if owners[i] == r for n in sizes]
        out += _collectives(cat, "reduce", owned, cap_bytes, world_size)
    return out + _collectives(cat, "allreduce", others, cap_bytes, world_size)


def precond_collectives(
    model: ModelShapes,
    world_size: int,
    owners: Sequence[int],
    *,
    itemsize: int,
    cap_bytes: int,
    kl_clip: bool,
) -> list[Collective]:
    """dp-kfac: each owner broadcasts its layers' updates (and KL scalars), capped."""
    out: list[Collective] = []
    for r in range(world_size):
        sizes: list[int] = []
        for i, s in enumerate(model):
            if owners[i] == r:
                sizes.append(s.g_dim * s.a_dim * itemsize)
                if kl_clip:
                    sizes.append(2 * itemsize)
        out += _collectives("precond_broadcast", "broadcast", sizes, cap_bytes, world_size)
    return out


def factor_keys(model: ModelShapes) -> list[Key]:
    """Factors that exist (captured layers), in layer order, A before G."""
    return [(s.name, w) for s, c in zip(model, model.captured, strict=True) if c for w in "AG"]


def factor_dim(model: ModelShapes, key: Key) -> int:
    s = next(s for s in model if s.name == key[0])
    return s.a_dim if key[1] == "A" else s.g_dim


def factor_collectives(
    model: ModelShapes,
    world_size: int,
    strategy: str,
    *,
    itemsize: int,
    cap_bytes: int,
    plan: Sequence[Sequence[Key]] | None = None,
) -> list[Collective]:
    """Factor averaging: d-kfac full factors in capped buckets; spd-kfac one
    triangle-packed collective per fusion bucket (``plan``; None: the
    profiling steps, where each factor travels alone)."""
    keys = factor_keys(model)
    if strategy == "d-kfac":
        sizes = [factor_dim(model, k) ** 2 * itemsize for k in keys]
        return _collectives("factor_allreduce", "allreduce", sizes, cap_bytes, world_size)
    if strategy != "spd-kfac":
        return []
    buckets = [[k] for k in keys] if plan is None else plan
    return [
        Collective(
            "factor_allreduce",
            "allreduce",
            sum(triangle_numel(factor_dim(model, k)) for k in bucket) * itemsize,
            world_size,
            unpack_bytes=sum(factor_dim(model, k) ** 2 for k in bucket) * itemsize,
        )
        for bucket in buckets
        if bucket
    ]


def decomposition_numel(dim: int, compute_method: str) -> list[int]:
    """Elements of each tensor of one decomposition (eigen: vectors, values)."""
    return [dim * dim, dim] if compute_method == "eigen" else [dim * dim]


def decomposition_collectives(
    model: ModelShapes,
    world_size: int,
    placement: Placement,
    *,
    compute_method: str,
    itemsize: int,
    cap_bytes: int,
) -> list[Collective]:
    """d-kfac/spd-kfac: each source rank broadcasts the decompositions it computed."""
    out: list[Collective] = []
    for r in range(world_size):
        sizes: list[int] = []
        for i, s in enumerate(model):
            if not model.captured[i]:
                continue
            for dim, owner in ((s.a_dim, placement.a_owner[i]), (s.g_dim, placement.g_owner[i])):
                if owner == r:
                    sizes += [n * itemsize for n in decomposition_numel(dim, compute_method)]
        out += _collectives("decomposition_broadcast", "broadcast", sizes, cap_bytes, world_size)
    return out


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
    world_size: int,
    strategy: str,
    placement: Placement,
    *,
    compute_method: str,
    factor_itemsize: int,
    decomposition_itemsize: int,
) -> list[dict[str, int]]:
    """``memory_usage()`` of each rank after a factor and decomposition step.

    dp-kfac ranks hold their own layers' factors, decompositions and batch
    factors; d-kfac and spd-kfac ranks hold all of them (decompositions
    after the broadcast, or computed locally).
    """
    out = []
    for r in range(world_size):
        factors = decomps = 0
        for i, s in enumerate(model):
            if not model.captured[i] or (strategy == "dp-kfac" and placement.owner[i] != r):
                continue
            factors += (s.a_dim**2 + s.g_dim**2) * factor_itemsize
            decomps += (
                sum(sum(decomposition_numel(d, compute_method)) for d in (s.a_dim, s.g_dim))
                * decomposition_itemsize
            )
        out.append({"factors": factors, "decompositions": decomps, "buffers": factors})
    return out
