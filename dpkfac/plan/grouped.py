"""grouped's plan: one design space from DP-KFAC to D-KFAC.

Two numbers place a scheme in it:

* the **factor group size** ``k`` (dividing P): a layer's Kronecker factors
  are built by the ``k`` ranks of its owner's factor group, each on its local
  batch, and averaged within that group. ``k = 1`` is DP-KFAC's local
  curvature (no factor traffic), ``k = P`` is D-KFAC's (factors of the whole
  batch);
* KAISA's **gradient-worker fraction** ``f``: ``W = f·P`` ranks precondition
  each layer (the column of its owner in KAISA's grid). The owner broadcasts
  its decompositions to its column; each row's gradient worker broadcasts the
  preconditioned update to the rest of its row.

==================  =====  =======
system              k      f
==================  =====  =======
DP-KFAC             1      1/P
D-KFAC, KAISA COMM  P      1
KAISA MEM-OPT       P      1/P
==================  =====  =======

``k = 1, f = 1`` (owners build the factors locally and broadcast
decompositions instead of gradients) and ``1 < k < P`` (factor groups, e.g.
the ranks of one node) are points no published system offers. Factor groups
are contiguous blocks of ranks.

Either number may be ``"auto"``: :meth:`GroupedScheme.candidates` lists every
admissible (k, f), and the cost model (:func:`dpkfac.costmodel.choose_options`)
prices them for the measured layer shapes, the update schedule and the
hardware, at the first step. Placement: layers go to factor groups as dp_kfac
places layers on ranks, then, within the group, to owners by KAISA's greedy
column-balanced rule on decomposition cost. With ``k = 1, f = 1/P`` the
placement, the captures and the traffic are exactly dp_kfac's; with ``k = P``
exactly kaisa's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from dpkfac.plan.assignment import (
    ASSIGNMENTS,
    COSTS,
    CostFn,
    LayerShape,
    Placement,
    assign_layers,
    grouped_assign,
)
from dpkfac.plan.d_kfac import check_bools
from dpkfac.plan.hardware import Hardware
from dpkfac.plan.kaisa import (
    KAISAScheme,
    check_fraction,
    grad_workers_of,
    layer_decomposition_costs,
    preconditions_all,
)
from dpkfac.plan.options import StrategyOptions, check_choice
from dpkfac.plan.probes import MEASURE_COLLECTIVES
from dpkfac.plan.scheme import Tuning, check_tuning
from dpkfac.plan.traits import Traits

__all__ = ["AUTO", "GroupedOptions", "GroupedScheme", "divisors", "factor_groups_of"]

AUTO = "auto"


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def factor_groups_of(world_size: int, size: int) -> list[list[int]]:
    """Contiguous blocks of ``size`` ranks (the ranks of a node, on a cluster)."""
    if size < 1 or world_size % size:
        raise ValueError(f"factor_group_size={size} must divide the world size {world_size}")
    return [list(range(g, g + size)) for g in range(0, world_size, size)]


@dataclass(frozen=True)
class GroupedOptions(StrategyOptions):
    """Options of grouped.

    Attributes:
        factor_group_size: k, the ranks a layer's factors are built and
            averaged over (dividing P), or "auto".
        grad_worker_fraction: f, as kaisa's (a number with f·P dividing P,
            "comm_opt" = 1, "mem_opt" = 1/P), or "auto".
        hardware: the hardware model "auto" prices with: a preset name, a
            JSON file, a ``Hardware``, or None (measured at start-up, as
            spd_kfac does). Unused when neither number is "auto".
        triangle / lazy_factor_sync: as for d_kfac, within factor groups.
        assignment / assignment_cost: how layers go to factor groups, as
            dp_kfac places layers on ranks.
        auto_tolerance: candidates predicted within this fraction of the
            fastest count as equally fast; among them "auto" takes the one
            handing the fewest bytes to collectives. The timing half of the
            cost model is fitted to within tens of percent (bytes are exact),
            so a 2% predicted gain is no reason to double the traffic, which
            is what suffers first from a shared or slower network.
        auto_intervals: the (factor, decomposition) update intervals "auto"
            prices. None: the preconditioner's, where a callable schedule
            counts as its average interval over its first steps. A benchmark
            that drives the schedule through a cycle of step kinds states the
            setting it stands for here.
    """

    factor_group_size: int | str = AUTO
    grad_worker_fraction: float | str = AUTO
    hardware: str | Hardware | None = None
    triangle: bool = False
    lazy_factor_sync: bool = True
    assignment: str = "lpt"
    assignment_cost: str | CostFn = "compute"
    auto_tolerance: float = 0.05
    auto_intervals: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        check_tuning(self)
        k = self.factor_group_size
        if k != AUTO and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"factor_group_size must be an int >= 1 or 'auto', got {k!r}")
        check_fraction(self.grad_worker_fraction, (AUTO,))
        check_bools(self, "triangle", "lazy_factor_sync")
        check_choice("assignment", self.assignment, ASSIGNMENTS)
        if not callable(self.assignment_cost):
            check_choice("assignment_cost", self.assignment_cost, tuple(COSTS))

    @property
    def resolved(self) -> bool:
        """Whether both numbers are fixed (no "auto" left)."""
        return AUTO not in (self.factor_group_size, self.grad_worker_fraction)

    @property
    def measures_hardware(self) -> bool:
        """Whether the run measures its hardware model at start-up (for "auto")."""
        return not self.resolved and self.hardware is None

    def group_size(self, world_size: int) -> int:
        """k, checked against the world size."""
        k = int(self._fixed("factor_group_size"))
        factor_groups_of(world_size, k)
        return k

    def grad_workers(self, world_size: int) -> int:
        """W = f·P, checked against the world size."""
        return grad_workers_of(self._fixed("grad_worker_fraction"), world_size)

    def _fixed(self, name: str) -> Any:
        value = getattr(self, name)
        if value == AUTO:
            raise ValueError(
                f"{name}='auto' is chosen at the first step; resolve it first "
                "(dpkfac.costmodel.choose_options)"
            )
        return value


class GroupedScheme(KAISAScheme):
    """Factors averaged within groups of k ranks, preconditioning by W = f·P gradient workers."""

    name = "grouped"
    Options = GroupedOptions

    @classmethod
    def traits(cls, options: StrategyOptions) -> Traits:
        assert isinstance(options, GroupedOptions)
        return Traits(
            captures_all=False,  # the factor groups say who captures
            factor_comm="allreduce",
            triangle=options.triangle,
            decomposition_broadcast=True,
            preconditions_all=preconditions_all(options.grad_worker_fraction),
            lazy_factor_sync=options.lazy_factor_sync,
        )

    @classmethod
    def factor_groups(cls, world_size: int, options: StrategyOptions) -> list[list[int]]:
        assert isinstance(options, GroupedOptions)
        return factor_groups_of(world_size, options.group_size(world_size))

    @classmethod
    def placement(
        cls, shapes: Sequence[LayerShape], world_size: int, options: StrategyOptions
    ) -> Placement:
        assert isinstance(options, GroupedOptions)
        k = options.group_size(world_size)
        groups = factor_groups_of(world_size, k)
        group_of = assign_layers(
            shapes,
            len(groups),
            cost=options.assignment_cost,
            method=options.assignment,
            by_bucket=True,
        )
        if k == 1:  # the group is the owner: dp_kfac's placement
            return Placement.per_layer(group_of)
        owners = grouped_assign(
            layer_decomposition_costs(shapes),
            group_of,
            groups,
            world_size,
            options.grad_workers(world_size),
        )
        return Placement.per_layer(owners)

    @classmethod
    def placement_uses_batch(cls, options: StrategyOptions) -> bool:
        assert isinstance(options, GroupedOptions)
        return options.assignment != "round_robin" or not options.resolved

    @classmethod
    def setup_collectives(cls, options: StrategyOptions, num_factors: int) -> list[tuple[str, int]]:
        assert isinstance(options, GroupedOptions)
        return list(MEASURE_COLLECTIVES) if options.measures_hardware else []

    @classmethod
    def describe(cls, options: StrategyOptions) -> str:
        """``k=…, f=…`` of resolved options ("" while either is "auto")."""
        assert isinstance(options, GroupedOptions)
        if not options.resolved:
            return ""
        f = options.grad_worker_fraction
        shown = f if isinstance(f, str) else str(Fraction(f).limit_denominator(1 << 16))
        return f"k={options.factor_group_size}, f={shown}"

    # ------------------------------------------------ start-up and tuning
    @classmethod
    def resolved(cls, options: StrategyOptions) -> bool:
        assert isinstance(options, GroupedOptions)
        return options.resolved

    @classmethod
    def check_world_size(cls, options: StrategyOptions, world_size: int) -> None:
        """A fixed k or f that does not fit this world size is refused at construction."""
        assert isinstance(options, GroupedOptions)
        if options.factor_group_size != AUTO:
            options.group_size(world_size)
        if options.grad_worker_fraction != AUTO:
            options.grad_workers(world_size)

    @classmethod
    def candidates(cls, options: StrategyOptions, world_size: int) -> list[StrategyOptions]:
        """Every k dividing P (or the given k) with every f such that f·P divides P (or the
        given f)."""
        assert isinstance(options, GroupedOptions)
        ks = (
            divisors(world_size)
            if options.factor_group_size == AUTO
            else [options.group_size(world_size)]
        )
        ws = (
            divisors(world_size)
            if options.grad_worker_fraction == AUTO
            else [options.grad_workers(world_size)]
        )
        return [
            replace(options, factor_group_size=k, grad_worker_fraction=w / world_size)
            for k in ks
            for w in ws
        ]

    @classmethod
    def preference(cls, options: StrategyOptions) -> tuple[float, ...]:
        """More samples in the curvature first (larger k), then more gradient workers."""
        assert isinstance(options, GroupedOptions)
        return (-float(options.factor_group_size), -float(options.grad_worker_fraction))

    @classmethod
    def tuning(cls, options: StrategyOptions) -> Tuning:
        assert isinstance(options, GroupedOptions)
        return Tuning(options.hardware, options.auto_tolerance, options.auto_intervals)
