"""The DP-KFAC paper's headline table, predicted: cost per second-order update at 64 GPUs.

For each model and strategy variant: the busiest rank's K-FAC computation
(factor construction, decomposition, preconditioning), the communication
K-FAC adds to plain data parallelism, the busiest rank's K-FAC memory, and
the iteration time against SGD's. Every row that is not a baseline carries
the ratios the paper reports ("how many times lower"): each baseline of
:data:`dpkfac.plan.configs.BASELINES` over the row (``<metric>_x_d_kfac``, ...)
and the best (cheapest) baseline over the row (``<metric>_x_best``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dpkfac.costmodel.predict import predict, predict_sgd
from dpkfac.options import KFACOptions
from dpkfac.plan import scheme_of
from dpkfac.plan.assignment import LayerShape
from dpkfac.plan.configs import BASELINES, kfac_configs
from dpkfac.plan.hardware import Hardware
from dpkfac.plan.presets import PRESETS

__all__ = ["BASELINES", "VARIANTS", "format_table", "predicted_table"]

#: Table rows: every configuration that preconditions (label -> (strategy, options)).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = kfac_configs()
_METRICS = ("computation_s", "communication_s", "memory_mb", "total_communication_s")

ModelSpec = Sequence[LayerShape] | tuple[Sequence[LayerShape], KFACOptions]


def predicted_table(
    models: Mapping[str, ModelSpec],
    world_size: int = 64,
    hardware: Hardware | None = None,
    variants: Mapping[str, tuple[str, Mapping[str, Any]]] = VARIANTS,
    *,
    kfac: KFACOptions | None = None,
    baselines: Sequence[str] = BASELINES,
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
        baselines: labels of ``variants`` every other row is compared with.
        **options: further :func:`~dpkfac.costmodel.predict` arguments shared
            by every row (``param_itemsize``, ``ddp``, ``bias``, ``other_params``).

    Returns:
        Rows with ``model``, ``strategy`` (the variant's label),
        ``computation_s``, ``communication_s`` (added to SGD's),
        ``total_communication_s`` (gradients included), ``memory_mb``,
        ``kfac_wire_mb`` (wire MiB per rank and update beyond SGD's),
        ``iteration_s``, ``sgd_iteration_s`` and, on rows that are not
        baselines, ``<metric>_x_<baseline>`` and ``<metric>_x_best``.
    """
    hw = hardware or PRESETS["v100_ib100"]
    rows: list[dict[str, Any]] = []
    for model_name, spec in models.items():
        shapes, model_kfac = spec if isinstance(spec, tuple) else (spec, kfac)
        common = {"world_size": world_size, "hardware": hw, "kfac": model_kfac, **options}
        sgd = predict_sgd(shapes, **common)
        sgd_wire = sum(c.wire_bytes for c in sgd.update.collectives)
        by_label: dict[str, dict[str, Any]] = {}
        for label, (strategy, extra) in variants.items():
            pred = predict(shapes, strategy=strategy, options=extra, **common)
            assert pred.options is not None  # a prediction with a strategy has its options
            wire = sum(c.wire_bytes for c in pred.update.collectives)
            row: dict[str, Any] = {
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
            by_label[label] = row
            rows.append(row)
        present = [b for b in baselines if b in by_label]
        for label, row in by_label.items():
            if label in present or not present:
                continue
            for metric in _METRICS:
                for b in present:
                    row[f"{metric}_x_{b}"] = _ratio(by_label[b][metric], row[metric])
                best = min(by_label[b][metric] for b in present)
                row[f"{metric}_x_best"] = _ratio(best, row[metric])
    return rows


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def _num(x: float, scale: float = 1.0) -> str:
    return f"{round(x * scale, 1) + 0.0:.1f}"  # + 0.0: no "-0.0" from round-off


def format_table(rows: Sequence[Mapping[str, Any]], baselines: Sequence[str] = BASELINES) -> str:
    """Markdown: one line per model and variant, then the ratios against the baselines."""
    head = (
        "| model | strategy | computation (ms) | communication (ms) | memory (MiB) "
        "| K-FAC wire (MiB) | comm. incl. gradients (ms) | iteration (ms) | SGD iteration (ms) |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        cells = [
            _num(r["computation_s"], 1e3),
            _num(r["communication_s"], 1e3),
            _num(r["memory_mb"]),
            _num(r["kfac_wire_mb"]),
            _num(r["total_communication_s"], 1e3),
            _num(r["iteration_s"], 1e3),
            _num(r["sgd_iteration_s"], 1e3),
        ]
        lines.append(f"| {r['model']} | {_label(r)} | " + " | ".join(cells) + " |")
    vs_heads = " | ".join(f"vs {b} (comp / comm / mem)" for b in baselines)
    lines += [
        "",
        f"How many times lower (best of {', '.join(baselines)} / the row):",
        "",
        "| model | strategy | computation | communication | memory | comm. incl. gradients "
        f"| {vs_heads} |",
        "|" + "---|" * (6 + len(baselines)),
    ]
    for r in rows:
        if "computation_s_x_best" not in r:
            continue
        vs = [
            " / ".join(f"{r.get(f'{m}_x_{b}', float('nan')):.2f}" for m in _METRICS[:3])
            for b in baselines
        ]
        best = " | ".join(f"{r[f'{m}_x_best']:.2f}" for m in _METRICS)
        lines.append(f"| {r['model']} | {_label(r)} | {best} | " + " | ".join(vs) + " |")
    return "\n".join(lines)


def _label(row: Mapping[str, Any]) -> str:
    """The row's strategy, with what it chose (grouped's k and f) when it chose anything."""
    chosen = row.get("configuration")
    return f"{row['strategy']} ({chosen})" if chosen else str(row["strategy"])
