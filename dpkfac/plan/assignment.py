"""Load balancing of K-FAC work items (layers or single factors) to ranks.

Every rank calls these functions with the same inputs (module order and
shapes, which are identical on all ranks) and gets the same answer, so no
communication is needed to agree on who owns what. Nothing here imports
``torch``: the functions are plain arithmetic on shapes and costs.

Two placements are needed by the strategies:

* DP-KFAC gives each *layer* one owner that builds, decomposes and
  preconditions it (:func:`assign_layers`). The published code uses round
  robin over module order; greedy longest-processing-time (LPT) on a cost
  model lowers the busiest rank's load, which sets the step time.
* D-KFAC and SPD-KFAC place each *factor's decomposition* (A and G of every
  layer as separate items) on one rank (:func:`assign_factors`); SPD-KFAC
  decomposes small factors locally on every rank instead of broadcasting
  them.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dpkfac.plan.hardware import Hardware

__all__ = [
    "ASSIGNMENTS",
    "BUCKET_COST_TOLERANCE",
    "COSTS",
    "EIGH_COEFF",
    "INVERSE_COEFF",
    "LayerShape",
    "Placement",
    "assign_factors",
    "assign_layers",
    "bucket_lpt_assign",
    "compute_cost",
    "compute_cost_inverse",
    "decomposition_seconds",
    "factor_decomposition_cost",
    "grad_worker_grid",
    "grouped_assign",
    "kaisa_assign",
    "load_imbalance",
    "lpt_assign",
    "memory_cost",
    "rank_loads",
    "round_robin_assign",
]

#: Cost of a symmetric eigendecomposition with eigenvectors, per ``d**3``, in
#: multiply-add units (the unit of the factor construction term ``N*T*d**2``).
#: LAPACK's symmetric QR/divide-and-conquer with eigenvectors costs about
#: ``9 d**3`` flops (Golub & Van Loan, *Matrix Computations*, sec. 8.3),
#: while a matmul costs ``2`` flops per multiply-add, so ``9 / 2 = 4.5``.
#: This is a flop count; on GPUs eigh reaches a far smaller fraction of peak
#: than a matmul, so the measured ratio is larger still. The LPT assignment
#: depends only on ratios between items, and every item pays the same
#: coefficient, so the constant only shifts weight between the construction
#: term (which scales with the batch) and the decomposition term.
EIGH_COEFF: float = 4.5

#: Cost of a dense inverse per ``d**3`` in multiply-add units: LU with
#: inversion is about ``2 d**3`` flops, i.e. ``1.0`` multiply-add units.
INVERSE_COEFF: float = 1.0


@dataclass(frozen=True)
class LayerShape:
    """What the cost models need to know about one K-FAC layer.

    Attributes:
        name: Module name, as in ``model.named_modules()``.
        kind: ``"linear"`` or ``"conv2d"``.
        a_dim: Side of the A factor: ``d_in * kh * kw`` plus one for a bias.
        g_dim: Side of the G factor: ``d_out``.
        positions: Output positions per sample ``T`` (spatial positions of a
            Conv2d, sequence length of a Linear on sequences, 1 for a plain
            Linear). The A factor is built from ``N * T`` rows.
        batch_size: Local batch size ``N``.
        bucket: The backward gradient bucket whose reduction completes the layer's
            gradient (the one holding its last parameter in backward order), counted
            from the first launched; None where the run's buckets are not known. The
            overlapped mode sends a layer's update while later buckets are on the wire,
            so the owners' shares of each bucket share the link at the same time.
    """

    name: str
    kind: str
    a_dim: int
    g_dim: int
    positions: int = 1
    batch_size: int = 1
    bucket: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "conv2d"):
            raise ValueError(f"kind must be 'linear' or 'conv2d', got {self.kind!r}")
        for field in ("a_dim", "g_dim", "positions", "batch_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.bucket is not None and self.bucket < 0:
            raise ValueError(f"bucket must be >= 0 or None, got {self.bucket}")

    @classmethod
    def linear(
        cls,
        name: str,
        d_in: int,
        d_out: int,
        *,
        bias: bool = True,
        batch_size: int = 1,
        positions: int = 1,
    ) -> LayerShape:
        """Shape of an ``nn.Linear(d_in, d_out)``; ``positions`` is the product of extra dims."""
        return cls(name, "linear", d_in + int(bias), d_out, positions, batch_size)

    @classmethod
    def conv2d(
        cls,
        name: str,
        in_channels: int,
        out_channels: int,
        kernel_size: tuple[int, int],
        out_hw: tuple[int, int],
        *,
        bias: bool = False,
        groups: int = 1,
        batch_size: int = 1,
    ) -> LayerShape:
        """Shape of an ``nn.Conv2d`` producing an ``out_hw`` output map."""
        kh, kw = kernel_size
        a_dim = in_channels // groups * kh * kw + int(bias)
        return cls(name, "conv2d", a_dim, out_channels, out_hw[0] * out_hw[1], batch_size)


CostFn = Callable[[LayerShape], float]


@dataclass(frozen=True)
class Placement:
    """Who does what for every K-FAC layer, in module order.

    Each scheme computes it (``Scheme.placement``, called through ``Scheme.plan``) and
    the runtime writes it into its layers; the cost model calls the very same
    function, so training and prediction can never disagree on it.

    Attributes:
        owner: per layer, its owner: the rank that decomposes both its factors, where one
            rank does (under dp-kfac the owner also builds them and preconditions the
            layer; under kaisa its column of gradient workers preconditions it), or -1
            where no one rank does (its factors decomposed by two ranks, or by every rank).
            The one meaning of "owner" in the package.
        a_decomposer: per layer, the rank that decomposes A, or None when every
            rank decomposes it itself.
        g_decomposer: the same for G.
    """

    owner: tuple[int, ...]
    a_decomposer: tuple[int | None, ...]
    g_decomposer: tuple[int | None, ...]

    def decomposer(self, index: int, which: str) -> int | None:
        """The rank that decomposes factor ``which`` ("A"/"G") of layer ``index``."""
        return self.a_decomposer[index] if which == "A" else self.g_decomposer[index]

    @classmethod
    def per_layer(cls, owners: Sequence[int]) -> Placement:
        """One rank does everything for each layer (dp-kfac)."""
        owned = tuple(owners)
        return cls(owned, owned, owned)

    @classmethod
    def per_factor(cls, decomposers: Sequence[int | None]) -> Placement:
        """Decomposers of ``[A_0, G_0, A_1, G_1, ...]``; a layer's owner is the rank that
        decomposes both, where one does (-1 otherwise)."""
        a, g = tuple(decomposers[0::2]), tuple(decomposers[1::2])
        owner = tuple(x if x == y and x is not None else -1 for x, y in zip(a, g, strict=True))
        return cls(owner, a, g)


def decomposition_seconds(hardware: Hardware, dim: int) -> float:
    """Predicted seconds of one ``dim``-wide factor's eigendecomposition on ``hardware``:
    ``2 * EIGH_COEFF * dim**3`` flops at its ``eigh`` engine (the one estimate, used by
    SPD-KFAC's placement threshold and by the preconditioner's warning about wide factors)."""
    return hardware.engine("eigh").time(1, 2 * EIGH_COEFF * float(dim) ** 3)


def factor_decomposition_cost(dim: int, coeff: float = EIGH_COEFF) -> float:
    """Cost of decomposing one ``dim x dim`` factor: ``coeff * dim**3``.

    Used to place single factors (D-KFAC, SPD-KFAC), where the cubic
    decomposition is the work being distributed; factor construction is
    done by every rank there and does not enter the placement.
    """
    return coeff * float(dim) ** 3


def compute_cost(shape: LayerShape, decomposition_coeff: float = EIGH_COEFF) -> float:
    """Work an owner does for one layer per update, in multiply-adds.

    Factor construction ``aᵀa`` and ``gᵀg`` from ``N*T`` rows costs
    ``N*T*(a_dim**2 + g_dim**2)``; the decompositions cost
    ``decomposition_coeff * (a_dim**3 + g_dim**3)`` (see :data:`EIGH_COEFF`
    for why 4.5). Preconditioning (``2*g*a*(g+a)`` for the eigen method) is
    left out: it is at most of the order of the decomposition term for the
    same layer and it does not change which layers are heavy.
    """
    rows = shape.batch_size * shape.positions
    a, g = float(shape.a_dim), float(shape.g_dim)
    return rows * (a * a + g * g) + decomposition_coeff * (a**3 + g**3)


def compute_cost_inverse(shape: LayerShape) -> float:
    """:func:`compute_cost` with the cheaper dense-inverse decomposition."""
    return compute_cost(shape, decomposition_coeff=INVERSE_COEFF)


def memory_cost(shape: LayerShape) -> float:
    """Elements an owner stores for one layer: ``a_dim**2 + g_dim**2``.

    Factors and their decompositions (eigenvectors or inverses) are each
    ``d**2`` elements, so the true total is twice this plus ``d`` eigenvalues;
    LPT is invariant to a common scale, and the eigenvalues are negligible.
    """
    return float(shape.a_dim) ** 2 + float(shape.g_dim) ** 2


#: Registered layer cost functions, by name.
COSTS: dict[str, CostFn] = {
    "compute": compute_cost,
    "compute_inverse": compute_cost_inverse,
    "memory": memory_cost,
}


#: The layer assignments :func:`assign_layers` knows.
ASSIGNMENTS = ("lpt", "round_robin", "best")

#: How much busier than LPT's busiest rank (by cost) :func:`bucket_lpt_assign` may leave
#: a rank before :func:`assign_layers` prefers LPT's placement over the per-bucket one.
BUCKET_COST_TOLERANCE = 0.02


def _check_world_size(world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")


def lpt_assign(costs: Sequence[float], world_size: int) -> list[int]:
    """Greedy longest-processing-time assignment of items to ranks.

    Items are taken by cost, largest first (equal costs by index, so the
    order is the same on every rank), and each goes to the currently
    least-loaded rank (equal loads: the lowest rank). Graham's bound gives a
    busiest-rank load of at most ``(4/3 - 1/(3P))`` times the optimum.

    Args:
        costs: Non-negative finite cost of each item.
        world_size: Number of ranks ``P``.

    Returns:
        The rank of each item, in the original item order. With more ranks
        than items, the ranks past the number of items stay empty.
    """
    _check_world_size(world_size)
    for i, c in enumerate(costs):
        if not (math.isfinite(c) and c >= 0):
            raise ValueError(f"cost of item {i} must be finite and >= 0, got {c}")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    heap: list[tuple[float, int]] = [(0.0, r) for r in range(world_size)]
    result = [0] * len(costs)
    for i in order:
        load, rank = heapq.heappop(heap)
        result[i] = rank
        heapq.heappush(heap, (load + float(costs[i]), rank))
    return result


def bucket_lpt_assign(
    sizes: Sequence[float],
    buckets: Sequence[int],
    costs: Sequence[float],
    world_size: int,
) -> list[int]:
    """LPT within each bucket: items balanced by ``sizes`` bucket by bucket.

    Buckets are taken in order (``buckets[i]`` is item ``i``'s); within one, items go
    largest ``size`` first (equal sizes by index) to the rank holding the fewest of the
    bucket's bytes so far, equal ones to the rank with the least total ``cost``, then
    the lowest rank. Where each bucket's items travel together (the overlapped mode's
    reduction onto the owners and their update exchange, beside the bucket's other
    gradients), every bucket's shards are thus as equal as its items allow, and both
    directions of every link carry the same bytes at the same time; the total cost
    stays close to balanced through the tie-break (:func:`assign_layers` checks it).

    Args:
        sizes: Non-negative amount each item puts on the link (bytes, or elements of
            one dtype).
        buckets: Each item's bucket (any integers; ordered ascending).
        costs: Non-negative finite cost of each item (the tie-break).
        world_size: Number of ranks ``P``.

    Returns:
        The rank of each item, in the original item order.
    """
    _check_world_size(world_size)
    if not len(sizes) == len(buckets) == len(costs):
        raise ValueError(f"{len(sizes)} sizes, {len(buckets)} buckets and {len(costs)} costs")
    for name, values in (("size", sizes), ("cost", costs)):
        for i, v in enumerate(values):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} of item {i} must be finite and >= 0, got {v}")
    totals = [0.0] * world_size
    result = [0] * len(sizes)
    for b in sorted(set(buckets)):
        held = [0.0] * world_size
        for i in sorted(
            (i for i in range(len(sizes)) if buckets[i] == b), key=lambda i: (-sizes[i], i)
        ):
            rank = min(range(world_size), key=lambda r: (held[r], totals[r], r))
            result[i] = rank
            held[rank] += float(sizes[i])
            totals[rank] += float(costs[i])
    return result


def round_robin_assign(n: int, world_size: int) -> list[int]:
    """Item ``i`` goes to rank ``i % world_size`` (the published DP-KFAC scheme)."""
    _check_world_size(world_size)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [i % world_size for i in range(n)]


def _resolve_cost(cost: str | CostFn) -> CostFn:
    if callable(cost):
        return cost
    try:
        return COSTS[cost]
    except KeyError:
        raise ValueError(f"unknown cost {cost!r}; choose from {sorted(COSTS)}") from None


def assign_layers(
    shapes: Sequence[LayerShape],
    world_size: int,
    cost: str | CostFn = "compute",
    method: str = "lpt",
    *,
    by_bucket: bool = False,
) -> list[int]:
    """Owner rank of each layer, for DP-KFAC.

    Args:
        shapes: Layers in module registration order (the same on every rank).
        world_size: Number of ranks.
        cost: A name in :data:`COSTS` or a callable ``LayerShape -> float``.
        method: ``"lpt"`` (balanced by ``cost``), ``"round_robin"`` (module
            order, ignores ``cost``; the reference code's choice) or
            ``"best"``: whichever of the two has the lower busiest-rank cost
            (LPT on ties). LPT is not optimal and, on regular networks where
            round robin happens to split evenly, can be a hair worse; "best"
            is never worse than the published scheme.
        by_bucket: balance every backward bucket's update bytes too (the overlapped
            mode, where a bucket's shares travel at the same time): LPT's candidate is
            then :func:`bucket_lpt_assign` by each layer's ``g_dim * a_dim`` in its
            :attr:`LayerShape.bucket`, kept while its busiest rank's cost is within
            :data:`BUCKET_COST_TOLERANCE` of LPT's. Ignored where a layer's bucket is
            not known, and where a bucket holds fewer layers than there are ranks: some
            rank then owns none of it whatever the placement, and spreading its few
            layers would only trade LPT's balance for none on the link (at P=64 on
            BERT-large, 4% more K-FAC compute and 12% more factor memory on the busiest
            rank, by the cost model).

    Returns:
        The owner rank of each layer, in the order of ``shapes``.
    """
    if method == "round_robin":
        return round_robin_assign(len(shapes), world_size)
    if method not in ASSIGNMENTS:
        raise ValueError(f"unknown assignment {method!r}; expected one of {list(ASSIGNMENTS)}")
    fn = _resolve_cost(cost)
    costs = [fn(s) for s in shapes]
    lpt = lpt_assign(costs, world_size)
    buckets = [s.bucket for s in shapes if s.bucket is not None]
    # Every layer's bucket known, and a layer for every rank in each bucket.
    known = bool(shapes) and len(buckets) == len(shapes)
    if by_bucket and known and min(Counter(buckets).values()) >= world_size:
        sizes = [float(s.g_dim * s.a_dim) for s in shapes]
        per_bucket = bucket_lpt_assign(sizes, buckets, costs, world_size)
        busiest = max(rank_loads(lpt, costs, world_size))
        if max(rank_loads(per_bucket, costs, world_size)) <= (1 + BUCKET_COST_TOLERANCE) * busiest:
            lpt = per_bucket
    if method == "best":
        rr = round_robin_assign(len(shapes), world_size)
        if max(rank_loads(rr, costs, world_size)) < max(rank_loads(lpt, costs, world_size)):
            return rr
    return lpt


def assign_factors(
    dims: Sequence[int],
    world_size: int,
    local_threshold: int | None = None,
    *,
    local: Sequence[bool] | None = None,
    costs: Sequence[float] | None = None,
) -> list[int | None]:
    """Rank that decomposes each factor, for D-KFAC and SPD-KFAC.

    Each factor is its own item (callers usually pass
    ``[a_0, g_0, a_1, g_1, ...]``), so A and G of one layer may land on
    different ranks. Placement is LPT on ``costs`` (default:
    :func:`factor_decomposition_cost`).

    Args:
        dims: Side of each factor.
        world_size: Number of ranks.
        local_threshold: If given, factors with ``dim < local_threshold`` get
            ``None``: every rank decomposes them itself, which costs less than
            broadcasting the result (SPD-KFAC; its reference uses about 1024).
            They take no part in the balancing of the others.
        local: Per factor, whether every rank decomposes it (instead of the
            threshold rule).
        costs: Per factor, the cost LPT balances.

    Returns:
        The decomposing rank of each factor, or ``None`` for local factors.
    """
    _check_world_size(world_size)
    if local is None:
        local = [local_threshold is not None and d < local_threshold for d in dims]
    if costs is None:
        costs = [factor_decomposition_cost(d) for d in dims]
    if not len(local) == len(costs) == len(dims):
        raise ValueError(f"{len(dims)} dims, {len(local)} local flags, {len(costs)} costs")
    placed = [i for i in range(len(dims)) if not local[i]]
    ranks = lpt_assign([costs[i] for i in placed], world_size)
    result: list[int | None] = [None] * len(dims)
    for i, r in zip(placed, ranks, strict=True):
        result[i] = r
    return result


def rank_loads(
    assignment: Sequence[int | None],
    costs: Sequence[float],
    world_size: int,
) -> list[float]:
    """Total cost on each rank.

    Args:
        assignment: Rank of each item, or ``None`` for an item every rank
            does itself (a locally decomposed factor), which adds its cost
            to every rank.
        costs: Cost of each item.
        world_size: Number of ranks.

    Returns:
        The load of ranks ``0 .. world_size - 1``.
    """
    _check_world_size(world_size)
    if len(assignment) != len(costs):
        raise ValueError(f"{len(assignment)} assignments for {len(costs)} costs")
    loads = [0.0] * world_size
    for rank, c in zip(assignment, costs, strict=True):
        if rank is None:
            loads = [load + c for load in loads]
        elif 0 <= rank < world_size:
            loads[rank] += c
        else:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
    return loads


def load_imbalance(loads: Sequence[float]) -> float:
    """Busiest rank over the mean load: 1.0 is perfect balance.

    The step waits for the busiest rank, so ``max / mean`` is the slowdown
    against a perfect split of the same total work. All-zero loads give 1.0.
    """
    if not loads:
        raise ValueError("no loads")
    mean = sum(loads) / len(loads)
    return 1.0 if mean == 0 else max(loads) / mean


def grad_worker_grid(world_size: int, grad_workers: int) -> tuple[list[list[int]], list[list[int]]]:
    """KAISA's grid of ranks: gradient-worker groups (columns) and receiver groups (rows).

    The ranks fill a ``grad_workers x (P / grad_workers)`` grid row by row.
    A layer's gradient workers are one column; each row holds exactly one
    worker of every column, which sends that layer's preconditioned gradient
    to the rest of its row.

    Example: P = 8, 2 gradient workers: columns ``[0, 4], [1, 5], [2, 6],
    [3, 7]``; rows ``[0, 1, 2, 3], [4, 5, 6, 7]``.

    Returns:
        (columns, rows).
    """
    _check_world_size(world_size)
    if grad_workers < 1 or world_size % grad_workers:
        raise ValueError(
            f"the gradient worker count {grad_workers} must divide the world size {world_size}"
        )
    n = world_size // grad_workers
    columns = [list(range(c, world_size, n)) for c in range(n)]
    rows = [list(range(r * n, (r + 1) * n)) for r in range(grad_workers)]
    return columns, rows


def kaisa_assign(costs: Sequence[float], world_size: int, grad_workers: int) -> list[int]:
    """KAISA's greedy placement: each layer's two factors on one rank, within a column.

    Layers are taken by cost, largest first; each goes to the column (see
    :func:`grad_worker_grid`) with the lowest total load and, inside it, to
    the least-loaded rank (ties: the lowest index). That rank decomposes both
    factors; its column are the layer's gradient workers. It is
    :func:`grouped_assign` with one factor group of every rank.

    Returns:
        The decomposing rank of each layer.
    """
    return grouped_assign(
        costs, [0] * len(costs), [list(range(world_size))], world_size, grad_workers
    )


def grouped_assign(
    costs: Sequence[float],
    group_of: Sequence[int],
    groups: Sequence[Sequence[int]],
    world_size: int,
    grad_workers: int,
) -> list[int]:
    """Owners within factor groups: KAISA's greedy rule restricted to each layer's group.

    Layers are taken by cost, largest first; each goes to the gradient-worker
    column (see :func:`grad_worker_grid`) with the lowest total load among the
    columns meeting its factor group, and inside it to the least-loaded rank
    of the group (ties: the lowest index). With one group of every rank this
    is :func:`kaisa_assign`.

    Args:
        costs: per layer, the owner's cost (decomposing both factors).
        group_of: per layer, the index of its factor group in ``groups``.
        groups: the factor groups (lists of ranks).
        world_size: number of ranks.
        grad_workers: W, the gradient workers per layer.

    Returns:
        The owner rank of each layer.
    """
    columns, _ = grad_worker_grid(world_size, grad_workers)
    for i, c in enumerate(costs):
        if not (math.isfinite(c) and c >= 0):
            raise ValueError(f"cost of item {i} must be finite and >= 0, got {c}")
    if len(costs) != len(group_of):
        raise ValueError(f"{len(costs)} costs for {len(group_of)} group indices")
    loads = [0.0] * world_size
    result = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        members = set(groups[group_of[i]])
        open_columns = [c for c in range(len(columns)) if members.intersection(columns[c])]
        column = min(open_columns, key=lambda c: (sum(loads[r] for r in columns[c]), c))
        rank = min((r for r in columns[column] if r in members), key=lambda r: (loads[r], r))
        loads[rank] += float(costs[i])
        result[i] = rank
    return result
