"""grouped: one design space from DP-KFAC to D-KFAC, with an automatic choice.

Two numbers place a scheme in it:

* the **factor group size** ``k`` (dividing P): a layer's Kronecker factors
  are built by the ``k`` ranks of its owner's factor group, each on its local
  batch, and averaged within that group. ``k = 1`` is DP-KFAC's local
  curvature (no factor traffic), ``k = P`` is D-KFAC's (factors of the whole
  batch). ``k`` trades the curvature's sample size against traffic and
  factor computation;
* KAISA's **gradient-worker fraction** ``f``: ``W = f·P`` ranks precondition
  each layer (the column of its owner in KAISA's grid,
  :func:`dpkfac.assignment.grad_worker_grid`). The owner broadcasts its
  decompositions to its column; each row's gradient worker broadcasts the
  preconditioned update to the rest of its row.

Known systems are corners of the space:

==================  =====  =======
system              k      f
==================  =====  =======
DP-KFAC             1      1/P
D-KFAC, KAISA COMM  P      1
KAISA MEM-OPT       P      1/P
==================  =====  =======

Two points no published system offers: ``k = 1, f = 1`` (owners build the
factors locally and broadcast decompositions instead of gradients: SGD's
traffic plus the decompositions every I steps), and ``1 < k < P`` (factor
groups, e.g. the ranks of one node). Factor groups are contiguous blocks of
ranks, so on a cluster they are the ranks of a node when ``k`` divides the
node size.

Either number may be ``"auto"``: at the first step the cost model
(:func:`dpkfac.costmodel.predict`) prices every admissible (k, f) for the
measured layer shapes, the update schedule and the hardware (a preset, a
JSON file, or measured at start-up) and the lowest predicted iteration time
wins. The choice and every candidate's prediction are kept in
:attr:`GroupedKFAC.choice`.

Placement: layers go to factor groups as dp_kfac places layers on ranks
(``assignment``, ``assignment_cost``), then, within the group, to owners by
KAISA's greedy column-balanced rule on decomposition cost. With ``k = 1,
f = 1/P`` the placement, the captures and the traffic are exactly dp_kfac's;
with ``k = P`` exactly kaisa's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from dpkfac.assignment import (
    ASSIGNMENTS,
    COSTS,
    CostFn,
    LayerShape,
    Placement,
    assign_layers,
    factor_decomposition_cost,
    grad_worker_grid,
    grouped_assign,
)
from dpkfac.comm import Communicator
from dpkfac.curvature import KFACLayer
from dpkfac.curvature.layer import FACTORS
from dpkfac.options import KFACOptions, StrategyOptions, check_choice, checked_at
from dpkfac.strategies.base import Traits
from dpkfac.strategies.d_kfac import DKFAC
from dpkfac.strategies.kaisa import KAISA, grad_workers_of

if TYPE_CHECKING:
    from dpkfac.costmodel.hardware import Hardware

logger = logging.getLogger(__name__)

AUTO = "auto"


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


#: Steps over which a callable update schedule is averaged to price "auto".
SCHEDULE_HORIZON = 1000


def average_interval(schedule: int | Callable[[int], int], name: str = "inv_update_steps") -> int:
    """An update interval as an int: a callable schedule's mean over the first steps.

    The preconditioner updates at step ``s`` when ``s % schedule(s) == 0``;
    the mean interval is :data:`SCHEDULE_HORIZON` over the number of such
    steps (rounded, at least 1).
    """
    if not callable(schedule):
        return int(schedule)
    fires = sum(1 for s in range(SCHEDULE_HORIZON) if s % checked_at(name, schedule, s) == 0)
    return max(1, round(SCHEDULE_HORIZON / max(fires, 1)))


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
            counts as its average interval over the first
            :data:`SCHEDULE_HORIZON` steps. A benchmark that drives the
            schedule through a cycle of step kinds states the setting it
            stands for here.
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
        if self.auto_intervals is not None:
            pair = tuple(self.auto_intervals)
            if len(pair) != 2 or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in pair
            ):
                raise ValueError(
                    f"auto_intervals must be two ints >= 1 (factor, decomposition), "
                    f"got {self.auto_intervals!r}"
                )
            object.__setattr__(self, "auto_intervals", pair)
        if (
            isinstance(self.auto_tolerance, bool)
            or not isinstance(self.auto_tolerance, (int, float))
            or not 0 <= self.auto_tolerance < 1
        ):
            raise ValueError(f"auto_tolerance must be in [0, 1), got {self.auto_tolerance!r}")
        k = self.factor_group_size
        if k != AUTO and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"factor_group_size must be an int >= 1 or 'auto', got {k!r}")
        f = self.grad_worker_fraction
        if isinstance(f, str):
            check_choice("grad_worker_fraction", f, ("comm_opt", "mem_opt", AUTO))
        elif isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(
                f"grad_worker_fraction must be in (0, 1], 'comm_opt', 'mem_opt' or 'auto', "
                f"got {f!r}"
            )
        for name in ("triangle", "lazy_factor_sync"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        check_choice("assignment", self.assignment, ASSIGNMENTS)
        if not callable(self.assignment_cost):
            check_choice("assignment_cost", self.assignment_cost, tuple(COSTS))
        from dpkfac.costmodel.presets import check_hardware_option

        check_hardware_option(self.hardware)

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
        k = self._fixed("factor_group_size")
        factor_groups_of(world_size, int(k))
        return int(k)

    def grad_workers(self, world_size: int) -> int:
        """W = f·P, checked against the world size."""
        return grad_workers_of(self._fixed("grad_worker_fraction"), world_size)

    def _fixed(self, name: str) -> Any:
        value = getattr(self, name)
        if value == AUTO:
            raise ValueError(
                f"{name}='auto' is chosen at the first step; resolve it first "
                "(GroupedKFAC.choose, or the cost model's resolve_options)"
            )
        return value


@dataclass(frozen=True)
class Candidate:
    """One (k, f) the automatic choice priced.

    Attributes:
        factor_group_size: k.
        grad_worker_fraction: f.
        iteration: predicted seconds per step, averaged over the schedule.
        comm_bytes: predicted bytes handed to collectives per step and rank.
    """

    factor_group_size: int
    grad_worker_fraction: float
    iteration: float
    comm_bytes: float


class GroupedKFAC(KAISA):
    """Factors averaged within groups of k ranks, preconditioning by W = f·P gradient workers."""

    name = "grouped"
    Options = GroupedOptions
    options: GroupedOptions

    # ------------------------------------------------- pure, class-level facts
    @classmethod
    def traits(cls, options: GroupedOptions) -> Traits:  # type: ignore[override]
        f = options.grad_worker_fraction
        return Traits(
            captures_all=False,  # the factor groups say who captures
            factor_comm="allreduce",
            triangle=options.triangle,
            decomposition_broadcast=True,
            preconditions_all=f in (1, 1.0, "comm_opt"),
            lazy_factor_sync=options.lazy_factor_sync,
        )

    @classmethod
    def factor_groups(  # type: ignore[override]
        cls, world_size: int, options: GroupedOptions
    ) -> list[list[int]]:
        return factor_groups_of(world_size, options.group_size(world_size))

    @classmethod
    def placement(  # type: ignore[override]
        cls, shapes: Sequence[LayerShape], world_size: int, options: GroupedOptions
    ) -> Placement:
        k = options.group_size(world_size)
        groups = factor_groups_of(world_size, k)
        group_of = assign_layers(
            shapes, len(groups), cost=options.assignment_cost, method=options.assignment
        )
        if k == 1:  # the group is the owner: dp_kfac's placement
            return Placement.per_layer(group_of)
        costs = [
            factor_decomposition_cost(s.a_dim) + factor_decomposition_cost(s.g_dim) for s in shapes
        ]
        owners = grouped_assign(
            costs, group_of, groups, world_size, options.grad_workers(world_size)
        )
        return Placement.per_layer(owners)

    @classmethod
    def placement_uses_batch(cls, options: GroupedOptions) -> bool:  # type: ignore[override]
        return options.assignment != "round_robin" or not options.resolved

    @classmethod
    def setup_collectives(  # type: ignore[override]
        cls, options: GroupedOptions, num_factors: int
    ) -> list[tuple[str, int]]:
        from dpkfac.costmodel.calibration import MEASURE_COLLECTIVES

        return list(MEASURE_COLLECTIVES) if options.measures_hardware else []

    @classmethod
    def resolve_options(  # type: ignore[override]
        cls,
        options: GroupedOptions,
        hardware: Hardware,
        *,
        shapes: Sequence[LayerShape] = (),
        world_size: int = 1,
        kfac: KFACOptions | None = None,
    ) -> GroupedOptions:
        """The (k, f) a run on ``hardware`` chooses for these shapes and schedule."""
        if options.resolved:
            return options
        if options.measures_hardware:
            options = replace(options, hardware=hardware)
        return cls.choose(shapes, world_size, options, kfac or KFACOptions())[0]

    @classmethod
    def describe(cls, options: GroupedOptions) -> str:  # type: ignore[override]
        """``k=…, f=…`` of resolved options ("" while either is "auto")."""
        if not options.resolved:
            return ""
        f = options.grad_worker_fraction
        shown = f if isinstance(f, str) else str(Fraction(f).limit_denominator(1 << 16))
        return f"k={options.factor_group_size}, f={shown}"

    @classmethod
    def choose(
        cls,
        shapes: Sequence[LayerShape],
        world_size: int,
        options: GroupedOptions,
        kfac: KFACOptions,
    ) -> tuple[GroupedOptions, list[Candidate]]:
        """Fix the "auto" numbers: the fastest predicted candidate, traffic deciding near-ties.

        Every k dividing P (or the given k) and every f with f·P dividing P
        (or the given f) is priced by :func:`dpkfac.costmodel.predict` on the
        options' hardware, with ``auto_intervals`` or the schedule's average
        intervals (:func:`average_interval`). Among the
        candidates within ``auto_tolerance`` of the lowest predicted
        iteration time, the one with the fewest bytes per step wins; then the
        larger k (more samples in the curvature), then the larger f.

        Returns:
            The resolved options and every candidate, in the order priced.
        """
        from dpkfac.costmodel.predict import predict

        hardware = options.hardware
        if isinstance(hardware, str) or hardware is None:
            from dpkfac.costmodel.presets import PRESETS, hardware_option

            hardware = hardware_option(hardware) or PRESETS["cpu_gloo_local"]
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
        f_every, i_every = options.auto_intervals or (
            average_interval(kfac.factor_update_steps, "factor_update_steps"),
            average_interval(kfac.inv_update_steps),
        )
        # The shapes hold the step's batch (all its micro-batches) already.
        fixed = replace(
            kfac, factor_update_steps=f_every, inv_update_steps=i_every, accumulation_steps=1
        )
        candidates = []
        for k in ks:
            for w in ws:
                opts = replace(options, factor_group_size=k, grad_worker_fraction=w / world_size)
                if world_size == 1:
                    candidates.append(Candidate(k, w / world_size, 0.0, 0.0))
                    continue
                pred = predict(
                    shapes,
                    strategy=cls.name,
                    world_size=world_size,
                    hardware=hardware,
                    kfac=fixed,
                    options=opts,
                )
                candidates.append(
                    Candidate(k, w / world_size, pred.iteration_avg, pred.bytes_per_step)
                )
        fastest = min(c.iteration for c in candidates)
        near = [c for c in candidates if c.iteration <= fastest * (1 + options.auto_tolerance)]
        best = min(
            near,
            key=lambda c: (c.comm_bytes, -c.factor_group_size, -c.grad_worker_fraction),
        )
        chosen = replace(
            options,
            factor_group_size=best.factor_group_size,
            grad_worker_fraction=best.grad_worker_fraction,
        )
        return chosen, candidates

    # ------------------------------------------------------------------ a run
    def __init__(self, comm: Communicator, *args: Any, **kwargs: Any) -> None:
        DKFAC.__init__(self, comm, *args, **kwargs)
        if self.options.measures_hardware:
            from dpkfac.costmodel.calibration import start_up_hardware

            self.options = replace(self.options, hardware=start_up_hardware(comm))
        #: Every candidate of the automatic choice (empty when nothing was "auto").
        self.choice: list[Candidate] = []
        self.factor_group_size: int | None = None
        self.grad_worker_fraction: float | None = None
        # A fixed k or f that does not fit this world size is refused now, not at step 0.
        if self.options.factor_group_size != AUTO:
            self.options.group_size(self.world_size)
        if self.options.grad_worker_fraction != AUTO:
            self.options.grad_workers(self.world_size)
        if self.options.resolved:
            self._make_groups()

    def _make_groups(self) -> None:
        """Process groups of the resolved (k, f): factor groups, columns and rows (collective)."""
        p = self.world_size
        k = self.options.group_size(p)
        self.grad_workers = self.options.grad_workers(p)
        self.factor_group_size = k
        self.grad_worker_fraction = self.grad_workers / p
        self.groups = factor_groups_of(p, k)
        self.columns, self.rows = grad_worker_grid(p, self.grad_workers)
        group_comms = self.comm.subgroups(self.groups)
        self.factor_comm = group_comms[self.rank // k]
        self._column_comms = self.comm.subgroups(self.columns)
        self._row_comms = self.comm.subgroups(self.rows)

    def place(self, layers: Sequence[KFACLayer], shapes: Sequence[LayerShape]) -> None:
        if self.options.resolved:
            super().place(layers, shapes)
        # Unresolved: nothing is placed until the first step; every rank captures.

    def finalise_placement(self, layers: Sequence[KFACLayer], shapes: Sequence[LayerShape]) -> None:
        if not self.options.resolved:
            self.options, self.choice = self.choose(
                shapes, self.world_size, self.options, self.kfac
            )
            self._make_groups()
            logger.info(
                "grouped: chose factor_group_size=%d, grad_worker_fraction=%g at P=%d "
                "(predicted %.2f ms/step; candidates: %s)",
                self.factor_group_size,
                self.grad_worker_fraction,
                self.world_size,
                1e3 * min(c.iteration for c in self.choice),
                ", ".join(
                    f"k={c.factor_group_size} f={c.grad_worker_fraction:g}: "
                    f"{1e3 * c.iteration:.2f} ms"
                    for c in self.choice
                ),
            )
        super().finalise_placement(layers, shapes)

    # ------------------------------------------------------------------ queries
    def captures(self, layer: KFACLayer) -> bool:
        if not self.placed:
            return True  # as dp_kfac: the first step loses nothing
        k = self.factor_group_size or 1
        return layer.owner // k == self.rank // k

    def share_decompositions(
        self, layers: Sequence[KFACLayer], updated: set[tuple[str, str]]
    ) -> None:
        """Each owner broadcasts its layers' decompositions to its column.

        ``updated`` names the factors held here; a gradient worker outside the
        owner's factor group holds none of that layer's, yet must receive. A
        layer counts as decomposed wherever it was ever called in training at
        a factor step (``ever_seen``, set on every rank: the ranks run the
        same forward, so a layer first used after the first step is known to
        the receivers too), or where its factors or decompositions are held (a
        restored checkpoint), which every member of a column agrees on.
        """
        due = set(updated) | {
            (x.name, w)
            for x in layers
            for w in FACTORS
            if x.ever_seen or x.factor(w) is not None or x.decomposition(w) is not None
        }
        super().share_decompositions(layers, due)

    def state_dict(self) -> dict[str, Any]:
        return {
            "factor_group_size": self.factor_group_size,
            "grad_worker_fraction": self.grad_worker_fraction,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the saved (k, f) where this run has not chosen yet; a fixed one must match."""
        k, f = state.get("factor_group_size"), state.get("grad_worker_fraction")
        if k is None or f is None:
            return
        if self.options.resolved:
            if (self.factor_group_size, self.grad_worker_fraction) != (k, f):
                raise ValueError(
                    f"checkpoint was saved with factor_group_size={k}, grad_worker_fraction={f} "
                    f"but this run has {self.factor_group_size}, {self.grad_worker_fraction}"
                )
            return
        self.options = replace(self.options, factor_group_size=int(k), grad_worker_fraction=f)
        self._make_groups()


__all__ = ["AUTO", "Candidate", "GroupedKFAC", "GroupedOptions", "divisors", "factor_groups_of"]
