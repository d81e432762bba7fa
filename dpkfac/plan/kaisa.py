"""kaisa's plan: D-KFAC with a gradient-worker fraction.

Factors are all-reduced over every rank, as in d_kfac. Each layer has one
inverse worker that decomposes both of its factors. With ``W = f·P`` gradient
workers per layer (``f = grad_worker_fraction``), the ranks form a grid of W
rows and P/W columns (:func:`dpkfac.plan.assignment.grad_worker_grid`): a
layer's gradient workers are the column of its inverse worker. The inverse
worker broadcasts the decompositions to its column; every gradient worker
preconditions the layer; each row's gradient worker broadcasts the
preconditioned gradient to the rest of its row.

``f = 1`` (COMM-OPT) is d_kfac with layer-wise placement; ``f = 1/P``
(MEM-OPT) is dp_kfac's preconditioning with all-reduced factors; values in
between (HYBRID) trade decomposition memory and traffic against gradient traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from dpkfac.plan.assignment import (
    LayerShape,
    Placement,
    factor_decomposition_cost,
    grad_worker_grid,
    kaisa_assign,
    round_robin_assign,
)
from dpkfac.plan.d_kfac import DKFACOptions, DKFACScheme
from dpkfac.plan.options import StrategyOptions, check_choice
from dpkfac.plan.traits import Traits

__all__ = [
    "NAMED_FRACTIONS",
    "GradWorkerOptions",
    "KAISAOptions",
    "KAISAScheme",
    "check_fraction",
    "grad_workers_of",
    "layer_decomposition_costs",
    "preconditions_all",
]

#: Named fractions: COMM-OPT is 1, MEM-OPT is 1/P (resolved with the world size).
NAMED_FRACTIONS = ("comm_opt", "mem_opt")


def grad_workers_of(fraction: float | str, world_size: int) -> int:
    """W = f·P, the gradient workers per layer, for a fraction or its name.

    Raises:
        ValueError: f·P is not an integer dividing P.
    """
    if fraction == "comm_opt":
        return world_size
    if fraction == "mem_opt":
        return 1
    workers = max(1.0, float(fraction) * world_size)
    if abs(workers - round(workers)) > 1e-9 or world_size % round(workers):
        raise ValueError(
            f"grad_worker_fraction={fraction} gives {workers:g} gradient workers at world size "
            f"{world_size}; f·P must be an integer that divides P"
        )
    return round(workers)


def preconditions_all(fraction: float | str) -> bool:
    """Whether a gradient-worker fraction makes every rank a gradient worker (COMM-OPT)."""
    return fraction in (1, 1.0, "comm_opt")


def check_fraction(fraction: object, extra: tuple[str, ...] = ()) -> None:
    """Raise ValueError unless ``fraction`` is in (0, 1] or one of the named fractions."""
    names = (*NAMED_FRACTIONS, *extra)
    if isinstance(fraction, str):
        check_choice("grad_worker_fraction", fraction, names)
    else:
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, (int, float))
            or not 0 < fraction <= 1
        ):
            raise ValueError(_fraction_message(fraction, names))


def _fraction_message(fraction: object, names: tuple[str, ...]) -> str:
    quoted = [repr(n) for n in names]
    listed = ", ".join(quoted[:-1]) + " or " + quoted[-1]
    return f"grad_worker_fraction must be in (0, 1], {listed}, got {fraction!r}"


def layer_decomposition_costs(shapes: Sequence[LayerShape]) -> list[float]:
    """Per layer, the cost of decomposing both of its factors (one rank does both)."""
    return [factor_decomposition_cost(s.a_dim) + factor_decomposition_cost(s.g_dim) for s in shapes]


@runtime_checkable
class GradWorkerOptions(Protocol):
    """Options that fix W, the gradient workers per layer (kaisa's, grouped's)."""

    def grad_workers(self, world_size: int) -> int: ...


@dataclass(frozen=True)
class KAISAOptions(DKFACOptions):
    """Options of kaisa.

    Attributes:
        grad_worker_fraction: fraction f of the ranks that precondition each
            layer, in (0, 1], with f·P an integer dividing P; or "comm_opt"
            (f = 1) or "mem_opt" (f = 1/P), which name the two ends without
            knowing P (what a config file needs).
        triangle / placement / lazy_factor_sync: as for d_kfac
            (:class:`~dpkfac.plan.d_kfac.DKFACOptions`); "lpt" is KAISA's
            greedy placement within gradient-worker columns.
    """

    grad_worker_fraction: float | str = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fraction(self.grad_worker_fraction)

    def grad_workers(self, world_size: int) -> int:
        """W = f·P, the gradient workers per layer (see :func:`grad_workers_of`)."""
        return grad_workers_of(self.grad_worker_fraction, world_size)


class KAISAScheme(DKFACScheme):
    """All-reduced factors, column-wise decompositions, row-wise gradient broadcasts."""

    name = "kaisa"
    # The base's type: grouped, a subclass, takes options that are not kaisa's.
    Options: ClassVar[type[StrategyOptions]] = KAISAOptions

    @classmethod
    def traits(cls, options: StrategyOptions) -> Traits:
        assert isinstance(options, KAISAOptions)
        return Traits(
            captures_all=True,
            factor_comm="allreduce",
            triangle=options.triangle,
            decomposition_broadcast=True,
            preconditions_all=preconditions_all(options.grad_worker_fraction),
            lazy_factor_sync=options.lazy_factor_sync,
        )

    @classmethod
    def placement(
        cls, shapes: Sequence[LayerShape], world_size: int, options: StrategyOptions
    ) -> Placement:
        assert isinstance(options, KAISAOptions)
        if options.placement == "layer_round_robin":
            return Placement.per_layer(round_robin_assign(len(shapes), world_size))
        costs = layer_decomposition_costs(shapes)
        workers = options.grad_workers(world_size)
        return Placement.per_layer(kaisa_assign(costs, world_size, workers))

    @classmethod
    def check_world_size(cls, options: StrategyOptions, world_size: int) -> None:
        assert isinstance(options, KAISAOptions)
        options.grad_workers(world_size)

    @classmethod
    def grid(
        cls, world_size: int, options: StrategyOptions
    ) -> tuple[list[list[int]], list[list[int]]]:
        """KAISA's (columns, rows) for these options."""
        assert isinstance(options, GradWorkerOptions)
        return grad_worker_grid(world_size, options.grad_workers(world_size))

    @classmethod
    def preconditioners(
        cls, owner: int, world_size: int, options: StrategyOptions
    ) -> tuple[int, ...]:
        """The gradient workers of a layer: the column of its inverse worker."""
        columns, _ = cls.grid(world_size, options)
        return tuple(columns[owner % len(columns)])

    @classmethod
    def decomposition_groups(cls, world_size: int, options: StrategyOptions) -> list[list[int]]:
        return cls.grid(world_size, options)[0]

    @classmethod
    def update_groups(cls, world_size: int, options: StrategyOptions) -> list[list[int]]:
        columns, rows = cls.grid(world_size, options)
        return [] if len(columns) == 1 else rows
