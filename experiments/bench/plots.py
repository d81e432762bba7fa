"""Matplotlib figures of the tables.

Each function takes the tidy frame its table writer built in
:mod:`experiments.bench.tables` and returns the figure, so the notebook draws
exactly what ``results/*.png`` shows. Figures are built with the
object-oriented API (``matplotlib.figure.Figure``), never through pyplot, so
no GUI backend is selected and nothing depends on a display or on the
thread a Hydra callback runs in.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import matplotlib
import pandas as pd
from matplotlib.figure import Figure

#: Strategy configs in the papers' order (tables and figures sort rows by it).
STRATEGY_ORDER = [
    "none",
    "dp_kfac",
    "dp_kfac_overlap",
    "dp_kfac_owner",
    "d_kfac_eager",
    "d_kfac_triangle",
    "d_kfac_lazy",
    "d_kfac",
    "spd_kfac",
    "kaisa_comm_opt",
    "kaisa_mem_opt",
    "grouped_local_decomp",
    "grouped_auto",
]
#: The DP-KFAC paper's headline compares these strategy configs' costs with REFERENCE's;
#: `best` is the cheapest of them, so it spans every baseline a table measured.
REFERENCE = "dp_kfac"
COMPARED = ("d_kfac", "spd_kfac", "kaisa_comm_opt", "kaisa_mem_opt")
PART_LABELS = {
    "fwd_bwd": "forward/backward",
    "grad_comm": "gradient comm",
    "factor_compute": "factor compute",
    "factor_comm": "factor comm",
    "decomposition": "decomposition",
    "decomposition_comm": "decomposition comm",
    "precondition": "precondition",
    "precond_comm": "precond. grad comm",
    "comm_sync": "barrier before comm",
    "step_other": "other in step()",
    "optimizer": "optimizer step",
}


def ordered(strategies: pd.Series | list[str]) -> list[str]:
    """Strategies in the papers' order (unknown ones last, alphabetically)."""
    present = list(dict.fromkeys(strategies))
    known = [s for s in STRATEGY_ORDER if s in present]
    return known + sorted(s for s in present if s not in STRATEGY_ORDER)


def save(fig: Figure, path: Path) -> Path:
    """Write ``fig`` as a PNG and release it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def png_bytes(fig: Figure) -> bytes:
    """The figure as PNG bytes (for ``IPython.display.Image`` in the notebook)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return buf.getvalue()


def _figure(rows: int, cols: int, size: tuple[float, float]) -> tuple[Figure, object]:
    fig = Figure(figsize=size)
    return fig, fig.subplots(rows, cols, squeeze=False)


def ratio_bars(headline: pd.DataFrame) -> Figure:
    """Computation, communication and memory of each strategy relative to dp_kfac, per model."""
    metrics = [("compute", "computation"), ("comm", "communication"), ("memory", "memory")]
    strategies = [s for s in COMPARED if f"compute_{s}/dp" in headline.columns]
    fig, grid = _figure(1, 3, (13, 3.6))
    axes = grid[0]
    labels = headline["model"].tolist()
    width = 0.8 / max(len(strategies), 1)
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for i, strategy in enumerate(strategies):
            values = headline[f"{key}_{strategy}/dp"].tolist()
            xs = [j + (i - (len(strategies) - 1) / 2) * width for j in range(len(labels))]
            ax.bar(xs, values, width, label=f"{strategy} / {REFERENCE}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
        ax.set_title(f"{title} (x {REFERENCE})")
    axes[0].legend(fontsize=8)
    fig.suptitle("Cost of one second-order update relative to DP-KFAC (>1: DP-KFAC is cheaper)")
    fig.tight_layout()
    return fig


def stacked_breakdown(wide: pd.DataFrame, parts: list[str]) -> Figure:
    """Stacked per-phase bars per strategy, one panel per (setting, model)."""
    panels = list(wide.groupby(["setting", "model"], sort=False))
    cols = 2 if len(panels) in (2, 4) else min(len(panels), 3)
    rows = math.ceil(len(panels) / cols) if panels else 1
    fig, axes = _figure(rows, cols, (5.2 * cols, 3.8 * rows))
    colors = matplotlib.colormaps["tab10"].colors
    for ax, ((setting, model), frame) in zip(axes.flat, panels, strict=False):
        frame = frame.set_index("strategy").loc[ordered(frame["strategy"])]
        bottom = [0.0] * len(frame)
        for k, part in enumerate(parts):
            values = frame[f"{part}_ms"].fillna(0.0).tolist()
            ax.bar(
                range(len(frame)),
                values,
                bottom=bottom,
                label=PART_LABELS.get(part, part),
                color=colors[k % len(colors)],
            )
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.set_xticks(range(len(frame)), frame.index, rotation=30, ha="right")
        ax.set_ylabel("ms per iteration")
        ax.set_title(f"{model} ({setting}, P={int(frame['world_size'].iloc[0])})")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=5, fontsize=8, bbox_to_anchor=(0.5, 1.06))
    fig.tight_layout()
    return fig


def scaling_lines(frame: pd.DataFrame) -> Figure:
    """Iteration time against P: measured points, predicted lines, one panel per model."""
    models = list(dict.fromkeys(frame["model"]))
    fig, axes = _figure(1, len(models), (5.5 * len(models) + 2.5, 4))
    styles = {
        "measured": ("o", "-"),
        "calibrated": ("", "--"),
        "calibrated, shared cores": ("x", "none"),
    }
    colors = dict(zip(STRATEGY_ORDER, matplotlib.colormaps["tab10"].colors, strict=False))
    for ax, model in zip(axes.flat, models, strict=True):
        sub = frame[frame["model"] == model]
        for (strategy, source), line in sub.groupby(["strategy", "source"], sort=False):
            marker, style = styles.get(source, ("", ":"))
            line = line.sort_values("world_size")
            ax.plot(
                line["world_size"],
                line["iteration_ms"],
                marker=marker,
                linestyle=style,
                color=colors.get(strategy),
                label=f"{strategy} ({source})",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks P")
        ax.set_ylabel("ms per iteration")
        ax.set_title(model)
    axes.flat[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    return fig


def accuracy_curves(curves: pd.DataFrame) -> Figure:
    """Test accuracy per epoch, one panel per world size, one line per strategy."""
    sizes = sorted(curves["world_size"].unique())
    fig, axes = _figure(1, max(len(sizes), 1), (4.5 * max(len(sizes), 1), 3.5))
    for ax, p in zip(axes.flat, sizes, strict=False):
        sub = curves[curves["world_size"] == p]
        for k, strategy in enumerate(ordered(sub["strategy"])):
            line = sub[sub["strategy"] == strategy].sort_values("epoch")
            # Strategies with identical maths overlap exactly (all K-FAC at P=1,
            # dp_kfac with either gradient reduction): markers and dashes keep them visible.
            ax.plot(
                line["epoch"],
                line["test_acc"],
                marker="osv^D"[k % 5],
                linestyle="--" if k % 2 else "-",
                markersize=7 - k,
                label=strategy,
            )
        ax.set_title(f"P={p}")
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0.5, 1.0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


#: The ablation's stacked parts of an iteration (the rest is forward/backward and other work).
ABLATION_PARTS = {
    "compute_ms": "K-FAC compute",
    "comm_ms": "K-FAC comm",
    "grad_comm_ms": "gradient comm",
}


def ablation_bars(frame: pd.DataFrame) -> Figure:
    """Stacked milliseconds per iteration of each strategy config, in the ablation's order.

    One column of panels per (model, setting, measured P): measured (top)
    and, when the frame has them, the cost model's ``pred_*`` columns at
    their P (bottom), each on its own scale. Bars are K-FAC computation,
    K-FAC communication, gradient communication and the rest of the
    iteration (forward/backward, optimizer, other work, barriers).
    """
    panels = list(frame.groupby(["model", "setting", "P"], sort=False))
    sources = [("", "measured at P={p}")]
    if "pred_iteration_ms" in frame:
        p = int(frame["pred_P"].iloc[0])
        sources.append(("pred_", f"predicted at P={p}\n(v100_ib100, paper-size model)"))
    fig, axes = _figure(len(sources), max(len(panels), 1), (4.6 * len(panels), 3.9 * len(sources)))
    colors = matplotlib.colormaps["tab10"].colors
    parts = [*ABLATION_PARTS.items(), ("rest", "forward/backward and other")]
    for j, ((model, setting, p), g) in enumerate(panels):
        xs = range(len(g))
        for i, (prefix, title) in enumerate(sources):
            ax = axes[i][j]
            bottom = [0.0] * len(g)
            for k, (part, label) in enumerate(parts):
                if part in ABLATION_PARTS:
                    values = g[prefix + part].fillna(0.0).tolist()
                    color = colors[k % len(colors)]
                else:  # what the iteration has beyond the parts above (clipped at 0)
                    total = g[prefix + "iteration_ms"].fillna(0.0).tolist()
                    values = [max(t - b, 0.0) for t, b in zip(total, bottom, strict=True)]
                    color = "lightgray"
                ax.bar(xs, values, bottom=bottom, label=label, color=color)
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
            ax.set_xticks(xs, g["strategy"], rotation=45, ha="right", fontsize=8)
            ax.set_ylabel("ms per iteration")
            ax.set_title(f"{model}, {setting}: {title.format(p=p)}", fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.tight_layout()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, bbox_to_anchor=(0.5, 1.0))
    return fig
