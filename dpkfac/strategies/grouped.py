"""grouped: one design space from DP-KFAC to D-KFAC (:mod:`dpkfac.plan.grouped`).

The runtime is KAISA's within factor groups: batch factors are averaged over
the factor group of the layer's owner (the plan's ``factor_groups``), the
owner broadcasts the decompositions to its gradient-worker column and each
row's gradient worker broadcasts the update. What is its own: a gradient
worker outside the owner's factor group holds no factor of the layer yet must
receive its decompositions, and the (k, f) chosen by "auto" is part of a
checkpoint. The choice itself is the cost model's
(:func:`dpkfac.costmodel.choose_options`), made by the preconditioner at the first step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from dpkfac.curvature import KFACLayer
from dpkfac.curvature.layer import FACTORS
from dpkfac.plan.grouped import GroupedOptions, GroupedScheme
from dpkfac.strategies.base import Strategy

__all__ = ["GroupedKFAC", "GroupedOptions"]


class GroupedKFAC(Strategy[GroupedOptions]):
    """Factors averaged within groups of k ranks, preconditioning by W = f·P gradient workers."""

    scheme = GroupedScheme

    @property
    def factor_group_size(self) -> int | None:
        """k, once chosen (None while "auto")."""
        return self.options.group_size(self.world_size) if self.options.resolved else None

    @property
    def grad_worker_fraction(self) -> float | None:
        """f, once chosen (None while "auto")."""
        if not self.options.resolved:
            return None
        return self.options.grad_workers(self.world_size) / self.world_size

    def share_decompositions(
        self, layers: Sequence[KFACLayer], updated: set[tuple[str, str]]
    ) -> None:
        """Each owner broadcasts its layers' decompositions to its column.

        ``updated`` names the factors held here; a gradient worker outside the
        owner's factor group holds none of that layer's, yet must receive. A
        layer counts as decomposed wherever it was ever called in training at
        a factor step (``ever_seen``, set on every rank: the ranks run the
        same forward, so a layer first used after the first step is known to
        the receivers too), or where its factors or decompositions are held (a
        restored checkpoint), which every member of a column agrees on.
        """
        due = set(updated) | {
            (x.name, w)
            for x in layers
            for w in FACTORS
            if x.ever_seen or x.factor(w) is not None or x.decomposition(w) is not None
        }
        super().share_decompositions(layers, due)

    def state_dict(self) -> dict[str, Any]:
        return {
            "factor_group_size": self.factor_group_size,
            "grad_worker_fraction": self.grad_worker_fraction,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the saved (k, f) where this run has not chosen yet; a fixed one must match."""
        k, f = state.get("factor_group_size"), state.get("grad_worker_fraction")
        if k is None or f is None:
            return
        if self.options.resolved:
            if (self.factor_group_size, self.grad_worker_fraction) != (k, f):
                raise ValueError(
                    f"checkpoint was saved with factor_group_size={k}, grad_worker_fraction={f} "
                    f"but this run has {self.factor_group_size}, {self.grad_worker_fraction}"
                )
            return
        self.configure(replace(self.options, factor_group_size=int(k), grad_worker_fraction=f))
