"""D-KFAC: the data-parallel K-FAC baseline (MPD-KFAC in the papers).

Every rank builds every layer's factors on its local batch; the batch factors
are averaged by fused all-reduces; each factor's decomposition is computed by
the rank the plan places it on (:mod:`dpkfac.plan.d_kfac`) and broadcast in
one fused bucket per source rank; every rank then preconditions every layer
locally. With lazy synchronisation (the default) the ranks' local running
averages are averaged on decomposition steps instead of every batch factor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dpkfac.curvature import KFACLayer
from dpkfac.curvature.layer import FACTORS
from dpkfac.plan.d_kfac import DKFACOptions, DKFACScheme
from dpkfac.strategies.base import Strategy

__all__ = ["DKFAC", "DKFACOptions"]


class DKFAC(Strategy):
    """All-reduced factors, placed decompositions, local preconditioning everywhere."""

    scheme: type[DKFACScheme] = DKFACScheme
    options: DKFACOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: Lazy sync: whether the running factors changed since they were last averaged.
        self.unsynced = False
        super().__init__(*args, **kwargs)

    def reduce_factors(self, layers: Sequence[KFACLayer]) -> None:
        if self.options.lazy_factor_sync:
            # Folded into local running averages; averaged before the next decomposition.
            self.unsynced = self.unsynced or any(
                layer.has_pending(w) for layer in layers for w in FACTORS
            )
            return
        items = [(layer, w) for layer in layers for w in FACTORS if layer.has_pending(w)]
        tensors = [layer.pending(w) for layer, w in items]
        self.factor_comm.allreduce_mean(
            tensors,
            "factor_allreduce",
            triangle=self.options.triangle,
            cap_bytes=self.bucket_cap_bytes,
        )
        for (layer, which), tensor in zip(items, tensors, strict=True):
            layer.set_pending(which, tensor)

    def sync_factors(self, layers: Sequence[KFACLayer]) -> None:
        """Lazy sync: average the running factors across ranks, in place, before decomposing."""
        if not self.options.lazy_factor_sync or not self.unsynced:
            return
        self.unsynced = False
        tensors = [layer.factor(w) for layer in layers for w in FACTORS]
        self.factor_comm.allreduce_mean(
            [t for t in tensors if t is not None],
            "factor_allreduce",
            triangle=self.options.triangle,
            cap_bytes=self.bucket_cap_bytes,
        )
