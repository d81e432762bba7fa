"""dp_kfac's plan: one owner per layer captures, decomposes and preconditions it.

The owner builds the layer's factors on its own local batch (no factor is
ever communicated), decomposes them, preconditions the averaged gradient and
broadcasts the update to every rank. Placement: layers to owners by
:func:`~dpkfac.plan.assignment.assign_layers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dpkfac.plan.assignment import ASSIGNMENTS, COSTS, CostFn, LayerShape, Placement, assign_layers
from dpkfac.plan.options import StrategyOptions, check_choice
from dpkfac.plan.scheme import Scheme
from dpkfac.plan.traits import Traits

__all__ = ["GRAD_REDUCTIONS", "DPKFACOptions", "DPKFACScheme"]

GRAD_REDUCTIONS = ("allreduce", "owner")


@dataclass(frozen=True)
class DPKFACOptions(StrategyOptions):
    """Options of dp_kfac.

    Attributes:
        grad_reduction: "allreduce" (the published scheme) or "owner" (K-FAC
            layers' gradients reduced onto their owners).
        assignment: "lpt" (load balanced by ``assignment_cost``),
            "round_robin" (module order, as the released DP-KFAC code) or
            "best" (whichever of the two has the lower busiest-rank cost).
        assignment_cost: a name in :data:`dpkfac.plan.assignment.COSTS` or a
            callable ``LayerShape -> float``.
        overlap: reduce gradients in fused buckets in backward order from
            gradient hooks, and let each owner precondition and broadcast a
            layer as soon as its averaged gradient is there, during the
            backward pass (:mod:`dpkfac.overlap`). Needs
            ``grad_reduction="allreduce"``, a model not wrapped in DDP and no
            ``grad_scaler``.
    """

    grad_reduction: str = "allreduce"
    assignment: str = "lpt"
    assignment_cost: str | CostFn = "compute"
    overlap: bool = False

    def __post_init__(self) -> None:
        check_choice("grad_reduction", self.grad_reduction, GRAD_REDUCTIONS)
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be a bool, got {self.overlap!r}")
        if self.overlap and self.grad_reduction != "allreduce":
            raise ValueError(
                f"overlap=True does not support grad_reduction={self.grad_reduction!r}; "
                "use grad_reduction='allreduce'"
            )
        check_choice("assignment", self.assignment, ASSIGNMENTS)
        if not callable(self.assignment_cost):
            check_choice("assignment_cost", self.assignment_cost, tuple(COSTS))


class DPKFACScheme(Scheme):
    """Owner-only factors and preconditioning, broadcast of preconditioned gradients."""

    name = "dp_kfac"
    Options = DPKFACOptions

    @classmethod
    def traits(cls, options: StrategyOptions) -> Traits:
        assert isinstance(options, DPKFACOptions)
        return Traits(
            captures_all=False,
            factor_comm="none",
            triangle=False,
            decomposition_broadcast=False,
            preconditions_all=False,
            owner_grad_reduction=options.grad_reduction == "owner",
            overlapped_precondition=options.overlap,
        )

    @classmethod
    def placement(
        cls, shapes: Sequence[LayerShape], world_size: int, options: StrategyOptions
    ) -> Placement:
        assert isinstance(options, DPKFACOptions)
        owners = assign_layers(
            shapes, world_size, cost=options.assignment_cost, method=options.assignment
        )
        return Placement.per_layer(owners)

    @classmethod
    def placement_uses_batch(cls, options: StrategyOptions) -> bool:
        # Every balanced assignment prices the layers with the batch's rows,
        # which differ between ranks; round robin looks at the order only.
        assert isinstance(options, DPKFACOptions)
        return options.assignment != "round_robin"
