"""Predicted cost per second-order update, one row per model and strategy configuration.

For each: the busiest rank's K-FAC computation (factor construction,
decomposition, preconditioning), the communication K-FAC adds to plain data
parallelism, the busiest rank's K-FAC memory, and the iteration time against
SGD's. The DP-KFAC paper's headline (these costs of dp_kfac against the best
of :data:`dpkfac.plan.configs.BASELINES`) is one table, ``results/paper.md``
(:mod:`experiments.bench.paper`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dpkfac.costmodel.predict import predict, predict_sgd
from dpkfac.options import KFACOptions
from dpkfac.plan import scheme_of
from dpkfac.plan.assignment import LayerShape
from dpkfac.plan.configs import kfac_configs
from dpkfac.plan.hardware import Hardware
from dpkfac.plan.presets import PRESETS

__all__ = ["VARIANTS", "format_table", "predicted_table"]

#: Table rows: every configuration that preconditions (label -> (strategy, options)).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = kfac_configs()

ModelSpec = Sequence[LayerShape] | tuple[Sequence[LayerShape], KFACOptions]


def predicted_table(
    models: Mapping[str, ModelSpec],
    world_size: int = 64,
    hardware: Hardware | None = None,
    variants: Mapping[str, tuple[str, Mapping[str, Any]]] = VARIANTS,
    *,
    kfac: KFACOptions | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """One row per model and strategy variant.

    Args:
        models: name -> shapes, or name -> (shapes, the preconditioner's
            options for that model), e.g. :data:`dpkfac.costmodel.zoo.PAPER_MODELS`.
        world_size: number of ranks.
        hardware: device and network model (default: ``v100_ib100``).
        variants: label -> (strategy, strategy options) rows per model.
        kfac: the preconditioner's options of models that bring none.
        **options: further :func:`~dpkfac.costmodel.predict` arguments shared
            by every row (``param_itemsize``, ``ddp``, ``bias``, ``other_params``).

    Returns:
        Rows with ``model``, ``strategy`` (the variant's label),
        ``computation_s``, ``communication_s`` (added to SGD's),
        ``total_communication_s`` (gradients included), ``memory_mb``,
        ``kfac_wire_mb`` (wire MiB per rank and update beyond SGD's),
        ``iteration_s``, ``sgd_iteration_s`` and ``configuration`` (what it chose).
    """
    hw = hardware or PRESETS["v100_ib100"]
    rows: list[dict[str, Any]] = []
    for model_name, spec in models.items():
        shapes, model_kfac = spec if isinstance(spec, tuple) else (spec, kfac)
        common = {"world_size": world_size, "hardware": hw, "kfac": model_kfac, **options}
        sgd = predict_sgd(shapes, **common)
        sgd_wire = sum(c.wire_bytes for c in sgd.update.collectives)
        for label, (strategy, extra) in variants.items():
            pred = predict(shapes, strategy=strategy, options=extra, **common)
            assert pred.options is not None  # a prediction with a strategy has its options
            wire = sum(c.wire_bytes for c in pred.update.collectives)
            rows.append(
                {
                    "model": model_name,
                    "strategy": label,
                    "computation_s": pred.computation,
                    "communication_s": pred.communication,
                    "total_communication_s": sum(pred.update.comm_serial.values()),
                    "memory_mb": pred.memory_max / 2**20,
                    "kfac_wire_mb": (wire - sgd_wire) / 2**20,
                    "iteration_s": pred.iteration,
                    "sgd_iteration_s": sgd.iteration,
                    "configuration": scheme_of(strategy).describe(pred.options),
                }
            )
    return rows


#: The printout's number columns: header, the row's key and the scale it is printed at.
_COLUMNS = (
    ("computation (ms)", "computation_s", 1e3),
    ("communication (ms)", "communication_s", 1e3),
    ("memory (MiB)", "memory_mb", 1.0),
    ("K-FAC wire (MiB)", "kfac_wire_mb", 1.0),
    ("comm. incl. gradients (ms)", "total_communication_s", 1e3),
    ("iteration (ms)", "iteration_s", 1e3),
    ("SGD iteration (ms)", "sgd_iteration_s", 1e3),
)


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one line per model and configuration."""
    lines = [
        "| model | strategy | " + " | ".join(head for head, _, _ in _COLUMNS) + " |",
        "|" + "---|" * (2 + len(_COLUMNS)),
    ]
    for r in rows:
        # + 0.0: no "-0.0" from round-off
        cells = [f"{round(r[key] * scale, 1) + 0.0:.1f}" for _, key, scale in _COLUMNS]
        # The strategy, with what it chose (grouped's k and f) when it chose anything.
        chosen = r.get("configuration")
        label = f"{r['strategy']} ({chosen})" if chosen else r["strategy"]
        lines.append(f"| {r['model']} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
