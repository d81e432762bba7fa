"""The DP-KFAC paper's headline table, predicted: cost per second-order update at 64 GPUs.

For each model and strategy: the busiest rank's K-FAC computation
(factor construction, decomposition, preconditioning), the communication
K-FAC adds to plain data parallelism, the busiest rank's K-FAC memory, and
the iteration time against SGD's. dp-kfac rows carry the ratios the paper
reports ("how many times lower"): d-kfac / dp-kfac, spd-kfac / dp-kfac and
best-of-the-two / dp-kfac.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dpkfac.assignment import LayerShape
from dpkfac.costmodel.hardware import Hardware
from dpkfac.costmodel.predict import predict, predict_sgd
from dpkfac.costmodel.presets import PRESETS

__all__ = ["VARIANTS", "format_table", "predicted_table"]

#: Table rows: label -> (strategy, extra options).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "dp-kfac": ("dp-kfac", {}),
    "dp-kfac (owner)": ("dp-kfac", {"grad_reduction": "owner"}),
    "d-kfac": ("d-kfac", {}),
    "spd-kfac": ("spd-kfac", {}),
}
_METRICS = ("computation_s", "communication_s", "memory_mb", "total_communication_s")
_SGD_KEYS = ("bias", "other_params", "param_itemsize", "bucket_cap_mb", "ddp")


def predicted_table(
    models: Mapping[str, Sequence[LayerShape] | tuple[Sequence[LayerShape], Mapping[str, Any]]],
    world_size: int = 64,
    hardware: Hardware | None = None,
    variants: Mapping[str, tuple[str, dict[str, Any]]] = VARIANTS,
    **options: Any,
) -> list[dict[str, Any]]:
    """One row per model and strategy variant.

    Args:
        models: name -> shapes, or name -> (shapes, predict options), e.g.
            :data:`dpkfac.costmodel.zoo.PAPER_MODELS`.
        world_size: number of ranks.
        hardware: device and network model (default: ``v100_ib100``).
        variants: label -> (strategy, options) rows per model.
        **options: predict options shared by every model.

    Returns:
        Rows with ``model``, ``strategy``, ``computation_s``,
        ``communication_s`` (added to SGD's), ``total_communication_s``
        (gradients included), ``memory_mb``, ``kfac_wire_mb`` (wire MiB per
        rank and update beyond SGD's), ``iteration_s``,
        ``sgd_iteration_s`` and, on dp-kfac rows, ``<metric>_x_d-kfac``,
        ``<metric>_x_spd-kfac`` and ``<metric>_x_best``.
    """
    hw = hardware or PRESETS["v100_ib100"]
    rows: list[dict[str, Any]] = []
    for model_name, spec in models.items():
        shapes, model_opts = spec if isinstance(spec, tuple) else (spec, {})
        opts = {**options, **model_opts}
        sgd_opts = {k: v for k, v in opts.items() if k in _SGD_KEYS}
        sgd = predict_sgd(shapes, world_size=world_size, hardware=hw, **sgd_opts)
        sgd_wire = sum(c.wire_bytes for c in sgd.update.collectives)
        by_label = {}
        for label, (strategy, extra) in variants.items():
            pred = predict(
                shapes, strategy=strategy, world_size=world_size, hardware=hw, **{**opts, **extra}
            )
            wire = sum(c.wire_bytes for c in pred.update.collectives)
            row = {
                "model": model_name,
                "strategy": label,
                "computation_s": pred.computation,
                "communication_s": pred.communication,
                "total_communication_s": sum(pred.update.comm_serial.values()),
                "memory_mb": pred.memory_max / 2**20,
                "kfac_wire_mb": (wire - sgd_wire) / 2**20,
                "iteration_s": pred.iteration,
                "sgd_iteration_s": sgd.iteration,
            }
            by_label[label] = row
            rows.append(row)
        baselines = [b for b in ("d-kfac", "spd-kfac") if b in by_label]
        for label, row in by_label.items():
            if not label.startswith("dp-kfac"):
                continue
            for metric in _METRICS:
                for b in baselines:
                    row[f"{metric}_x_{b}"] = _ratio(by_label[b][metric], row[metric])
                if baselines:
                    best = min(by_label[b][metric] for b in baselines)
                    row[f"{metric}_x_best"] = _ratio(best, row[metric])
    return rows


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def _num(x: float, scale: float = 1.0) -> str:
    return f"{round(x * scale, 1) + 0.0:.1f}"  # + 0.0: no "-0.0" from round-off


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: one line per model and strategy, then dp-kfac's ratios vs the best D-KFAC."""
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
        lines.append(f"| {r['model']} | {r['strategy']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "How many times lower for dp-kfac (best of d-kfac and spd-kfac / dp-kfac):",
        "",
        "| model | strategy | computation | communication | memory | comm. incl. gradients "
        "| vs d-kfac (comp / comm / mem) | vs spd-kfac (comp / comm / mem) |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        if "computation_s_x_best" not in r:
            continue
        vs = [
            " / ".join(f"{r.get(f'{m}_x_{b}', float('nan')):.2f}" for m in _METRICS[:3])
            for b in ("d-kfac", "spd-kfac")
        ]
        best = " | ".join(f"{r[f'{m}_x_best']:.2f}" for m in _METRICS)
        lines.append(f"| {r['model']} | {r['strategy']} | {best} | {vs[0]} | {vs[1]} |")
    return "\n".join(lines)
