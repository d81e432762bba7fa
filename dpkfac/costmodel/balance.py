"""Load balance of DP-KFAC's layer placement on the papers' models.

DP-KFAC gives every K-FAC layer one owner that builds its factors from the
local batch, decomposes them and preconditions the layer, and the step waits
for the busiest owner. So the number that matters for a placement is the
busiest rank's load over the mean load (1.0 is a perfect split). This module
reports it for each of :data:`dpkfac.plan.assignment.ASSIGNMENTS` (the published
round robin, LPT on a cost model, and the better of the two) on the analytic
shapes of :mod:`dpkfac.costmodel.zoo`, with the very functions the strategy
places its layers with. ``python -m dpkfac.costmodel balance`` prints it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dpkfac.plan.assignment import (
    ASSIGNMENTS,
    COSTS,
    LayerShape,
    assign_layers,
    load_imbalance,
    rank_loads,
)

__all__ = ["Balance", "balance_rows", "format_balance"]


@dataclass(frozen=True)
class Balance:
    """Load balance of one model's layer placement at one world size.

    Attributes:
        layers: K-FAC layers placed.
        cost: name of the cost function in :data:`dpkfac.plan.assignment.COSTS`.
        imbalance: per assignment, the busiest rank's load over the mean.
        lower_bound: the least possible busiest-over-mean ratio: the largest
            single layer or the even split, whichever is larger, over the mean.
    """

    model: str
    world_size: int
    layers: int
    cost: str
    imbalance: Mapping[str, float]
    lower_bound: float


def balance_rows(
    models: Mapping[str, Sequence[LayerShape]],
    world_size: int,
    cost: str = "compute",
    assignments: Sequence[str] = ASSIGNMENTS,
) -> list[Balance]:
    """The busiest rank over the mean under each assignment, per model.

    Args:
        models: name -> K-FAC layer shapes in module order.
        cost: layer cost the assignments balance and the loads are measured in.
        assignments: methods of :func:`dpkfac.plan.assignment.assign_layers`.

    Raises:
        ValueError: an unknown cost or assignment, or a world size below 1.
    """
    if cost not in COSTS:
        raise ValueError(f"unknown cost {cost!r}; expected one of {sorted(COSTS)}")
    fn = COSTS[cost]
    out = []
    for name, shapes in models.items():
        layers = list(shapes)
        costs = [fn(s) for s in layers]
        mean = sum(costs) / world_size
        imbalance = {}
        for method in assignments:
            owners = assign_layers(layers, world_size, cost=cost, method=method)
            imbalance[method] = load_imbalance(rank_loads(owners, costs, world_size))
        bound = max(max(costs), mean) / mean
        out.append(Balance(name, world_size, len(layers), cost, imbalance, bound))
    return out


def format_balance(rows: Sequence[Balance]) -> str:
    """Markdown: one line per model, busiest over mean per assignment and the lower bound."""
    methods = list(dict.fromkeys(m for r in rows for m in r.imbalance))
    head = "| model | P | layers | " + " | ".join(methods) + " | lower bound |"
    lines = [head, "|---|---:|---:|" + "---:|" * (len(methods) + 1)]
    for r in rows:
        cells = " | ".join(f"{r.imbalance[m]:.3f}" for m in methods)
        lines.append(f"| {r.model} | {r.world_size} | {r.layers} | {cells} | {r.lower_bound:.3f} |")
    return "\n".join(lines)
