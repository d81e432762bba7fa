"""DP-KFAC: distributed preconditioning, no factor ever communicated.

Every layer has one owner. Only the owner captures the layer's inputs and
output gradients on its own local batch, builds A and G, decomposes them and
preconditions the layer's averaged gradient; the preconditioned gradients are
then broadcast from their owners, fused into one bucket per owner (split at a
size cap), so the number of broadcasts grows with P and not with the number
of layers.

``grad_reduction="owner"`` replaces the gradient all-reduce of the K-FAC
layers by a reduce onto each owner: a reduce plus a broadcast moves what one
all-reduce moves, so K-FAC then costs the communication of plain SGD.

``overlap=True`` does the gradient reduction, the owners' factor folds,
decompositions and preconditioning, and the broadcasts of the updates inside
the backward pass, from gradient hooks (:mod:`dpkfac.overlap`); ``step()``
then only waits for what is left and applies the KL clip. The update is the
same as without overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from dpkfac.assignment import ASSIGNMENTS, COSTS, CostFn, LayerShape, Placement, assign_layers
from dpkfac.curvature import KFACLayer
from dpkfac.options import StrategyOptions, check_choice
from dpkfac.overlap import OverlapEngine
from dpkfac.strategies.base import Preconditioned, Strategy, Traits

if TYPE_CHECKING:
    from dpkfac.preconditioner import KFACPreconditioner

GRAD_REDUCTIONS = ("allreduce", "owner")


@dataclass(frozen=True)
class DPKFACOptions(StrategyOptions):
    """Options of dp-kfac.

    Attributes:
        grad_reduction: "allreduce" (the published scheme) or "owner" (K-FAC
            layers' gradients reduced onto their owners).
        assignment: "lpt" (load balanced by ``assignment_cost``),
            "round_robin" (module order, as the released DP-KFAC code) or
            "best" (whichever of the two has the lower busiest-rank cost).
        assignment_cost: a name in :data:`dpkfac.assignment.COSTS` or a
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


class DPKFAC(Strategy):
    """Owner-only factors and preconditioning, broadcast of preconditioned gradients."""

    name = "dp_kfac"
    Options = DPKFACOptions
    options: DPKFACOptions

    @classmethod
    def traits(cls, options: DPKFACOptions) -> Traits:  # type: ignore[override]
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
    def placement(  # type: ignore[override]
        cls, shapes: Sequence[LayerShape], world_size: int, options: DPKFACOptions
    ) -> Placement:
        owners = assign_layers(
            shapes, world_size, cost=options.assignment_cost, method=options.assignment
        )
        return Placement.per_layer(owners)

    @classmethod
    def placement_uses_batch(cls, options: DPKFACOptions) -> bool:  # type: ignore[override]
        # Every balanced assignment prices the layers with the batch's rows,
        # which differ between ranks; round robin looks at the order only.
        return options.assignment != "round_robin"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.overlap: OverlapEngine | None = None

    def register_hooks(self, pre: KFACPreconditioner) -> None:
        if not self.options.overlap:
            return
        if pre.ddp:
            raise ValueError(
                "overlap=True with a DistributedDataParallel model: the overlap reduces the "
                "gradients itself; pass the unwrapped module"
            )
        if pre.grad_scaler is not None:
            raise ValueError(
                f"overlap=True does not support grad_scaler={pre.grad_scaler!r}: the overflow "
                "check would need the gradients before the hooks reduce them"
            )
        self.overlap = OverlapEngine(self, pre)

    def overlapped_updates(  # type: ignore[override]
        self, layers: Sequence[KFACLayer]
    ) -> dict[str, Preconditioned] | None:
        return None if self.overlap is None else self.overlap.finish()

    def captures(self, layer: KFACLayer) -> bool:
        # Before the final placement every rank captures, so the first step
        # loses nothing; non-owners then drop what they built.
        return not self.placed or layer.owner == self.rank

    def preconditions(self, layer: KFACLayer) -> bool:
        return layer.owner == self.rank

    # ---------------------------------------------------------- communication
    def reduce_gradients(
        self, layers: Sequence[KFACLayer], other_params: Sequence[nn.Parameter]
    ) -> None:
        if self.options.grad_reduction == "allreduce" or not self.comm.active:
            super().reduce_gradients(layers, other_params)
            return
        handles = []
        for owner in range(self.world_size):
            grads = [
                p.grad
                for layer in layers
                if layer.owner == owner
                for p in layer.helper.parameters()
                if p.grad is not None
            ]
            handles.append(
                self.comm.reduce_mean(
                    grads, owner, "grad_allreduce", cap_bytes=self.bucket_cap_bytes, async_op=True
                )
            )
        others = [p.grad for p in other_params if p.grad is not None]
        handles.append(
            self.comm.allreduce_mean(
                others, "grad_allreduce", cap_bytes=self.bucket_cap_bytes, async_op=True
            )
        )
        for handle in handles:
            self.comm.wait(handle)

    def share_preconditioned(
        self,
        layers: Sequence[KFACLayer],
        results: dict[str, Preconditioned],
        *,
        with_kl: bool,
    ) -> dict[str, Preconditioned]:
        if not self.comm.active:
            return results

        def owned_by(rank: int) -> list[KFACLayer]:
            return [x for x in layers if x.owner == rank and x.module.weight.grad is not None]

        return self.broadcast_updates(
            self.comm, range(self.world_size), owned_by, results, with_kl=with_kl
        )

    def state_dict(self) -> dict[str, Any]:
        return {"grad_reduction": self.options.grad_reduction}
