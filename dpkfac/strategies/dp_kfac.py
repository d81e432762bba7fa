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
the reduce-scatter, and the all-gather runs once per dtype. On gloo, which
cannot all-gather uneven shards, the updates travel by one broadcast per owner.

``overlap=True`` asks the preconditioner for its overlapped execution mode
(:mod:`dpkfac.overlap`): the gradient reduction (either kind), the owners'
factor folds, decompositions and preconditioning, and the exchange of the
updates run inside the backward pass, from DDP's communication hook on a DDP
model or from gradient hooks otherwise. The update is the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dpkfac.curvature import KFACLayer
from dpkfac.plan.dp_kfac import DPKFACOptions, DPKFACScheme
from dpkfac.strategies.base import (
    Preconditioned,
    Strategy,
    received_updates,
    sent_updates,
    update_buffers,
)

__all__ = ["DPKFAC", "DPKFACOptions"]


def _grads(layer: KFACLayer) -> list[torch.Tensor]:
    """The layer's parameter gradients (weight, then bias), those that exist."""
    return [g for p in layer.helper.parameters() if (g := p.grad) is not None]


class DPKFAC(Strategy[DPKFACOptions]):
    """Owner-only factors and preconditioning, broadcast of preconditioned gradients."""

    scheme = DPKFACScheme

    def _owned(self, layers: Sequence[KFACLayer]) -> list[list[KFACLayer]]:
        """Per rank, the layers it preconditions, with a gradient (the same on every rank)."""
        assert self.plan is not None, "gradients are reduced after placement"
        return sent_updates(self.plan, range(self.world_size), layers)

    def reduce_gradients(
        self, layers: Sequence[KFACLayer], other_params: Sequence[nn.Parameter]
    ) -> None:
        if not self.traits.owner_grad_reduction or not self.comm.active:
            super().reduce_gradients(layers, other_params)
            return
        shards = [[g for x in owned for g in _grads(x)] for owned in self._owned(layers)]
        cap, cat = self.bucket_cap_bytes, "grad_allreduce"
        if len({g.dtype for shard in shards for g in shard}) <= 1:
            handles = [self.comm.reduce_scatter_mean(shards, cat, cap_bytes=cap, async_op=True)]
        else:  # no single flat buffer: one rooted reduce per owner
            handles = [
                self.comm.reduce_mean(shard, r, cat, cap_bytes=cap, async_op=True)
                for r, shard in enumerate(shards)
            ]
        others = [g for p in other_params if (g := p.grad) is not None]
        handles.append(self.comm.allreduce_mean(others, cat, cap_bytes=cap, async_op=True))
        for handle in handles:
            self.comm.wait(handle)

    def share_preconditioned(
        self,
        layers: Sequence[KFACLayer],
        results: dict[str, Preconditioned],
        *,
        with_kl: bool,
    ) -> dict[str, Preconditioned]:
        """With owner reduction, every owner's updates reach every rank by one all-gather per
        round and dtype (the update matrices and, with the KL clip, their two scalars)."""
        if not self.traits.owner_grad_reduction or not self.comm.active:
            return super().share_preconditioned(layers, results, with_kl=with_kl)
        sent = self._owned(layers)
        buffers = [
            [
                b
                for x in owned
                for b in update_buffers(
                    x, results[x.name] if r == self.rank else None, with_kl=with_kl
                )
            ]
            for r, owned in enumerate(sent)
        ]
        dtypes = sorted({b.dtype for bs in buffers for b in bs}, key=str)
        handles = [
            self.comm.all_gather(
                [[b for b in bs if b.dtype == dtype] for bs in buffers],
                "precond_broadcast",
                cap_bytes=self.bucket_cap_bytes,
                async_op=True,
            )
            for dtype in dtypes
        ]
        for handle in handles:
            self.comm.wait(handle)
        out: dict[str, Preconditioned] = {}
        for owned, bs in zip(sent, buffers, strict=True):
            out.update(received_updates(owned, bs, with_kl=with_kl))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"grad_reduction": self.options.grad_reduction}
