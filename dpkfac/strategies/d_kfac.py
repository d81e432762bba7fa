"""D-KFAC: the data-parallel K-FAC baseline (MPD-KFAC in the papers).

Every rank builds every layer's factors on its local batch; the batch factors
are averaged by fused all-reduces; each factor's decomposition is placed on
one rank by LPT load balancing (A and G of one layer may land on different
ranks), computed there and broadcast in one fused bucket per source rank;
every rank then preconditions every layer locally.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dpkfac.assignment import LayerShape, assign_factors
from dpkfac.curvature import KFACLayer
from dpkfac.curvature.decomposition import working_dtype
from dpkfac.curvature.layer import FACTORS
from dpkfac.strategies.base import Strategy


class DKFAC(Strategy):
    """All-reduced factors, placed decompositions, local preconditioning everywhere."""

    name = "d-kfac"

    def local_threshold(self) -> int | None:
        """Factors below this dimension are decomposed on every rank (None: none are)."""
        return None

    def place(self, layers: Sequence[KFACLayer], shapes: Sequence[LayerShape]) -> None:
        dims = [d for layer in layers for d in (layer.helper.a_dim, layer.helper.g_dim)]
        owners = assign_factors(dims, self.world_size, local_threshold=self.local_threshold())
        for i, layer in enumerate(layers):
            layer.a_owner, layer.g_owner = owners[2 * i], owners[2 * i + 1]
            placed = [o for o in (layer.a_owner, layer.g_owner) if o is not None]
            layer.owner = placed[0] if placed else -1

    def captures(self, layer: KFACLayer) -> bool:
        return True

    def preconditions(self, layer: KFACLayer) -> bool:
        return True

    def reduce_factors(self, layers: Sequence[KFACLayer]) -> None:
        items = [(layer, w) for layer in layers for w in FACTORS if layer.has_pending(w)]
        tensors = [layer.pending(w) for layer, w in items]
        self.comm.allreduce_mean(tensors, "factor_allreduce", cap_bytes=self.bucket_cap_bytes)
        for (layer, which), tensor in zip(items, tensors, strict=True):
            layer.set_pending(which, tensor)

    def share_decompositions(
        self, layers: Sequence[KFACLayer], updated: set[tuple[str, str]]
    ) -> None:
        if not self.comm.active:
            return
        pending = []
        for src in range(self.world_size):
            items = [
                (layer, w)
                for layer in layers
                for w in FACTORS
                if (layer.name, w) in updated
                and (layer.a_owner if w == "A" else layer.g_owner) == src
            ]
            if not items:
                continue
            tensors: list[torch.Tensor] = []
            for layer, which in items:
                if src == self.rank:
                    tensors += layer.decomposition(which).tensors()
                else:
                    factor = layer.factor(which)
                    dtype = working_dtype(factor.dtype, self.decomposition_dtype)
                    tensors += [
                        torch.empty(shape, dtype=dtype, device=factor.device)
                        for shape in self.method.shapes(factor.shape[0])
                    ]
            handle = self.comm.broadcast(
                tensors,
                src,
                "decomposition_broadcast",
                cap_bytes=self.bucket_cap_bytes,
                async_op=True,
            )
            pending.append((src, items, tensors, handle))
        for src, items, tensors, handle in pending:
            self.comm.wait(handle)
            if src == self.rank:
                continue
            offset = 0
            for layer, which in items:
                count = len(self.method.shapes(1))
                layer.set_decomposition(
                    which, self.method.from_tensors(tensors[offset : offset + count])
                )
                offset += count
