"""d_kfac's plan: every rank captures and preconditions; decompositions are placed.

Every rank builds every layer's factors on its local batch, the factors are
averaged by fused all-reduces, each factor's decomposition is placed on one
rank by LPT (A and G of one layer may land on different ranks) and broadcast.
The switches of the ablation: triangle packing, the published per-layer
round robin placement, and lazy synchronisation (the running averages are
linear in the batch factors, so averaging the ranks' local running averages
on decomposition steps gives the same decompositions at a fraction of the
factor traffic).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from dpkfac.plan.assignment import LayerShape, Placement, assign_factors, round_robin_assign
from dpkfac.plan.options import StrategyOptions, check_choice
from dpkfac.plan.scheme import Scheme
from dpkfac.plan.traits import Traits

__all__ = ["PLACEMENTS", "DKFACOptions", "DKFACScheme", "check_bools"]

#: Decomposition placements: per factor by LPT, or per layer in module order.
PLACEMENTS = ("lpt", "layer_round_robin")


def check_bools(options: object, *names: str) -> None:
    """Raise ValueError unless each named option is a bool."""
    for name in names:
        if not isinstance(getattr(options, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(options, name)!r}")


@dataclass(frozen=True)
class DKFACOptions(StrategyOptions):
    """Options of d_kfac.

    Attributes:
        triangle: send only the upper triangle of each symmetric factor.
        placement: "lpt" (each factor's decomposition on the least-loaded
            rank, largest first) or "layer_round_robin" (A and G of layer i
            on rank i mod P, as the DP-KFAC authors' D-KFAC does).
        lazy_factor_sync: keep local running averages and all-reduce them
            only on decomposition steps (when they changed since the last
            sync), instead of all-reducing every batch factor; the default,
            since it gives the same decompositions. False is the published,
            eager scheme.
    """

    triangle: bool = False
    placement: str = "lpt"
    lazy_factor_sync: bool = True

    def __post_init__(self) -> None:
        check_choice("placement", self.placement, PLACEMENTS)
        check_bools(self, "triangle", "lazy_factor_sync")


class DKFACScheme(Scheme):
    """All-reduced factors, placed decompositions, local preconditioning everywhere."""

    name = "d_kfac"
    # The base's type: subclasses (kaisa, grouped) take options that need not be d_kfac's.
    Options: ClassVar[type[StrategyOptions]] = DKFACOptions

    @classmethod
    def traits(cls, options: StrategyOptions) -> Traits:
        assert isinstance(options, DKFACOptions)
        return Traits(
            captures_all=True,
            factor_comm="allreduce",
            triangle=options.triangle,
            decomposition_broadcast=True,
            preconditions_all=True,
            lazy_factor_sync=options.lazy_factor_sync,
        )

    @classmethod
    def placement(
        cls, shapes: Sequence[LayerShape], world_size: int, options: StrategyOptions
    ) -> Placement:
        assert isinstance(options, DKFACOptions)
        if options.placement == "layer_round_robin":
            return Placement.per_layer(round_robin_assign(len(shapes), world_size))
        dims = [d for s in shapes for d in (s.a_dim, s.g_dim)]
        return Placement.per_factor(assign_factors(dims, world_size))
