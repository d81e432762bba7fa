"""D-KFAC: the data-parallel K-FAC baseline (MPD-KFAC in the papers).

Every rank builds every layer's factors on its local batch; the batch factors
are averaged by fused all-reduces; each factor's decomposition is computed by
the rank the plan places it on (:mod:`dpkfac.plan.d_kfac`) and broadcast in
one fused bucket per source rank; every rank then preconditions every layer
locally. With lazy synchronisation (the default) the ranks' local running
averages are averaged on decomposition steps instead of every batch factor.

All of it is the base strategy's, driven by the plan's traits (``factor_comm``,
``triangle``, ``lazy_factor_sync``) and roles: nothing here is D-KFAC's own.
"""

from __future__ import annotations

from dpkfac.plan.d_kfac import DKFACOptions, DKFACScheme
from dpkfac.strategies.base import Strategy

__all__ = ["DKFAC", "DKFACOptions"]


class DKFAC(Strategy[DKFACOptions]):
    """All-reduced factors, placed decompositions, local preconditioning everywhere."""

    scheme = DKFACScheme
