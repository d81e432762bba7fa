"""Matplotlib figures of the tables.

Each function takes the tidy frame its table writer built in
:mod:`experiments.bench.tables` and returns the figure, so the notebook draws
exactly what ``results/*.png`` shows. Figures are built with the
object-oriented API (``matplotlib.figure.Figure``), never through pyplot, so
no GUI backend is selected and nothing depends on a display or on the
thread a Hydra callback runs in.

A strategy config has one colour in every figure (:data:`STRATEGY_COLORS`,
:func:`strategy_color`); figures that colour something else (the phases of
an iteration) draw no strategy colour. Each figure has one legend of
strategies (and, where a line's style means something, one key of styles),
outside its panels.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Sequence
from itertools import chain, count, cycle
from pathlib import Path
from typing import Any

import matplotlib
import pandas as pd
from matplotlib import colors as mcolors
from matplotlib import patches as mpatches
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter

from dpkfac.plan.configs import BASELINES, CONFIGS, REFERENCE

#: Strategy configs in the papers' order (tables and figures sort rows by it); the DP-KFAC
#: paper's headline compares the BASELINES' costs with REFERENCE's (dpkfac/plan/configs.py).
STRATEGY_ORDER = list(CONFIGS)
COMPARED = BASELINES
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


#: Where the strategy configs live: ``conf/strategy/<name>.yaml``.
STRATEGY_CONF = Path(__file__).resolve().parents[2] / "conf" / "strategy"

#: Colour families of the strategy configs, by name: a config named like the family
#: (``dp_kfac``) or starting with it and ``_`` (``dp_kfac_owner``) takes the family's
#: shades; the family's own config takes the first, the others the next unused ones in
#: :func:`strategy_configs` order. Families: first-order SGD black, DP-KFAC greens,
#: D-KFAC blues, SPD-KFAC browns, KAISA oranges and reds, grouped purples.
STRATEGY_FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("none", ("#000000",)),
    ("dp_kfac", ("#2ca02c", "#005a32", "#8fd16f", "#41ab5d", "#c2e699")),
    ("d_kfac", ("#1f77b4", "#08306b", "#17becf", "#7fb2e5", "#4a6fe3")),
    ("spd_kfac", ("#8c564b", "#c49c94", "#5a3825")),
    ("kaisa", ("#ff7f0e", "#d62728", "#fdae6b", "#7f0000")),
    ("grouped", ("#9467bd", "#e377c2", "#5e3c99", "#c5b0d5")),
)
#: Colours of configs outside every family, or past their family's shades, in order.
SPARE_COLORS = ("#7f7f7f", "#bcbd22", "#17a589", "#b8860b", "#ff1493", "#4b0082")


def strategy_configs(conf: Path = STRATEGY_CONF) -> list[str]:
    """Every strategy config: :data:`STRATEGY_ORDER`, then the others in ``conf`` by name."""
    found = sorted(p.stem for p in conf.glob("*.yaml")) if conf.is_dir() else []
    return [*STRATEGY_ORDER, *(name for name in found if name not in STRATEGY_ORDER)]


def _family(name: str) -> tuple[str, tuple[str, ...]] | None:
    return next(
        ((f, shades) for f, shades in STRATEGY_FAMILIES if name == f or name.startswith(f + "_")),
        None,
    )


def strategy_palette(names: list[str]) -> dict[str, str]:
    """A distinct colour per strategy config name, deterministic in ``names``' order.

    Family heads (a config named like its family) are coloured first, so
    ``dp_kfac`` keeps its green whatever other configs exist; every other name
    takes its family's next unused shade, else the next unused
    :data:`SPARE_COLORS`, else a colour of ``tab20`` or the hue circle no
    name has; adding a name at the end never changes the others' colours.
    """
    used: set[str] = set()
    colors: dict[str, str] = {}
    spare = [*SPARE_COLORS, *(mcolors.to_hex(c) for c in matplotlib.colormaps["tab20"].colors)]
    heads = [n for n in names if (fam := _family(n)) is not None and fam[0] == n]
    for name in dict.fromkeys([*heads, *names]):
        fam = _family(name)
        shades = fam[1] if fam is not None else ()
        hues = ((0.13 + 0.618034 * k) % 1.0 for k in count())  # past every list: golden-ratio hues
        extra = (mcolors.to_hex(mcolors.hsv_to_rgb((hue, 0.75, 0.8))) for hue in hues)
        color = next(c for c in chain(shades, spare, extra) if c not in used)
        colors[name] = color
        used.add(color)
    return {name: colors[name] for name in names}


#: The one colour of each strategy config, in every figure (see :func:`strategy_color`).
STRATEGY_COLORS: dict[str, str] = strategy_palette(strategy_configs())


def strategy_color(name: str) -> str:
    """The colour of a strategy config in every figure; a name no config has gets the next
    free one (extending :data:`STRATEGY_COLORS`, so it keeps it for the rest of the run)."""
    if name not in STRATEGY_COLORS:
        STRATEGY_COLORS.update(strategy_palette([*STRATEGY_COLORS, name]))
    return STRATEGY_COLORS[name]


def ordered(strategies: pd.Series | list[str]) -> list[str]:
    """Strategies in the papers' order (unknown ones last, alphabetically)."""
    present = list(dict.fromkeys(strategies))
    known = [s for s in STRATEGY_ORDER if s in present]
    return known + sorted(s for s in present if s not in STRATEGY_ORDER)


def in_order(frame: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """``frame`` sorted by ``by``, its strategies in the papers' order (:func:`ordered`)."""
    order = {s: i for i, s in enumerate(ordered(frame["strategy"]))}
    return frame.sort_values(
        by, key=lambda c: c.map(order).fillna(c) if c.name == "strategy" else c
    ).reset_index(drop=True)


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


def _figure(rows: int, cols: int, size: tuple[float, float], **kwargs: Any) -> tuple[Figure, Any]:
    """A figure with constrained layout, so legends placed ``outside`` get their own room."""
    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False, **kwargs)


def _stacked_bars(ax: Any, xs: range, bars: dict[str, list[float]], colors: Iterable[Any]) -> None:
    """One bar per ``label: values`` at ``xs``, each stacked on the ones before it."""
    bottom = [0.0] * len(xs)
    for (label, values), color in zip(bars.items(), colors, strict=False):
        ax.bar(xs, values, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]


def strategy_handles(strategies: Iterable[str], labels: Iterable[str] | None = None) -> list:
    """Legend entries of strategy configs: a thick line in each one's colour."""
    names = list(strategies)
    return [
        Line2D([], [], color=strategy_color(s), linewidth=4, label=label)
        for s, label in zip(names, labels if labels is not None else names, strict=True)
    ]


def _strategy_legend(fig: Figure, handles: list, title: str = "strategy config") -> None:
    """The figure's one strategy legend, right of every panel (never over data)."""
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, title=title)


def ratio_bars(headline: pd.DataFrame) -> Figure:
    """Computation, communication and memory of each strategy relative to dp_kfac, per model."""
    metrics = [("compute", "computation"), ("comm", "communication"), ("memory", "memory")]
    strategies = [s for s in COMPARED if f"compute_{s}/dp" in headline.columns]
    labels = [f"{s} / {REFERENCE}" for s in strategies]
    fig, axes = _figure(1, 3, (14, 3.8))
    models = headline["model"].tolist()
    width = 0.8 / max(len(strategies), 1)
    for ax, (key, title) in zip(axes[0], metrics, strict=True):
        for i, (strategy, label) in enumerate(zip(strategies, labels, strict=True)):
            values = headline[f"{key}_{strategy}/dp"].tolist()
            xs = [j + (i - (len(strategies) - 1) / 2) * width for j in range(len(models))]
            ax.bar(xs, values, width, label=label, color=strategy_color(strategy))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(models)), models, rotation=30, ha="right")
        ax.set_title(f"{title} (x {REFERENCE})")
    _strategy_legend(fig, strategy_handles(strategies, labels), title="cost relative to")
    fig.suptitle("Cost of one second-order update relative to DP-KFAC (>1: DP-KFAC is cheaper)")
    return fig


def stacked_breakdown(wide: pd.DataFrame, parts: list[str]) -> Figure:
    """Stacked per-phase bars per strategy, one panel per (setting, model).

    Colours are phases here (``tab10`` by position in ``parts``), not strategy
    configs: the strategies are the bars' labels, and no strategy colour is drawn.
    """
    panels = list(wide.groupby(["setting", "model"], sort=False))
    cols = 2 if len(panels) in (2, 4) else min(len(panels), 3)
    rows = math.ceil(len(panels) / cols) if panels else 1
    fig, axes = _figure(rows, cols, (5.2 * cols, 3.8 * rows))
    for ax, ((setting, model), frame) in zip(axes.flat, panels, strict=False):
        frame = frame.set_index("strategy").loc[ordered(frame["strategy"])]
        xs = range(len(frame))
        bars = {PART_LABELS.get(p, p): frame[f"{p}_ms"].fillna(0.0).tolist() for p in parts}
        _stacked_bars(ax, xs, bars, cycle(matplotlib.colormaps["tab10"].colors))
        ax.set_xticks(xs, frame.index, rotation=30, ha="right")
        ax.set_ylabel("ms per iteration")
        ax.set_title(f"{model} ({setting}, P={int(frame['world_size'].iloc[0])})")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncol=5, fontsize=8)
    return fig


#: How the scaling figure draws each kind of source: measured solid with filled
#: circles, the cost model's predictions dashed with hollow markers (a prediction
#: at a single P, where ranks share cores, is a hollow diamond without a line).
SOURCE_STYLES: dict[str, dict[str, Any]] = {
    "measured": {"linestyle": "-", "marker": "o", "fillstyle": "full"},
    "predicted": {"linestyle": "--", "marker": "o", "fillstyle": "none"},
    "shared cores": {"linestyle": "none", "marker": "D", "fillstyle": "none"},
}
#: The style key's entries.
SOURCE_KEY = {
    "measured": "measured here",
    "predicted": "predicted (cost model)",
    "shared cores": "predicted, ranks sharing cores",
}


def source_kind(source: str) -> str:
    """Which :data:`SOURCE_STYLES` a scaling row's ``source`` is drawn with."""
    if source == "measured":
        return "measured"
    return "shared cores" if "shared cores" in source else "predicted"


def _here(source: str) -> bool:
    """Whether a scaling source is this machine's (measured or calibrated on it)."""
    return source == "measured" or source.startswith("calibrated")


def _plain(value: float, _: Any = None) -> str:
    """A log axis' tick as a plain number (``200``, not ``2 x 10^2``), at 1, 2, 3 and 5 x 10^k."""
    if value <= 0:
        return ""
    mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
    return f"{value:g}" if round(mantissa, 6) in (1.0, 2.0, 3.0, 5.0) else ""


def scaling_lines(frame: pd.DataFrame) -> Figure:
    """Iteration time against P, one column per model.

    Top row: this machine, measured and predicted by the calibrated cost
    model; one more row per other cluster's prediction (``v100_ib100``), on
    its own scale. Colour is the strategy config, line and marker the kind
    of source (:data:`SOURCE_STYLES`); one legend for each, right of and
    below the panels. Strategies earlier in the papers' order are drawn
    wider, so one whose times equal a later one's (grouped_auto choosing
    dp_kfac's layout) shows as a rim around it instead of vanishing.
    """
    models = list(dict.fromkeys(frame["model"]))
    elsewhere = [s for s in dict.fromkeys(frame["source"]) if not _here(s)]
    rows = [None, *elsewhere]  # None: this machine
    strategies = ordered(frame["strategy"])
    rim = {
        s: (len(strategies) - 1 - k) / max(len(strategies) - 1, 1) for k, s in enumerate(strategies)
    }
    fig, axes = _figure(len(rows), len(models), (5.0 * len(models), 3.6 * len(rows)), sharex=True)
    sizes = frame["world_size"]
    ticks = [
        2**k for k in range(int(math.log2(sizes.min())), math.ceil(math.log2(sizes.max())) + 1)
    ]
    kinds: list[str] = []
    for j, model in enumerate(models):
        sub = frame[frame["model"] == model]
        for i, row in enumerate(rows):
            ax = axes[i][j]
            mine = sub[sub["source"].map(_here)] if row is None else sub[sub["source"] == row]
            for strategy in ordered(mine["strategy"]):
                ours = mine[mine["strategy"] == strategy]
                for source, line in ours.groupby("source", sort=False):
                    kind = source_kind(source)
                    kinds.append(kind)
                    line = line.sort_values("world_size")
                    ax.plot(
                        line["world_size"],
                        line["iteration_ms"],
                        color=strategy_color(strategy),
                        label=f"{strategy} ({source})",
                        linewidth=1.3 + 1.2 * rim[strategy],
                        markersize=(6.0 if kind == "shared cores" else 4.0) + 3.0 * rim[strategy],
                        **SOURCE_STYLES[kind],
                    )
            ax.set_xscale("log", base=2)
            ax.set(yscale="log", ylabel="ms per iteration")
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.yaxis.set_major_formatter(FuncFormatter(_plain))
            ax.yaxis.set_minor_formatter(FuncFormatter(_plain))
            ax.tick_params(axis="y", which="minor", labelsize=8)
            ax.grid(alpha=0.3, which="major")
            where = (
                "this machine, measured and predicted" if row is None else f"predicted for {row}"
            )
            ax.set_title(f"{model}: {where}", fontsize=10)
            if i == len(rows) - 1:
                ax.set_xlabel("ranks P")
    _strategy_legend(fig, strategy_handles(strategies))
    key = [
        Line2D([], [], color="dimgray", label=SOURCE_KEY[k], markersize=6, **SOURCE_STYLES[k])
        for k in SOURCE_STYLES
        if k in kinds
    ]
    fig.legend(handles=key, loc="outside lower center", ncol=len(key), fontsize=8)
    return fig


#: Markers and dashes of the convergence curves, per strategy config (by position):
#: strategies with identical maths overlap exactly (all K-FAC at P=1, dp_kfac with
#: either gradient reduction), and these keep every one visible.
CURVE_MARKERS = "osv^Dp<>h*"


def curve_looks(strategies: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per strategy config its colour and its own marker, dash and marker size, so curves
    that coincide (every K-FAC config at P=1) stay visible on top of one another."""
    return {
        s: {
            "color": strategy_color(s),
            "marker": CURVE_MARKERS[k % len(CURVE_MARKERS)],
            "linestyle": "--" if k % 2 else "-",
            "markersize": max(7 - k, 3),
        }
        for k, s in enumerate(strategies)
    }


def accuracy_curves(curves: pd.DataFrame) -> Figure:
    """Test accuracy per epoch, one panel per world size, one line per strategy."""
    sizes = sorted(curves["world_size"].unique())
    fig, axes = _figure(1, max(len(sizes), 1), (4.5 * max(len(sizes), 1), 3.5))
    strategies = ordered(curves["strategy"])
    looks = curve_looks(strategies)
    for ax, p in zip(axes.flat, sizes, strict=False):
        sub = curves[curves["world_size"] == p]
        for strategy in ordered(sub["strategy"]):
            line = sub[sub["strategy"] == strategy].sort_values("epoch")
            ax.plot(line["epoch"], line["test_acc"], label=strategy, **looks[strategy])
        ax.set(title=f"P={p}", xlabel="epoch", ylabel="test accuracy", ylim=(0.5, 1.0))
    _strategy_legend(fig, [Line2D([], [], label=s, **looks[s]) for s in strategies])
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
    iteration (forward/backward, optimizer, other work, barriers); colours
    are these parts, not strategy configs (the strategies are the bars' labels).
    """
    panels = list(frame.groupby(["model", "setting", "P"], sort=False))
    sources = [("", "measured at P={p}")]
    if "pred_iteration_ms" in frame:
        p = int(frame["pred_P"].iloc[0])
        sources.append(("pred_", f"predicted at P={p}\n(v100_ib100, paper-size model)"))
    fig, axes = _figure(len(sources), max(len(panels), 1), (4.6 * len(panels), 3.9 * len(sources)))
    colors = [*matplotlib.colormaps["tab10"].colors[: len(ABLATION_PARTS)], "lightgray"]
    for j, ((model, setting, p), g) in enumerate(panels):
        xs = range(len(g))
        for i, (prefix, title) in enumerate(sources):
            ax = axes[i][j]
            bars = {h: g[prefix + c].fillna(0.0).tolist() for c, h in ABLATION_PARTS.items()}
            # What the iteration has beyond the parts above (clipped at 0).
            total = g[prefix + "iteration_ms"].fillna(0.0).tolist()
            top = [sum(values) for values in zip(*bars.values(), strict=True)]
            rest = [max(t - b, 0.0) for t, b in zip(total, top, strict=True)]
            _stacked_bars(ax, xs, {**bars, "forward/backward and other": rest}, colors)
            ax.set_xticks(xs, g["strategy"], rotation=45, ha="right", fontsize=8)
            ax.set_ylabel("ms per iteration")
            ax.set_title(f"{model}, {setting}: {title.format(p=p)}", fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside upper center", ncol=4, fontsize=8)
    return fig


def network_bars(frame: pd.DataFrame) -> Figure:
    """Iteration per config on the emulated network, measured beside predicted, per panel.

    One panel per (model, setting, rate). Each config has a solid bar of its measured
    iteration, split into compute (its colour) and exposed communication (hatched), with
    the range over runs as an error bar; beside it a hollow bar outlined in its colour, the
    cost model's prediction from the probe alone; a black tick marks its floor.
    """
    from experiments.network import format_rate

    panels = list(frame.groupby(["model", "setting", "rate_bps"], sort=False))
    cols = min(len(panels), 4)
    rows = -(-len(panels) // cols)
    fig, axes = _figure(rows, cols, (4.4 * cols, 3.6 * rows))
    predicted = "pred_iteration_ms" in frame
    width = 0.4 if predicted else 0.7
    for ax, ((model, setting, rate), g) in zip(axes.flat, panels, strict=False):
        xs = list(range(len(g)))
        colors = [strategy_color(s) for s in g["strategy"]]
        measured = [x - width / 2 if predicted else x for x in xs]
        computed = (g["iteration_ms"] - g["exposed_comm_ms"]).clip(lower=0.0)
        ax.bar(measured, computed, width, color=colors)
        ax.bar(measured, g["exposed_comm_ms"], width, bottom=computed, color=colors,
               hatch="///", edgecolor="white", linewidth=0)  # fmt: skip
        low = (g["iteration_ms"] - g["iteration_min_ms"]).clip(lower=0.0).fillna(0.0)
        high = (g["iteration_max_ms"] - g["iteration_ms"]).clip(lower=0.0).fillna(0.0)
        ax.errorbar(measured, g["iteration_ms"], yerr=[low, high], fmt="none", ecolor="black",
                    capsize=2, linewidth=0.8)  # fmt: skip
        if predicted:
            ax.bar([x + width / 2 for x in xs], g["pred_iteration_ms"], width, fill=False,
                   edgecolor=colors, linewidth=1.2)  # fmt: skip
        ax.scatter(measured, g["floor_ms"], marker="D", s=16, facecolor="white",
                   edgecolor="black", linewidth=0.8, zorder=3)  # fmt: skip
        ax.set_xticks(xs, g["strategy"], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("ms per iteration")
        ax.set_title(f"{model}, {setting}, {format_rate(rate)}", fontsize=9)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    gray = "#888888"
    handles = [
        mpatches.Patch(color=gray, label="measured: compute"),
        mpatches.Patch(
            facecolor=gray, hatch="///", edgecolor="white", label="measured: exposed comm"
        ),
        Line2D(
            [],
            [],
            marker="D",
            markerfacecolor="white",
            markeredgecolor="black",
            linestyle="none",
            markersize=5,
            label="floor",
        ),
        Line2D([], [], color="black", linewidth=0.8, label="range over runs"),
    ]
    if predicted:
        handles.insert(
            2, mpatches.Patch(fill=False, edgecolor=gray, label="predicted (probe only)")
        )
    fig.legend(handles=handles, loc="outside upper center", ncol=len(handles), fontsize=8)
    return fig
