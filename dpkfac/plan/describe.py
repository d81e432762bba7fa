"""Who does what, per strategy, in words: the role table of the design document.

Generated from the plans themselves (:meth:`Scheme.plan
<dpkfac.plan.scheme.Scheme.plan>` on a small example model), so the document
cannot drift from the code: a test compares the table in ``docs/design.md``
with :func:`role_table`, and ``python -m dpkfac.plan`` prints it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dpkfac.plan import scheme_of, scheme_options
from dpkfac.plan.assignment import LayerShape
from dpkfac.plan.roles import Plan

__all__ = ["EXAMPLES", "EXAMPLE_SHAPES", "role_rows", "role_table"]

#: The configurations the table shows: (label, strategy, options).
EXAMPLES: tuple[tuple[str, str, Mapping[str, Any]], ...] = (
    ("dp_kfac", "dp_kfac", {}),
    ("dp_kfac, owner reduction", "dp_kfac", {"grad_reduction": "owner"}),
    ("dp_kfac, overlap", "dp_kfac", {"overlap": True}),
    (
        "dp_kfac, owner reduction, overlap",
        "dp_kfac",
        {"grad_reduction": "owner", "overlap": True},
    ),
    ("d_kfac", "d_kfac", {}),
    ("spd_kfac", "spd_kfac", {"hardware": "v100_ib100"}),
    ("kaisa, f = 1 (COMM-OPT)", "kaisa", {"grad_worker_fraction": "comm_opt"}),
    ("kaisa, f = 1/2", "kaisa", {"grad_worker_fraction": 0.5}),
    ("kaisa, f = 1/P (MEM-OPT)", "kaisa", {"grad_worker_fraction": "mem_opt"}),
    ("grouped, k = 2, f = 1/2", "grouped", {"factor_group_size": 2, "grad_worker_fraction": 0.5}),
    ("grouped, k = 1, f = 1", "grouped", {"factor_group_size": 1, "grad_worker_fraction": 1.0}),
)

#: A small model with one wide layer, so that spd_kfac decomposes some factors locally.
EXAMPLE_SHAPES: tuple[LayerShape, ...] = (
    LayerShape.conv2d("conv1", 3, 64, (3, 3), (32, 32), batch_size=32),
    LayerShape.conv2d("conv2", 64, 128, (3, 3), (16, 16), batch_size=32),
    LayerShape.linear("fc1", 8192, 4096, batch_size=32),
    LayerShape.linear("fc2", 4096, 10, batch_size=32),
)

COLUMNS = (
    "configuration",
    "factors built by",
    "factor traffic",
    "decomposed by",
    "decompositions sent to",
    "preconditioned by",
    "updates sent",
    "gradients",
)


def _ranks(n: int, world_size: int, who: str) -> str:
    if n == world_size:
        return "every rank"
    return who if n == 1 else f"{who}'s group of {n}"


def _row(label: str, plan: Plan) -> dict[str, str]:
    t, p = plan.traits, plan.world_size
    k = len(plan.factor_group(0))
    traffic = {"none": "none", "allreduce": "all-reduce", "pipelined": "all-reduce from the hooks"}
    factor = traffic[t.factor_comm] if k > 1 else "none"
    if factor != "none":
        scope = "" if k == p else " within the group"
        lazy = ", running averages before decompositions" if t.lazy_factor_sync else ""
        factor += scope + (", triangles" if t.triangle else "") + lazy
    owners = [(plan.decomposer(i, "A"), plan.decomposer(i, "G")) for i in range(len(plan))]
    per_layer = all(a == g for a, g in owners)
    decomposed = "the owner, both factors" if per_layer else "one rank per factor (LPT)"
    if any(a is None or g is None for a, g in owners):
        decomposed += "; small ones on every rank"
    dgroup = plan.decomposition_group(0)
    sent = "nowhere" if dgroup is None else _ranks(len(dgroup), p, "the decomposer")
    workers = len(plan.preconditioners[0])
    ugroup = plan.update_group(0)
    updates = (
        "none"
        if ugroup is None
        else (
            "to every rank, from the owner"
            if len(ugroup) == p
            else f"within rows of {len(ugroup)}, from the row's gradient worker"
        )
    )
    grads = "reduced onto owners" if t.owner_grad_reduction else "all-reduced"
    if t.overlapped_precondition:
        grads += ", in the backward pass"
        updates += ", in the backward pass"
    return {
        "configuration": label,
        "factors built by": _ranks(k, p, "the owner"),
        "factor traffic": factor,
        "decomposed by": decomposed,
        "decompositions sent to": sent,
        "preconditioned by": _ranks(workers, p, "the owner"),
        "updates sent": updates,
        "gradients": grads,
    }


def role_rows(world_size: int = 4, shapes: Sequence[LayerShape] = ()) -> list[dict[str, str]]:
    """One row per configuration of :data:`EXAMPLES`, read from its plan."""
    shapes = list(shapes or EXAMPLE_SHAPES)
    rows = []
    for label, name, values in EXAMPLES:
        plan = scheme_of(name).plan(shapes, world_size, scheme_options(name, values))
        rows.append(_row(label, plan))
    return rows


def role_table(world_size: int = 4) -> str:
    """The role table as Markdown, at ``world_size`` ranks."""
    rows = role_rows(world_size)
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r[c] for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"
