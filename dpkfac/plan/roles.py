"""The plan of a run: who captures, decomposes, preconditions and sends what.

A :class:`Plan` is pure data, computed by a scheme (:meth:`Scheme.plan
<dpkfac.plan.scheme.Scheme.plan>`) from the layer shapes, the world size and
the scheme's options. Every rank computes the same plan. The runtime asks it
``plan.captures(rank, layer)``-style questions and the cost model prices the
very same answers, so training and prediction cannot disagree on a role.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dpkfac.plan.assignment import Placement
from dpkfac.plan.traits import Traits

__all__ = ["Group", "Plan", "group_of"]

Group = tuple[int, ...]


def group_of(groups: Sequence[Sequence[int]], rank: int) -> Group | None:
    """The group holding ``rank``, when it is in one of more than one rank (else None)."""
    group = next((tuple(g) for g in groups if rank in g), None)
    return group if group is not None and len(group) > 1 else None


@dataclass(frozen=True)
class Plan:
    """Who does what for every K-FAC layer, in module order.

    Layers are named by their index in module order or by their module name.

    Attributes:
        scheme: the registered name of the scheme that made the plan.
        world_size: number of ranks.
        names: the layers' module names, in module order.
        placement: owners and decomposers per layer.
        traits: what the scheme does at each point of an iteration.
        preconditioners: per layer, the ranks that precondition it and hold
            its decompositions (its gradient workers).
        factor_groups: groups of ranks within which a layer's batch factors are
            built (by the group of its owner, every member on its local batch)
            and averaged. Every rank is in exactly one.
        decomposition_groups: groups within which decompositions are broadcast
            from their decomposers (each rank in at most one).
        update_groups: groups within which preconditioned updates are
            broadcast, each layer's by the one member among its preconditioners.
        setup: the scheme's own one-time collectives, as (kind, bytes), in order.
        uses_batch: whether the placement reads the layers' batch statistics,
            which the ranks must then agree on first.
    """

    scheme: str
    world_size: int
    names: tuple[str, ...]
    placement: Placement
    traits: Traits
    preconditioners: tuple[Group, ...]
    factor_groups: tuple[Group, ...]
    decomposition_groups: tuple[Group, ...]
    update_groups: tuple[Group, ...]
    setup: tuple[tuple[str, int], ...] = ()
    uses_batch: bool = False
    _index: dict[str, int] = field(init=False, repr=False, compare=False)
    _factor_group: dict[int, Group] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.names)
        for name in ("owner", "a_owner", "g_owner"):
            if len(getattr(self.placement, name)) != n:
                raise ValueError(f"placement.{name} has not one entry per layer ({n})")
        if len(self.preconditioners) != n:
            raise ValueError(f"{len(self.preconditioners)} preconditioner sets for {n} layers")
        object.__setattr__(self, "_index", {name: i for i, name in enumerate(self.names)})
        # Asked from the capture hooks (captures): looked up, not searched, per call.
        groups = {r: tuple(g) for g in self.factor_groups for r in g}
        object.__setattr__(self, "_factor_group", groups)

    def __len__(self) -> int:
        return len(self.names)

    def index(self, layer: int | str) -> int:
        """The module-order index of a layer given by index or name."""
        return layer if isinstance(layer, int) else self._index[layer]

    # ------------------------------------------------------------------ roles
    def owner(self, layer: int | str) -> int:
        """The layer's owner (the rank that decomposes its A factor, or -1: every rank)."""
        return self.placement.owner[self.index(layer)]

    def factor_group(self, rank: int) -> Group:
        """The factor group of ``rank``."""
        return self._factor_group.get(rank, (rank,))

    def captures(self, rank: int, layer: int | str) -> bool:
        """Whether ``rank`` builds the layer's factors from its local batch.

        In a factor group of every rank, all capture whatever the owner (a
        layer decomposed everywhere has no owner, -1).
        """
        group = self.factor_group(rank)
        return len(group) == self.world_size or self.owner(layer) in group

    def decomposer(self, layer: int | str, which: str) -> int | None:
        """The rank that decomposes factor ``which`` ("A"/"G"), or None: every rank does."""
        return self.placement.factor_owner(self.index(layer), which)

    def decomposes(self, rank: int, layer: int | str, which: str) -> bool:
        """Whether ``rank`` computes the decomposition of factor ``which`` of the layer."""
        owner = self.decomposer(layer, which)
        return owner is None or owner == rank

    def preconditions(self, rank: int, layer: int | str) -> bool:
        """Whether ``rank`` preconditions the layer (and holds its decompositions)."""
        return rank in self.preconditioners[self.index(layer)]

    # ---------------------------------------------------------------- senders
    def decomposition_group(self, rank: int) -> Group | None:
        """The group ``rank`` exchanges decompositions in (None: it takes part in none)."""
        return group_of(self.decomposition_groups, rank)

    def update_group(self, rank: int) -> Group | None:
        """The group ``rank`` exchanges preconditioned updates in (None: it takes part in none)."""
        return group_of(self.update_groups, rank)

    def update_senders(self, layer: int | str) -> Group:
        """The ranks that send the layer's update, each to its update group: its preconditioners."""
        return self.preconditioners[self.index(layer)]

    def sends_update(self, src: int, layer: int | str) -> bool:
        """Whether ``src`` broadcasts the layer's update to its update group."""
        return src in self.update_senders(layer)

    def sends_decomposition(self, src: int, layer: int | str, which: str) -> bool:
        """Whether ``src`` broadcasts the decomposition of the factor to its decomposition group."""
        return self.decomposer(layer, which) == src
