"""KAISA: D-KFAC with a gradient-worker fraction (Pauloski et al., arXiv 2007.00784).

The roles come from its plan (:mod:`dpkfac.plan.kaisa`): factors all-reduced
over every rank as in d_kfac; each layer's inverse worker decomposes both of
its factors and broadcasts them to its gradient-worker column; every gradient
worker preconditions the layer, and each row's gradient worker broadcasts the
update to the rest of its row. Those broadcasts are the base class's, over
the groups the plan names, so nothing here is KAISA's own but its state.
"""

from __future__ import annotations

from typing import Any

from dpkfac.plan.kaisa import KAISAOptions, KAISAScheme
from dpkfac.strategies.base import Strategy

__all__ = ["KAISA", "KAISAOptions"]


class KAISA(Strategy[KAISAOptions]):
    """All-reduced factors, column-wise decompositions, row-wise gradient broadcasts."""

    scheme = KAISAScheme

    @property
    def grad_workers(self) -> int:
        """W = f·P, the gradient workers per layer."""
        return self.options.grad_workers(self.world_size)

    def state_dict(self) -> dict[str, Any]:
        return {"grad_workers": self.grad_workers}
