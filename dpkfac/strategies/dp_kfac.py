"""DP-KFAC: distributed preconditioning, no factor ever communicated.

Every layer has one owner (:mod:`dpkfac.plan.dp_kfac`). Only the owner
captures the layer's inputs and output gradients on its own local batch,
builds A and G, decomposes them and preconditions the layer's averaged
gradient; the preconditioned gradients are then broadcast from their owners,
fused into one bucket per owner (split at a size cap), so the number of
broadcasts grows with P and not with the number of layers.

``grad_reduction="owner"`` replaces the gradient all-reduce of the K-FAC
layers by one reduce-scatter over owner-contiguous buffers (each owner gets
the average of its own layers' gradients), and the broadcasts of the updates
by one all-gather, as ZeRO-style training does: a reduce-scatter plus an
all-gather move what one all-reduce moves, so K-FAC then costs the
communication of plain SGD, in two collectives per bucket round whatever P is
(:meth:`~dpkfac.comm.Communicator.reduce_scatter_mean`). Shards are unpadded:
each owner's is as large as its layers (uneven collectives). Where the K-FAC
gradients are of several dtypes, one rooted reduce per owner is used instead of
the reduce-scatter, and the all-gather runs once per dtype. On gloo, whose
reduce-scatter sends an all-reduce's bytes and which cannot all-gather uneven
shards, both go by alltoallv
(:func:`~dpkfac.plan.hardware.sharded_by_alltoall`).

``overlap=True`` asks the preconditioner for its overlapped execution mode
(:mod:`dpkfac.overlap`): the gradient reduction (either kind), the owners'
factor folds, decompositions and preconditioning, and the exchange of the
updates run inside the backward pass, from DDP's communication hook on a DDP
model or from gradient hooks otherwise. The update is the same.
"""

from __future__ import annotations

from typing import Any

from dpkfac.plan.dp_kfac import DPKFACOptions, DPKFACScheme
from dpkfac.strategies.base import Strategy

__all__ = ["DPKFAC", "DPKFACOptions"]


class DPKFAC(Strategy[DPKFACOptions]):
    """Owner-only factors and preconditioning, broadcast of preconditioned gradients."""

    scheme = DPKFACScheme

    def state_dict(self) -> dict[str, Any]:
        return {"grad_reduction": self.options.grad_reduction}
