"""One colour per strategy config in every figure (``experiments.bench.plots``).

The mapping gives every config in ``conf/strategy`` (and every strategy in the
committed raw rows) its own, clearly different colour, and the figures that
colour by strategy draw exactly those colours, read back from the matplotlib
artists; the scaling figure tells measured from predicted by line and marker,
keeps other clusters' predictions in their own panels and has one legend.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pandas as pd
from matplotlib.colors import to_hex, to_rgb
from matplotlib.figure import Figure

from experiments.bench import plots

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted(p.stem for p in (ROOT / "conf" / "strategy").glob("*.yaml"))
#: Strategies that once shared a colour (both tab10 blue) are among those drawn.
DRAWN = ["none", "dp_kfac", "d_kfac", "kaisa_mem_opt", "grouped_auto"]


def _raw_strategies() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "results" / "raw").glob("*.csv"):
        frame = pd.read_csv(path, usecols=lambda c: c == "strategy")
        if "strategy" in frame:
            names |= set(frame["strategy"].dropna())
    return names


def test_every_strategy_config_has_its_own_colour() -> None:
    assert len(CONFIGS) >= 13 and set(DRAWN) <= set(CONFIGS)
    names = sorted(set(CONFIGS) | _raw_strategies())
    assert set(names) <= set(plots.STRATEGY_COLORS)
    rgb = {n: to_rgb(plots.strategy_color(n)) for n in names}
    for a, b in itertools.combinations(names, 2):
        assert math.dist(rgb[a], rgb[b]) > 0.2, (a, b, rgb[a], rgb[b])
    # Deterministic, and a new config gets a new colour without moving the others'.
    assert plots.strategy_palette(plots.strategy_configs()) == {
        n: plots.STRATEGY_COLORS[n] for n in plots.strategy_configs()
    }
    more = plots.strategy_palette([*plots.strategy_configs(), "dp_kfac_new", "other"])
    assert {n: more[n] for n in plots.strategy_configs()} == {
        n: plots.STRATEGY_COLORS[n] for n in plots.strategy_configs()
    }
    assert len(set(more.values())) == len(more)


def _line_colours(fig: Figure) -> dict[str, str]:
    """``label -> colour`` of every data line and bar of the figure's panels."""
    seen: dict[str, str] = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            seen[line.get_label()] = to_hex(line.get_color())
        for bars in ax.containers:
            colours = {to_hex(p.get_facecolor()) for p in bars.patches}
            assert len(colours) == 1
            seen[bars.get_label()] = colours.pop()
    return seen


def _one_strategy_legend(fig: Figure, labels: list[str]) -> None:
    assert not any(ax.get_legend() for ax in fig.axes)  # no legend over a panel
    texts = [[t.get_text() for t in legend.get_texts()] for legend in fig.legends]
    assert labels in texts
    legend = fig.legends[texts.index(labels)]
    for handle, label in zip(legend.legend_handles, labels, strict=True):
        assert to_hex(handle.get_color()) == plots.strategy_color(label.split(" / ")[0])


def _scaling_frame() -> pd.DataFrame:
    rows = []
    for strategy in DRAWN:
        for p in (1, 2, 4):
            rows.append((strategy, "measured", p, 100.0 * p))
            rows.append((strategy, "calibrated", p, 90.0 * p))
        rows.append((strategy, "calibrated, shared cores", 4, 300.0))
        for p in (8, 16):
            rows.append((strategy, "v100_ib100, paper size", p, 10.0 * p))
    frame = pd.DataFrame(rows, columns=["strategy", "source", "world_size", "iteration_ms"])
    return pd.concat([frame.assign(model="m1"), frame.assign(model="m2")], ignore_index=True)


def test_scaling_figure_colours_styles_panels_and_legend() -> None:
    fig = plots.scaling_lines(_scaling_frame())
    for label, colour in _line_colours(fig).items():
        strategy = label.split(" (")[0]
        assert colour == plots.STRATEGY_COLORS[strategy], label
    here: set[int] = set()
    cluster: set[int] = set()
    for ax in fig.axes:
        for line in ax.get_lines():
            source = line.get_label().split(" (", 1)[1].rstrip(")")
            (cluster if source.startswith("v100_ib100") else here).add(id(ax))
            if source == "measured":
                assert line.get_linestyle() == "-" and line.get_fillstyle() == "full"
            elif source == "calibrated" or source.startswith("v100_ib100"):
                assert line.get_linestyle() == "--" and line.get_fillstyle() == "none"
    assert len(here) == len(cluster) == 2 and not here & cluster  # V100 in its own panels
    _one_strategy_legend(fig, DRAWN)
    # The style key, once, in grey (not a strategy's colour).
    key = [leg for leg in fig.legends if "measured here" in [t.get_text() for t in leg.get_texts()]]
    assert len(key) == 1 and len(fig.legends) == 2
    assert all(
        to_hex(h.get_color()) not in plots.STRATEGY_COLORS.values() for h in key[0].legend_handles
    )


def test_second_order_and_convergence_figures_use_the_mapping() -> None:
    compared = list(plots.COMPARED)
    head = pd.DataFrame(
        [
            {
                "model": m,
                **{f"{k}_{s}/dp": 1.5 for k in ("compute", "comm", "memory") for s in compared},
            }
            for m in ("a", "b")
        ]
    )
    fig = plots.ratio_bars(head)
    colours = _line_colours(fig)
    for s in compared:
        assert colours[f"{s} / {plots.REFERENCE}"] == plots.STRATEGY_COLORS[s]
    _one_strategy_legend(fig, [f"{s} / {plots.REFERENCE}" for s in compared])

    curves = pd.DataFrame(
        [
            {"strategy": s, "world_size": p, "epoch": e, "test_acc": 0.6 + 0.03 * e}
            for s in DRAWN
            for p in (1, 2)
            for e in (1, 2, 3)
        ]
    )
    fig = plots.accuracy_curves(curves)
    colours = _line_colours(fig)
    assert colours == {s: plots.STRATEGY_COLORS[s] for s in DRAWN}
    _one_strategy_legend(fig, DRAWN)
