"""What a distribution scheme does at each point of an iteration, as plain flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Traits"]


@dataclass(frozen=True)
class Traits:
    """What a scheme does at each point of an iteration, in the cost model's terms.

    The runtime and the cost model read these from a :class:`~dpkfac.plan.Plan`,
    never a scheme's name, so a new scheme is run and predicted as soon as it
    states its traits and roles.

    Attributes:
        captures_all: every rank builds every layer's factors (False: the
            factor group of the layer's owner does, each member from its local batch).
        factor_comm: how batch factors are averaged: "none" (never sent),
            "allreduce" (fused all-reduces in ``step()``) or "pipelined"
            (launched from the capture hooks, one collective per fusion bucket).
        triangle: factors travel as packed upper triangles.
        decomposition_broadcast: decompositions are broadcast from their decomposers.
        preconditions_all: every rank preconditions every layer (False: the
            layer's gradient workers do and broadcast the result).
        owner_grad_reduction: K-FAC layers' gradients are reduced onto their
            owners instead of all-reduced.
        lazy_factor_sync: with ``factor_comm="allreduce"``, the running
            averages are all-reduced on decomposition steps only, instead of
            the batch factors on every factor step.
        overlapped_precondition: gradient reduction, preconditioning and the
            broadcast of preconditioned updates run from gradient hooks during
            the backward pass (the preconditioner's overlapped execution
            mode), so their communication overlaps it as far as the hardware does.
        drain: in the overlapped mode, when a bucket's layers are preconditioned and their
            updates exchanged: "last", once the backward pass has launched every bucket
            (the work stays out of the hooks that launch later buckets), or "ready", from
            the first hook that finds the bucket's K-FAC part reduced (the exchanges use
            the link while the backward pass still runs, the work holds back later buckets).
    """

    captures_all: bool
    factor_comm: Literal["none", "allreduce", "pipelined"]
    triangle: bool
    decomposition_broadcast: bool
    preconditions_all: bool
    owner_grad_reduction: bool = False
    lazy_factor_sync: bool = False
    overlapped_precondition: bool = False
    drain: Literal["last", "ready"] = "last"

    def drains_in_hooks(self, decompose: bool) -> bool:
        """Whether the overlapped mode preconditions and exchanges buckets from the hooks
        before the last launch (``drain="ready"``) on a step that does (``decompose``) or
        does not decompose. Never on a decomposition step: its decompositions there would
        hold back every later bucket's launch, where after the last launch the transfers
        still on the wire hide behind them."""
        return self.overlapped_precondition and self.drain == "ready" and not decompose
