"""The pure half of a distribution scheme: its options, traits, placement and roles.

A :class:`Scheme` subclass states, from layer shapes, a world size and its
options alone, everything about a run that can be known before it starts:
the :class:`~dpkfac.plan.Traits`, the :class:`~dpkfac.plan.assignment.Placement`,
the rank groups, the start-up collectives and what "auto" may choose among.
:meth:`Scheme.plan` gathers them into one :class:`~dpkfac.plan.Plan`. The
runtime strategies (:mod:`dpkfac.strategies`) execute a plan; the cost model
(:mod:`dpkfac.costmodel`) prices it. Nothing here communicates or touches a tensor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol, runtime_checkable

from dpkfac.plan.assignment import LayerShape, Placement
from dpkfac.plan.hardware import Hardware
from dpkfac.plan.options import StrategyOptions
from dpkfac.plan.presets import check_hardware_option
from dpkfac.plan.roles import Group, Plan
from dpkfac.plan.traits import Traits

__all__ = ["MeasuringOptions", "Scheme", "Tuning", "check_tuning"]


@runtime_checkable
class MeasuringOptions(Protocol):
    """Options of a scheme that may measure its hardware model at start-up (they hold it as
    ``hardware``)."""

    @property
    def measures_hardware(self) -> bool: ...


@dataclass(frozen=True)
class Tuning:
    """How the cost model chooses among a scheme's candidates (its "auto").

    Attributes:
        hardware: the hardware model to price with: a preset name, a JSON
            file, a model, or None (the start-up measurement, or the local preset).
        tolerance: candidates predicted within this fraction of the fastest
            count as equally fast; among them the fewest bytes per step wins.
        intervals: the (factor, decomposition) update intervals to price, or
            None: the preconditioner's (a callable schedule's average).
    """

    hardware: str | Hardware | None = None
    tolerance: float = 0.05
    intervals: tuple[int, int] | None = None


def check_tuning(options: object) -> None:
    """Validate the "auto" options ``hardware``, ``auto_tolerance`` and ``auto_intervals``
    (normalising the intervals to a tuple) of a scheme that can choose."""
    intervals = getattr(options, "auto_intervals", None)
    if intervals is not None:
        pair = tuple(intervals)
        if len(pair) != 2 or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in pair
        ):
            raise ValueError(
                f"auto_intervals must be two ints >= 1 (factor, decomposition), got {intervals!r}"
            )
        object.__setattr__(options, "auto_intervals", pair)
    tolerance = getattr(options, "auto_tolerance", 0.05)
    if (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, (int, float))
        or not 0 <= tolerance < 1
    ):
        raise ValueError(f"auto_tolerance must be in [0, 1), got {tolerance!r}")
    check_hardware_option(getattr(options, "hardware", None))


class Scheme(ABC):
    """Pure facts of one distribution scheme (see the module docstring).

    Every method is a classmethod and a pure function of its arguments: every
    rank computes the same answers, and the cost model calls them without
    building anything.
    """

    name: ClassVar[str]
    #: The dataclass of this scheme's own options.
    Options: ClassVar[type[StrategyOptions]] = StrategyOptions

    @classmethod
    def check(cls, options: StrategyOptions | None) -> StrategyOptions:
        """``options`` (default: all defaults), refused when of another scheme's class."""
        if options is None:
            return cls.Options()
        if not isinstance(options, cls.Options):
            raise TypeError(
                f"strategy {cls.name!r} takes {cls.Options.__name__}, got {type(options).__name__}"
            )
        return options

    # ------------------------------------------------------------- the facts
    @classmethod
    @abstractmethod
    def traits(cls, options: StrategyOptions) -> Traits:
        """What this scheme does with these options (see :class:`Traits`)."""

    @classmethod
    @abstractmethod
    def placement(
        cls, shapes: Sequence[LayerShape], world_size: int, options: StrategyOptions
    ) -> Placement:
        """Who owns and decomposes each layer."""

    @classmethod
    def factor_groups(cls, world_size: int, options: StrategyOptions) -> list[list[int]]:
        """Groups of ranks within which a layer's batch factors are built and averaged.

        The whole world where every rank captures every layer, singletons
        where the owner alone does.
        """
        if cls.traits(options).captures_all:
            return [list(range(world_size))]
        return [[r] for r in range(world_size)]

    @classmethod
    def preconditioners(
        cls, owner: int, world_size: int, options: StrategyOptions
    ) -> tuple[int, ...]:
        """The ranks that precondition (and hold the decompositions of) a layer of ``owner``."""
        if cls.traits(options).preconditions_all:
            return tuple(range(world_size))
        return (owner,)

    @classmethod
    def decomposition_groups(cls, world_size: int, options: StrategyOptions) -> list[list[int]]:
        """Groups within which decompositions are broadcast from their decomposer."""
        if cls.traits(options).decomposition_broadcast:
            return [list(range(world_size))]
        return []

    @classmethod
    def update_groups(cls, world_size: int, options: StrategyOptions) -> list[list[int]]:
        """Groups within which preconditioned updates are broadcast (by the layer's
        preconditioner in each group)."""
        if cls.traits(options).preconditions_all:
            return []
        return [list(range(world_size))]

    @classmethod
    def placement_uses_batch(cls, options: StrategyOptions) -> bool:
        """Whether :meth:`placement` reads ``batch_size``/``positions`` of the shapes.

        When it does, the ranks agree on those (element-wise maximum) before
        placing, since each measured them on its own first batch.
        """
        return False

    @classmethod
    def setup_collectives(cls, options: StrategyOptions, num_factors: int) -> list[tuple[str, int]]:
        """One-time collectives the run makes with these (given) options, as (kind, bytes)."""
        return []

    @classmethod
    def describe(cls, options: StrategyOptions) -> str:
        """What a run with these (resolved) options chose, in a few words ("" if nothing)."""
        return ""

    # ------------------------------------------------ start-up and tuning
    @classmethod
    def measures_hardware(cls, options: StrategyOptions) -> bool:
        """Whether a run with these options measures a hardware model at start-up: where its
        options say so (:class:`MeasuringOptions`)."""
        return isinstance(options, MeasuringOptions) and options.measures_hardware

    @classmethod
    def with_hardware(cls, options: StrategyOptions, hardware: Hardware) -> StrategyOptions:
        """The options once the start-up measurement gave ``hardware`` (as their ``hardware``)."""
        if not cls.measures_hardware(options):
            return options
        changes: dict[str, Any] = {"hardware": hardware}  # a measuring scheme's options have it
        return replace(options, **changes)

    @classmethod
    def resolved(cls, options: StrategyOptions) -> bool:
        """Whether nothing is left to choose (no "auto")."""
        return True

    @classmethod
    def check_world_size(cls, options: StrategyOptions, world_size: int) -> None:
        """Refuse fixed choices that cannot fit ``world_size`` (ValueError)."""

    @classmethod
    def may_overlap(cls, options: StrategyOptions) -> bool:
        """Whether a run with these (possibly unresolved) options may run overlapped with the
        backward pass (the preconditioner installs the overlapped mode's hooks then)."""
        return cls.traits(options).overlapped_precondition

    @classmethod
    def candidates(cls, options: StrategyOptions, world_size: int) -> list[StrategyOptions]:
        """The resolved options "auto" chooses among, in the order they are priced."""
        return [options]

    @classmethod
    def preference(cls, options: StrategyOptions) -> tuple[float, ...]:
        """Tie-break between candidates priced alike (smallest first)."""
        return ()

    @classmethod
    def tuning(cls, options: StrategyOptions) -> Tuning:
        """How "auto" prices the candidates (see :class:`Tuning`)."""
        return Tuning()

    # ------------------------------------------------------------- the plan
    @classmethod
    def plan(
        cls,
        shapes: Sequence[LayerShape],
        world_size: int,
        options: StrategyOptions,
        *,
        given: StrategyOptions | None = None,
        num_factors: int | None = None,
        placement: Placement | None = None,
    ) -> Plan:
        """Everything about a run with resolved options that is known before it starts.

        Args:
            shapes: the K-FAC layers in module order, with the step's batch.
            world_size: number of ranks.
            options: resolved options (nothing left to choose).
            given: the options the run was given, before start-up measurement
                and "auto" resolved them (default: ``options``): they decide
                the one-time setup collectives.
            num_factors: the factors that exist (default: two per layer).
            placement: a placement made before (a checkpoint's) instead of
                :meth:`placement`'s for these shapes.
        """
        if not cls.resolved(options):
            raise ValueError(
                f"strategy {cls.name!r} has options left to choose ({cls.describe(options)!r}); "
                "resolve them first (dpkfac.costmodel.choose_options)"
            )
        given = options if given is None else given
        if placement is None:
            placement = cls.placement(shapes, world_size, options)
        uses_batch = cls.placement_uses_batch(given)
        # (batch_size, positions) of every layer, as float64, agreed by a max-reduce.
        agree = [("allreduce", 16 * len(shapes))] if uses_batch else []
        own = cls.setup_collectives(given, 2 * len(shapes) if num_factors is None else num_factors)

        def groups(gs: list[list[int]]) -> tuple[Group, ...]:
            return tuple(tuple(g) for g in gs)

        return Plan(
            scheme=cls.name,
            world_size=world_size,
            names=tuple(s.name for s in shapes),
            placement=placement,
            traits=cls.traits(options),
            preconditioners=tuple(
                cls.preconditioners(o, world_size, options) for o in placement.owner
            ),
            factor_groups=groups(cls.factor_groups(world_size, options)),
            decomposition_groups=groups(cls.decomposition_groups(world_size, options)),
            update_groups=groups(cls.update_groups(world_size, options)),
            setup=tuple(agree + own),
            uses_batch=uses_batch,
        )
