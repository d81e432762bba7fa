"""dp_kfac's plan: one owner per layer captures, decomposes and preconditions it.

The owner builds the layer's factors on its own local batch (no factor is
ever communicated), decomposes them, preconditions the averaged gradient and
broadcasts the update to every rank. Placement: layers to owners by
:func:`~dpkfac.plan.assignment.assign_layers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from dpkfac.plan.assignment import ASSIGNMENTS, COSTS, CostFn, LayerShape, Placement, assign_layers
from dpkfac.plan.hardware import Hardware
from dpkfac.plan.options import StrategyOptions, check_choice
from dpkfac.plan.probes import MEASURE_COLLECTIVES
from dpkfac.plan.scheme import Scheme, Tuning, check_tuning
from dpkfac.plan.traits import Traits

__all__ = ["AUTO", "GRAD_REDUCTIONS", "DPKFACOptions", "DPKFACScheme"]

GRAD_REDUCTIONS = ("allreduce", "owner")
DRAINS = ("last", "ready")
AUTO = "auto"


@dataclass(frozen=True)
class DPKFACOptions(StrategyOptions):
    """Options of dp_kfac.

    Attributes:
        grad_reduction: "allreduce" (the published scheme), "owner" (K-FAC
            layers' gradients reduce-scattered onto their owners, the updates
            all-gathered) or "auto" (chosen at the first step by the cost model).
        assignment: "lpt" (load balanced by ``assignment_cost``, and every backward
            bucket's update bytes balanced too where the run knows its buckets, for the
            overlapped mode's sake: :func:`~dpkfac.plan.assignment.assign_layers`'
            ``by_bucket``; the same with and without ``overlap``, which changes only how
            the update travels),
            "round_robin" (module order, as the released DP-KFAC code) or
            "best" (whichever of the two has the lower busiest-rank cost).
        assignment_cost: a name in :data:`dpkfac.plan.assignment.COSTS` or a
            callable ``LayerShape -> float``.
        overlap: reduce gradients in fused buckets in backward order (DDP's
            own buckets, from its communication hook, on a DDP model), and let
            each owner precondition and send a layer as soon as its reduced
            gradient is there, during the backward pass (:mod:`dpkfac.overlap`);
            with either ``grad_reduction``. With a ``grad_scaler``, ``pre.step()``
            then takes the scaled gradients (``takes_scaled_gradients``). "auto":
            chosen at the first step by the cost model.
        drain: with ``overlap``, when a bucket's layers are preconditioned and their
            updates exchanged (:attr:`~dpkfac.plan.traits.Traits.drain`): "last", once
            the backward pass has launched every bucket; "ready", from the first gradient
            hook that finds the bucket's K-FAC part reduced, so the exchanges use the link
            while the backward pass runs, at the price of holding back the later buckets'
            launch by that work; "auto": chosen with ``overlap`` by the cost model.
            Without overlap it has no effect.
        hardware / auto_tolerance / auto_intervals: how "auto" prices the
            candidates, as grouped's (:class:`~dpkfac.plan.grouped.GroupedOptions`).
            Every candidate gives the same update: "auto" only chooses how it
            travels.
    """

    grad_reduction: str = "allreduce"
    assignment: str = "lpt"
    assignment_cost: str | CostFn = "compute"
    overlap: bool | str = False
    drain: str = "last"
    hardware: str | Hardware | None = None
    auto_tolerance: float = 0.05
    auto_intervals: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        check_choice("grad_reduction", self.grad_reduction, (*GRAD_REDUCTIONS, AUTO))
        if not isinstance(self.overlap, bool) and self.overlap != AUTO:
            raise ValueError(f"overlap must be a bool or 'auto', got {self.overlap!r}")
        check_choice("drain", self.drain, (*DRAINS, AUTO))
        check_choice("assignment", self.assignment, ASSIGNMENTS)
        if not callable(self.assignment_cost):
            check_choice("assignment_cost", self.assignment_cost, tuple(COSTS))
        check_tuning(self)

    @property
    def resolved(self) -> bool:
        """Whether neither lever is left to "auto"."""
        drain_open = self.drain == AUTO and self.overlap is not False
        return AUTO not in (self.grad_reduction, self.overlap) and not drain_open

    @property
    def measures_hardware(self) -> bool:
        """Whether the run measures its hardware model at start-up (for "auto")."""
        return not self.resolved and self.hardware is None


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
            # The owner alone preconditions a layer, so no rank needs another's
            # decompositions: the plan gets no decomposition group, and none is sent.
            decomposition_broadcast=False,
            preconditions_all=False,
            owner_grad_reduction=options.grad_reduction == "owner",
            overlapped_precondition=options.overlap is True,
            drain="ready" if options.overlap is True and options.drain == "ready" else "last",
        )

    @classmethod
    def placement(
        cls, shapes: Sequence[LayerShape], world_size: int, options: StrategyOptions
    ) -> Placement:
        assert isinstance(options, DPKFACOptions)
        # The overlapped mode sends each bucket's layers while later buckets are on the
        # wire: their owners' shares then share the link, so each bucket is balanced too.
        # Whether or not this run overlaps: the owner builds a layer's factors from its own
        # batch, so the placement is part of the update, which overlap must not change.
        owners = assign_layers(
            shapes,
            world_size,
            cost=options.assignment_cost,
            method=options.assignment,
            by_bucket=True,
        )
        return Placement.per_layer(owners)

    @classmethod
    def placement_uses_batch(cls, options: StrategyOptions) -> bool:
        # Every balanced assignment prices the layers with the batch's rows,
        # which differ between ranks; round robin looks at the order only.
        assert isinstance(options, DPKFACOptions)
        return options.assignment != "round_robin"

    @classmethod
    def describe(cls, options: StrategyOptions) -> str:
        """The levers a run departs from the published scheme by ("" for none)."""
        assert isinstance(options, DPKFACOptions)
        if not options.resolved:
            return ""
        owner = options.grad_reduction == "owner"
        ready = options.overlap is True and options.drain == "ready"
        return ", ".join(
            name
            for name, on in (("owner", owner), ("overlap", options.overlap), ("ready", ready))
            if on
        )

    # ------------------------------------------------ start-up and tuning
    @classmethod
    def resolved(cls, options: StrategyOptions) -> bool:
        assert isinstance(options, DPKFACOptions)
        return options.resolved

    @classmethod
    def setup_collectives(cls, options: StrategyOptions, num_factors: int) -> list[tuple[str, int]]:
        return list(MEASURE_COLLECTIVES) if cls.measures_hardware(options) else []

    @classmethod
    def may_overlap(cls, options: StrategyOptions) -> bool:
        assert isinstance(options, DPKFACOptions)
        return options.overlap is True or options.overlap == AUTO

    @classmethod
    def candidates(cls, options: StrategyOptions, world_size: int) -> list[StrategyOptions]:
        """Every (gradient reduction, overlap, drain) the options leave open (the drain with
        overlap only). All give the same update."""
        assert isinstance(options, DPKFACOptions)
        reductions = (
            GRAD_REDUCTIONS if options.grad_reduction == AUTO else (options.grad_reduction,)
        )
        overlaps = (False, True) if options.overlap == AUTO else (options.overlap,)
        drains = DRAINS if options.drain == AUTO else (options.drain,)
        ways = [(o, d) for o in overlaps for d in (drains if o else ("last",))]
        return [
            replace(options, grad_reduction=r, overlap=o, drain=d)
            for r in reductions
            for o, d in ways
        ]

    @classmethod
    def preference(cls, options: StrategyOptions) -> tuple[float, ...]:
        """Among candidates priced alike: the owner reduction (SGD's wire), then no overlap
        and the last-launch drain (fewer moving parts)."""
        assert isinstance(options, DPKFACOptions)
        return (
            float(options.grad_reduction != "owner"),
            float(options.overlap is True),
            float(options.drain == "ready"),
        )

    @classmethod
    def tuning(cls, options: StrategyOptions) -> Tuning:
        assert isinstance(options, DPKFACOptions)
        return Tuning(options.hardware, options.auto_tolerance, options.auto_intervals)
