"""DP-KFAC: distributed preconditioning, no factor ever communicated.

Every layer has one owner (:mod:`dpkfac.plan.dp_kfac`). Only the owner
captures the layer's inputs and output gradients on its own local batch,
builds A and G, decomposes them and preconditions the layer's averaged
gradient; the preconditioned gradients are then broadcast from their owners,
fused into one bucket per owner (split at a size cap), so the number of
broadcasts grows with P and not with the number of layers.

``grad_reduction="owner"`` replaces the gradient all-reduce of the K-FAC
layers by a reduce onto each owner: a reduce plus a broadcast moves what one
all-reduce moves, so K-FAC then costs the communication of plain SGD.

``overlap=True`` asks the preconditioner for its overlapped execution mode
(:mod:`dpkfac.overlap`): the gradient reduction, the owners' factor folds,
decompositions and preconditioning, and the broadcasts of the updates run
inside the backward pass, from gradient hooks. The update is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from dpkfac.curvature import KFACLayer
from dpkfac.plan.dp_kfac import DPKFACOptions, DPKFACScheme
from dpkfac.strategies.base import Strategy

__all__ = ["DPKFAC", "DPKFACOptions"]


class DPKFAC(Strategy[DPKFACOptions]):
    """Owner-only factors and preconditioning, broadcast of preconditioned gradients."""

    scheme = DPKFACScheme

    def reduce_gradients(
        self, layers: Sequence[KFACLayer], other_params: Sequence[nn.Parameter]
    ) -> None:
        if not self.traits.owner_grad_reduction or not self.comm.active:
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

    def state_dict(self) -> dict[str, Any]:
        return {"grad_reduction": self.options.grad_reduction}
