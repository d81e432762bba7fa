"""The exchanges of a step that depend on who preconditions what, as data.

The exchanges of a step follow from the plan's traits and roles: the gradients' reduction
(onto every rank, or under the owner reduction onto each layer's owner); where factors are
averaged, their all-reduces; where decompositions are placed, their broadcast from each
decomposer; and, where a layer's preconditioners are not every rank, the exchange of its
preconditioned update. What each is
(which collectives, from which senders, carrying which tensors, in which order) is decided
here, once, from whether the plan reduces gradients onto owners. The runtime launches the
lists these functions return, from ``step()`` and from the overlapped engine, bucket by
bucket (:func:`dpkfac.strategies.base.launch_gradients`,
:func:`~dpkfac.strategies.base.launch_updates`), and the cost model prices the same lists
(:mod:`dpkfac.costmodel.traffic`), so the bytes a run reports and the bytes the model
predicts come from one description, not from two copies kept in step by hand.

The items are whatever the caller names tensors by: the runtime's gradients and layers, the
cost model's (layer index, elements) pairs and layer indices. A step asks the same questions
every time, so the runtime asks them of positions, once per layout (:func:`gradient_layout`,
:func:`update_layout`, cached), and puts its tensors in those positions
(:func:`dpkfac.strategies.base.on_items`): the lists are made once, not on every step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

__all__ = [
    "Transfer",
    "decomposition_transfers",
    "factor_transfers",
    "gradient_layout",
    "gradient_transfers",
    "update_layout",
    "update_nbytes",
    "update_shapes",
    "update_transfers",
    "waited_by_layers",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Transfer(Generic[T]):
    """One collective of an exchange.

    Attributes:
        kind: ``"allreduce"``: ``shards[0]`` averaged on every rank;
            ``"reduce_scatter"``: each position's shard (``shards[i]``) averaged onto
            group position i; ``"all_gather"``: every position's shard reaches every
            position; ``"broadcast"``: ``shards[0]`` goes from group position ``root`` to
            the others.
        shards: the items each buffer carries, in the order they are packed.
        root: the sender of a broadcast (-1 otherwise).
    """

    kind: Literal["allreduce", "reduce_scatter", "all_gather", "broadcast"]
    shards: tuple[tuple[T, ...], ...]
    root: int = -1


def gradient_transfers(
    owner_reduction: bool,
    items: Sequence[T],
    owner: Callable[[T], int | None],
    world_size: int,
    *,
    kfac_first: bool = False,
) -> list[Transfer[T]]:
    """The reduction of the gradients ``items`` (in the order they are packed), in launch
    order.

    Every gradient is all-reduced, in one list, unless the plan reduces K-FAC gradients onto
    their owners (``owner_reduction``, the plan's ``traits.owner_grad_reduction``): then each
    owner's (``owner(item)``, None for a parameter of no K-FAC layer) go by one
    reduce-scatter of the owners' shards, in ``items`` order within each, and the rest by
    one all-reduce after it, which no layer needs before ``step()`` ends. ``kfac_first``
    (the overlapped engine's buckets) splits the all-reduce alike: the K-FAC layers'
    gradients by one all-reduce, then the rest by another, so that a layer never waits for a
    large gradient of no K-FAC layer that shares its bucket (BERT's word embedding, the
    backward pass's last bucket): its preconditioning runs while that is on the wire.
    Empty lists send nothing.
    """
    if not owner_reduction and not kfac_first:
        return [Transfer("allreduce", (tuple(items),))] if items else []
    shards: list[list[T]] = [[] for _ in range(world_size)]
    rest: list[T] = []
    for item in items:
        r = owner(item)
        (rest if r is None else shards[r]).append(item)
    out: list[Transfer[T]] = []
    if not owner_reduction:
        kfac = [item for item in items if owner(item) is not None]
        if kfac:
            out.append(Transfer("allreduce", (tuple(kfac),)))
    elif any(shards):
        out.append(Transfer("reduce_scatter", tuple(tuple(s) for s in shards)))
    if rest:
        out.append(Transfer("allreduce", (tuple(rest),)))
    return out


@functools.lru_cache(maxsize=256)
def gradient_layout(
    owner_reduction: bool,
    owners: tuple[int | None, ...],
    world_size: int,
    *,
    kfac_first: bool = False,
) -> tuple[Transfer[int], ...]:
    """:func:`gradient_transfers` of the gradients at positions ``0..len(owners)-1``, whose
    owners are ``owners`` (None: no K-FAC layer's), made once per layout."""
    items = range(len(owners))
    return tuple(
        gradient_transfers(
            owner_reduction, items, owners.__getitem__, world_size, kfac_first=kfac_first
        )
    )


def waited_by_layers(transfer: Transfer[T], owner: Callable[[T], int | None]) -> bool:
    """Whether a K-FAC layer waits for this transfer of :func:`gradient_transfers`: it
    carries a K-FAC layer's gradient (False: the rest, which only ``step()``'s end needs)."""
    return any(owner(item) is not None for shard in transfer.shards for item in shard)


#: What travels with an update where the KL clip is on: ⟨V, ∇W⟩ and whether it is
#: preconditioned, in at least float32 (:data:`KL_MIN_ITEMSIZE` bytes each).
KL_SCALARS = 2
KL_MIN_ITEMSIZE = 4


@functools.lru_cache(maxsize=1024)
def update_shapes(g_dim: int, a_dim: int, *, with_kl: bool) -> tuple[tuple[int, ...], ...]:
    """The tensors one layer's update travels as, in the order they are packed: its
    ``g_dim x a_dim`` matrix and, with the KL clip on, right after it its :data:`KL_SCALARS`
    scalars (in the matrix's dtype promoted to at least float32). The runtime sends and
    receives into these (:func:`dpkfac.strategies.base.update_buffers`) and the cost model
    counts their bytes (:func:`update_nbytes`)."""
    return ((g_dim, a_dim), (KL_SCALARS,)) if with_kl else ((g_dim, a_dim),)


def update_nbytes(g_dim: int, a_dim: int, *, with_kl: bool, itemsize: int) -> list[int]:
    """Bytes of each tensor of :func:`update_shapes` for a matrix of ``itemsize`` bytes."""
    shapes = update_shapes(g_dim, a_dim, with_kl=with_kl)
    sizes = [itemsize, *[max(itemsize, KL_MIN_ITEMSIZE)] * (len(shapes) - 1)]
    return [math.prod(shape) * size for shape, size in zip(shapes, sizes, strict=True)]


def update_transfers(owner_reduction: bool, sent_by: Sequence[Sequence[T]]) -> list[Transfer[T]]:
    """The exchange of the updates of ``sent_by[i]``'s layers (group position i), in launch
    order.

    Under the owner reduction (``owner_reduction``, the plan's ``traits.owner_grad_reduction``)
    the owners' shards go by one
    all-gather, the mirror of the reduce-scatter that brought them their gradients, so the
    step moves what one all-reduce would (:meth:`dpkfac.comm.Communicator.all_gather`; on
    gloo an alltoallv, :func:`dpkfac.plan.hardware.sharded_by_alltoall`). Otherwise each
    sender, in group order,
    broadcasts its layers' updates in one fused buffer. A sender with nothing to send sends
    nothing; an exchange with nothing to send is empty.
    """
    if not any(sent_by):
        return []
    if owner_reduction:
        return [Transfer("all_gather", tuple(tuple(s) for s in sent_by))]
    return _broadcasts(sent_by)


@functools.lru_cache(maxsize=256)
def update_layout(
    owner_reduction: bool, counts: tuple[int, ...]
) -> tuple[Transfer[tuple[int, int]], ...]:
    """:func:`update_transfers` where group position r sends ``counts[r]`` updates, made once
    per layout: its items are (r, j), the j-th update position r sends."""
    sent_by = [[(r, j) for j in range(n)] for r, n in enumerate(counts)]
    return tuple(update_transfers(owner_reduction, sent_by))


def factor_transfers(
    factor_comm: str, factors: Sequence[T], buckets: Sequence[Sequence[T]] | None = None
) -> list[Transfer[T]]:
    """The averaging of the batch (or, lazily, running) ``factors`` over the factor group, as
    the plan's ``traits.factor_comm`` says, in launch order: "none", nothing; "allreduce", one
    all-reduce of them all in the order given (fused into capped buffers by the
    communicator), from ``step()``; "pipelined", one all-reduce per fusion bucket of
    ``buckets`` (None, while the buckets are profiled: each factor alone), launched from the
    capture hooks as each fills (:class:`dpkfac.strategies.spd_kfac.SPDKFAC` launches these
    transfers, counting what each still waits for; the cost model prices the same list)."""
    if factor_comm == "none" or not factors:
        return []
    if factor_comm == "allreduce":
        return [Transfer("allreduce", (tuple(factors),))]
    runs = [[f] for f in factors] if buckets is None else buckets
    return [Transfer("allreduce", (tuple(run),)) for run in runs if run]


def decomposition_transfers(sent_by: Sequence[Sequence[T]]) -> list[Transfer[T]]:
    """The broadcast of the decompositions ``sent_by[i]`` computed (group position i; the
    runtime's items are (layer, factor) pairs, the cost model's their tensors' sizes), in
    launch order: each decomposer, in group order, broadcasts its own in one fused buffer."""
    return _broadcasts(sent_by)


def _broadcasts(sent_by: Sequence[Sequence[T]]) -> list[Transfer[T]]:
    """Per sender with something to send, in group order, one broadcast of it."""
    return [Transfer("broadcast", (tuple(s),), root=i) for i, s in enumerate(sent_by) if s]
