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

__all__ = ["Group", "Plan", "RankRoles", "group_of"]

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
        for name in ("owner", "a_decomposer", "g_decomposer"):
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
        """The layer's owner (:class:`~dpkfac.plan.assignment.Placement`: the rank that
        decomposes both its factors, or -1: no one rank)."""
        return self.placement.owner[self.index(layer)]

    def factor_group(self, rank: int) -> Group:
        """The factor group of ``rank``."""
        return self._factor_group.get(rank, (rank,))

    def captures(self, rank: int, layer: int | str) -> bool:
        """Whether ``rank`` builds the layer's factors from its local batch.

        In a factor group of every rank, all capture whatever the owner (a
        layer whose factors no one rank decomposes has none, -1).
        """
        group = self.factor_group(rank)
        return len(group) == self.world_size or self.owner(layer) in group

    def decomposer(self, layer: int | str, which: str) -> int | None:
        """The rank that decomposes factor ``which`` ("A"/"G"), or None: every rank does."""
        return self.placement.decomposer(self.index(layer), which)

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

    def roles_of(self, rank: int) -> RankRoles:
        """Everything ``rank`` asks of this plan during a step, read once (at placement)."""
        return RankRoles(
            rank=rank,
            traits=self.traits,
            captures=frozenset(n for n in self.names if self.captures(rank, n)),
            decomposes=frozenset(
                (n, w) for n in self.names for w in ("A", "G") if self.decomposes(rank, n, w)
            ),
            decomposers={(n, w): self.decomposer(n, w) for n in self.names for w in ("A", "G")},
            preconditions=frozenset(n for n in self.names if self.preconditions(rank, n)),
            senders=dict(zip(self.names, self.preconditioners, strict=True)),
            decomposition_group=self.decomposition_group(rank),
            update_group=self.update_group(rank),
        )


@dataclass(frozen=True)
class RankRoles:
    """One rank's view of a :class:`Plan`, read from it once per placement
    (:meth:`Plan.roles_of`): what a step asks (does this rank capture, decompose,
    precondition this layer; who sends its update; which groups it exchanges in) is a set
    or dict lookup here, not a question to the plan on every step. Layers by name.

    Attributes:
        rank: the rank.
        traits: the plan's traits.
        captures: the layers whose factors the rank builds from its local batch.
        decomposes: the (layer, factor) pairs whose decomposition the rank computes.
        decomposers: per (layer, factor), the rank that decomposes it (None: every rank).
        preconditions: the layers the rank preconditions.
        senders: per layer, the ranks that send its update (its preconditioners).
        decomposition_group: the group it exchanges decompositions in (None: none).
        update_group: the group it exchanges updates in (None: none).
    """

    rank: int
    traits: Traits
    captures: frozenset[str]
    decomposes: frozenset[tuple[str, str]]
    decomposers: dict[tuple[str, str], int | None]
    preconditions: frozenset[str]
    senders: dict[str, Group]
    decomposition_group: Group | None
    update_group: Group | None
