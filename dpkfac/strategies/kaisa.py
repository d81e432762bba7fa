"""KAISA: D-KFAC with a gradient-worker fraction (Pauloski et al., arXiv 2007.00784).

Factors are all-reduced over every rank, as in d_kfac. Each layer has one
inverse worker that decomposes both of its factors. With ``W = f·P`` gradient
workers per layer (``f = grad_worker_fraction``), the ranks form a grid of W
rows and P/W columns (:func:`dpkfac.assignment.grad_worker_grid`): a layer's
gradient workers are the column of its inverse worker. The inverse worker
broadcasts the decompositions to its column; every gradient worker
preconditions the layer; each row's gradient worker broadcasts the
preconditioned gradient to the rest of its row.

The fraction moves between two known points:

* ``f = 1`` (COMM-OPT): every rank is a gradient worker: the decompositions go
  to everyone and no gradient is broadcast (d_kfac with layer-wise placement);
* ``f = 1/P`` (MEM-OPT): one gradient worker per layer, holding the layer's
  decompositions alone, broadcasting the preconditioned gradient to all
  (dp_kfac's preconditioning, with all-reduced factors);
* values in between (HYBRID) trade decomposition memory and traffic against
  gradient traffic.

The update is d_kfac's (the same all-reduced factors, the same maths) for every
fraction. The ablation switches of d_kfac (``triangle``,
``lazy_factor_sync``, ``placement``) apply too; ``placement="lpt"`` is KAISA's
own greedy, column-constrained placement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dpkfac.assignment import (
    LayerShape,
    Placement,
    factor_decomposition_cost,
    grad_worker_grid,
    kaisa_assign,
    round_robin_assign,
)
from dpkfac.comm import Communicator
from dpkfac.curvature import KFACLayer
from dpkfac.options import check_choice
from dpkfac.strategies.base import Preconditioned, Traits
from dpkfac.strategies.d_kfac import DKFAC, DKFACOptions

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


@dataclass(frozen=True)
class KAISAOptions(DKFACOptions):
    """Options of kaisa.

    Attributes:
        grad_worker_fraction: fraction f of the ranks that precondition each
            layer, in (0, 1], with f·P an integer dividing P; or "comm_opt"
            (f = 1) or "mem_opt" (f = 1/P), which name the two ends without
            knowing P (what a config file needs).
        triangle / placement / lazy_factor_sync: as for d_kfac
            (:class:`~dpkfac.strategies.d_kfac.DKFACOptions`); "lpt" is
            KAISA's greedy placement within gradient-worker columns.
    """

    grad_worker_fraction: float | str = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        f = self.grad_worker_fraction
        if isinstance(f, str):
            check_choice("grad_worker_fraction", f, NAMED_FRACTIONS)
        elif isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(
                f"grad_worker_fraction must be in (0, 1], 'comm_opt' or 'mem_opt', got {f!r}"
            )

    def grad_workers(self, world_size: int) -> int:
        """W = f·P, the gradient workers per layer (see :func:`grad_workers_of`)."""
        return grad_workers_of(self.grad_worker_fraction, world_size)


class KAISA(DKFAC):
    """All-reduced factors, column-wise decompositions, row-wise gradient broadcasts."""

    name = "kaisa"
    Options = KAISAOptions
    options: KAISAOptions

    @classmethod
    def traits(cls, options: KAISAOptions) -> Traits:  # type: ignore[override]
        return Traits(
            captures_all=True,
            factor_comm="allreduce",
            triangle=options.triangle,
            decomposition_broadcast=True,
            preconditions_all=options.grad_worker_fraction in (1, 1.0, "comm_opt"),
            lazy_factor_sync=options.lazy_factor_sync,
        )

    @classmethod
    def placement(  # type: ignore[override]
        cls, shapes: Sequence[LayerShape], world_size: int, options: KAISAOptions
    ) -> Placement:
        if options.placement == "layer_round_robin":
            return Placement.per_layer(round_robin_assign(len(shapes), world_size))
        costs = [
            factor_decomposition_cost(s.a_dim) + factor_decomposition_cost(s.g_dim) for s in shapes
        ]
        workers = options.grad_workers(world_size)
        return Placement.per_layer(kaisa_assign(costs, world_size, workers))

    @classmethod
    def preconditioners(  # type: ignore[override]
        cls, owner: int, world_size: int, options: KAISAOptions
    ) -> tuple[int, ...]:
        """The gradient workers of a layer: the column of its inverse worker."""
        columns, _ = grad_worker_grid(world_size, options.grad_workers(world_size))
        return tuple(columns[owner % len(columns)])

    @classmethod
    def decomposition_groups(  # type: ignore[override]
        cls, world_size: int, options: KAISAOptions
    ) -> list[list[int]]:
        columns, _ = grad_worker_grid(world_size, options.grad_workers(world_size))
        return columns

    @classmethod
    def update_groups(  # type: ignore[override]
        cls, world_size: int, options: KAISAOptions
    ) -> list[list[int]]:
        workers = options.grad_workers(world_size)
        return [] if workers == world_size else grad_worker_grid(world_size, workers)[1]

    def __init__(self, comm: Communicator, *args: Any, **kwargs: Any) -> None:
        super().__init__(comm, *args, **kwargs)
        self.grad_workers = self.options.grad_workers(self.world_size)
        self.columns, self.rows = grad_worker_grid(self.world_size, self.grad_workers)
        # Creating process groups is collective: every rank makes all of them.
        self._column_comms = comm.subgroups(self.columns)
        self._row_comms = comm.subgroups(self.rows)

    # ------------------------------------------------------------------ queries
    def column_of(self, rank: int) -> int:
        """The gradient-worker column a rank belongs to."""
        return rank % len(self.columns)

    def preconditions(self, layer: KFACLayer) -> bool:
        return self.column_of(layer.owner) == self.column_of(self.rank)

    def share_decompositions(
        self, layers: Sequence[KFACLayer], updated: set[tuple[str, str]]
    ) -> None:
        """Each inverse worker broadcasts its layers' decompositions to its column."""
        column = self.column_of(self.rank)
        comm = self._column_comms[column]
        self.broadcast_decompositions(comm, self.columns[column], layers, updated)

    def share_preconditioned(
        self,
        layers: Sequence[KFACLayer],
        results: dict[str, Preconditioned],
        *,
        with_kl: bool,
    ) -> dict[str, Preconditioned]:
        """Each row's gradient worker of a layer broadcasts its update to the row."""
        row = self.rank // len(self.columns)
        comm = self._row_comms[row]
        if not comm.active:
            return results

        def worked_by(rank: int) -> list[KFACLayer]:
            column = self.column_of(rank)
            return [
                x
                for x in layers
                if self.column_of(x.owner) == column and x.module.weight.grad is not None
            ]

        return self.broadcast_updates(comm, self.rows[row], worked_by, results, with_kl=with_kl)

    def state_dict(self) -> dict[str, Any]:
        return {"grad_workers": self.grad_workers}
