"""D-KFAC: the data-parallel K-FAC baseline (MPD-KFAC in the papers).

Every rank builds every layer's factors on its local batch; the batch factors
are averaged by fused all-reduces; each factor's decomposition is placed on
one rank by LPT load balancing (A and G of one layer may land on different
ranks), computed there and broadcast in one fused bucket per source rank;
every rank then preconditions every layer locally.

Three switches make the ablations of the baseline (:class:`DKFACOptions`):
packing the symmetric factors into triangles, the published per-layer round
robin placement, and lazy synchronisation. The last one rests on linearity:
the running average is linear in the batch factors, so averaging the ranks'
local running averages on decomposition steps gives exactly the average of
the eagerly averaged ones, at 1/(I/F) of the factor traffic when factors are
updated every F steps and decomposed every I.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dpkfac.assignment import (
    LayerShape,
    Placement,
    assign_factors,
    round_robin_assign,
)
from dpkfac.curvature import KFACLayer
from dpkfac.curvature.layer import FACTORS
from dpkfac.options import StrategyOptions, check_choice
from dpkfac.strategies.base import Strategy, Traits

#: Decomposition placements: per factor by LPT, or per layer in module order.
PLACEMENTS = ("lpt", "layer_round_robin")


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
        for name in ("triangle", "lazy_factor_sync"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")


class DKFAC(Strategy):
    """All-reduced factors, placed decompositions, local preconditioning everywhere."""

    name = "d_kfac"
    Options: type[StrategyOptions] = DKFACOptions

    @classmethod
    def traits(cls, options: DKFACOptions) -> Traits:  # type: ignore[override]
        return Traits(
            captures_all=True,
            factor_comm="allreduce",
            triangle=options.triangle,
            decomposition_broadcast=True,
            preconditions_all=True,
            lazy_factor_sync=options.lazy_factor_sync,
        )

    @classmethod
    def local_threshold(cls, options: StrategyOptions) -> int | None:
        """Factors below this dimension are decomposed on every rank (None: none are)."""
        return None

    @classmethod
    def placement_rule(cls, options: StrategyOptions) -> str:
        """How decompositions are placed (one of :data:`PLACEMENTS`)."""
        return options.placement  # type: ignore[attr-defined]

    @classmethod
    def placement(
        cls, shapes: Sequence[LayerShape], world_size: int, options: StrategyOptions
    ) -> Placement:
        if cls.placement_rule(options) == "layer_round_robin":
            return Placement.per_layer(round_robin_assign(len(shapes), world_size))
        dims = [d for s in shapes for d in (s.a_dim, s.g_dim)]
        threshold = cls.local_threshold(options)
        return Placement.per_factor(assign_factors(dims, world_size, local_threshold=threshold))

    def captures(self, layer: KFACLayer) -> bool:
        return True

    def preconditions(self, layer: KFACLayer) -> bool:
        return True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Lazy sync: whether the running factors changed since they were last averaged.
        self.unsynced = False
        #: Where factors are averaged (grouped averages within factor groups).
        self.factor_comm = self.comm

    def reduce_factors(self, layers: Sequence[KFACLayer]) -> None:
        if self.options.lazy_factor_sync:
            # Folded into local running averages; averaged before the next decomposition.
            self.unsynced = self.unsynced or any(
                layer.has_pending(w) for layer in layers for w in FACTORS
            )
            return
        items = [(layer, w) for layer in layers for w in FACTORS if layer.has_pending(w)]
        tensors = [layer.pending(w) for layer, w in items]
        self.factor_comm.allreduce_mean(
            tensors,
            "factor_allreduce",
            triangle=self.options.triangle,
            cap_bytes=self.bucket_cap_bytes,
        )
        for (layer, which), tensor in zip(items, tensors, strict=True):
            layer.set_pending(which, tensor)

    def sync_factors(self, layers: Sequence[KFACLayer]) -> None:
        """Lazy sync: average the running factors across ranks, in place, before decomposing."""
        if not self.options.lazy_factor_sync or not self.unsynced:
            return
        self.unsynced = False
        tensors = [layer.factor(w) for layer in layers for w in FACTORS]
        self.factor_comm.allreduce_mean(
            [t for t in tensors if t is not None],
            "factor_allreduce",
            triangle=self.options.triangle,
            cap_bytes=self.bucket_cap_bytes,
        )

    def share_decompositions(
        self, layers: Sequence[KFACLayer], updated: set[tuple[str, str]]
    ) -> None:
        self.broadcast_decompositions(self.comm, range(self.world_size), layers, updated)
