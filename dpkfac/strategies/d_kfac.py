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
from typing import Any, ClassVar, Protocol, cast

from dpkfac.curvature import KFACLayer
from dpkfac.curvature.layer import FACTORS
from dpkfac.plan import Scheme
from dpkfac.plan.d_kfac import DKFACOptions, DKFACScheme
from dpkfac.strategies.base import OptionsT, Strategy

__all__ = ["DKFAC", "DKFACOptions", "FactorSyncOptions"]


class FactorSyncOptions(Protocol):
    """What d_kfac's factor traffic reads of the options.

    d_kfac's, kaisa's and grouped's options have both; spd_kfac, whose
    options do not, replaces that traffic (``reduce_factors``, ``sync_factors``).
    """

    @property
    def triangle(self) -> bool: ...

    @property
    def lazy_factor_sync(self) -> bool: ...


class DKFAC(Strategy[OptionsT]):
    """All-reduced factors, placed decompositions, local preconditioning everywhere.

    Generic over its options so that kaisa, grouped and spd_kfac, which
    extend it, read their own (d_kfac itself runs with ``DKFACOptions``).
    """

    # The base's type: spd_kfac, a subclass, runs a scheme that is not d_kfac's.
    scheme: ClassVar[type[Scheme]] = DKFACScheme

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        #: Lazy sync: whether the running factors changed since they were last averaged.
        self.unsynced = False
        super().__init__(*args, **kwargs)

    @property
    def factor_sync(self) -> FactorSyncOptions:
        """The options' ``triangle`` and ``lazy_factor_sync`` (see :class:`FactorSyncOptions`)."""
        # Every subclass whose options lack them overrides the methods reading them.
        return cast(FactorSyncOptions, self.options)

    def reduce_factors(self, layers: Sequence[KFACLayer]) -> None:
        if self.factor_sync.lazy_factor_sync:
            # Folded into local running averages; averaged before the next decomposition.
            self.unsynced = self.unsynced or any(
                layer.has_pending(w) for layer in layers for w in FACTORS
            )
            return
        items = [(layer, w) for layer in layers for w in FACTORS if layer.has_pending(w)]
        tensors = [layer.pending_factor(w) for layer, w in items]
        self.factor_comm.allreduce_mean(
            tensors,
            "factor_allreduce",
            triangle=self.factor_sync.triangle,
            cap_bytes=self.bucket_cap_bytes,
        )
        for (layer, which), tensor in zip(items, tensors, strict=True):
            layer.set_pending(which, tensor)

    def sync_factors(self, layers: Sequence[KFACLayer]) -> None:
        """Lazy sync: average the running factors across ranks, in place, before decomposing."""
        if not self.factor_sync.lazy_factor_sync or not self.unsynced:
            return
        self.unsynced = False
        tensors = [layer.factor(w) for layer in layers for w in FACTORS]
        self.factor_comm.allreduce_mean(
            [t for t in tensors if t is not None],
            "factor_allreduce",
            triangle=self.factor_sync.triangle,
            cap_bytes=self.bucket_cap_bytes,
        )
