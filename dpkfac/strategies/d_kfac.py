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

from dpkfac.assignment import LayerShape, Placement, assign_factors
from dpkfac.curvature import KFACLayer
from dpkfac.curvature.decomposition import working_dtype
from dpkfac.curvature.layer import FACTORS
from dpkfac.options import StrategyOptions
from dpkfac.strategies.base import Strategy, Traits


class DKFAC(Strategy):
    """All-reduced factors, placed decompositions, local preconditioning everywhere."""

    name = "d_kfac"

    @classmethod
    def traits(cls, options: StrategyOptions) -> Traits:
        return Traits(
            captures_all=True,
            factor_comm="allreduce",
            triangle=False,
            decomposition_broadcast=True,
            preconditions_all=True,
        )

    @classmethod
    def local_threshold(cls, options: StrategyOptions) -> int | None:
        """Factors below this dimension are decomposed on every rank (None: none are)."""
        return None

    @classmethod
    def placement(
        cls, shapes: Sequence[LayerShape], world_size: int, options: StrategyOptions
    ) -> Placement:
        dims = [d for s in shapes for d in (s.a_dim, s.g_dim)]
        threshold = cls.local_threshold(options)
        return Placement.per_factor(assign_factors(dims, world_size, local_threshold=threshold))

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
                if (layer.name, w) in updated and layer.factors[w].owner == src
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
