"""``results/README.md``: what each table in ``results/`` is, and how far to trust it.

One line of prose per table (:data:`experiments.config.TABLES`) says what it holds and
whether it was measured here or predicted; the rest is read from the saved rows, so it
cannot drift: the hardware (cores, threads per rank, torch), how many repeated runs
stand behind each number, and how noisy they were (the spread of the measured ratio to
SGD over those runs, of the accuracy over seeds). ``make notebook`` (through ``python -m
experiments.bench.results_index``) rewrites it; a test compares it with a fresh
:func:`index`.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.bench import tables, takeaways
from experiments.bench.pages import distinct_values, machines, write_page
from experiments.config import TABLES


def _conditions(raw: pd.DataFrame, name: str = "") -> str:
    """Where a table's rows ran: the machine (:func:`experiments.bench.pages.machines`; a
    count where they mix, which their page lists), threads per rank and the process group."""
    if raw.empty:
        return "–"
    backend = "gloo" if int(raw.get("world_size", pd.Series([1])).max()) > 1 else "one process"
    if name == "convergence_scale":  # launcher=threads: every rank a thread of one process
        backend = "ranks as threads of one process"
    found = machines(raw)
    where = str(found.index[0]) if len(found) == 1 else f"{len(found)} machines (see the page)"
    threads = distinct_values(raw, "threads")
    return f"{where}; {threads} thread(s)/rank, {backend}"


def _runs(raw: pd.DataFrame) -> str:
    if raw.empty or "seed" not in raw:
        return "1" if not raw.empty else "–"
    # A job is one grid point but its seed (a convergence_scale job also has a multiplier).
    job = [c for c in ("model", "setting", "world_size", "strategy", "lr_multiplier") if c in raw]
    counts = raw.groupby(job, dropna=False)["seed"].nunique(dropna=False)
    lo, hi = int(counts.min()), int(counts.max())
    return str(lo) if lo == hi else f"{lo}–{hi}"


#: The noise of a table whose jobs ran once each.
ONE_RUN = "one run per job: not measured"


def _ratio_spread(spread: pd.DataFrame) -> str | None:
    """How far the K-FAC configs' ratios to SGD moved over repeated runs (SGD's own is 1);
    None where no job ran more than once."""
    if not spread.empty:
        spread = spread[(spread["runs"] > 1) & ~spread["first_order"].astype(bool)]
    if spread.empty:
        return None
    middle = (spread["vs_sgd_max"] + spread["vs_sgd_min"]) / 2
    width = 100 * (spread["vs_sgd_max"] - spread["vs_sgd_min"]) / middle
    return (
        f"the ratio to SGD spans {width.median():.0f}% of itself over the runs (median "
        f"over configs), {width.max():.0f}% at most"
    )


def _noise(name: str, raw: pd.DataFrame, results: Path) -> str:
    """How much the table's headline numbers moved between repeated runs."""
    if name == "network":  # its jobs repeat per rate, which the page's own frame keeps apart
        frame = takeaways.read_result(results, "network.csv")
        return _ratio_spread(frame if frame is not None else pd.DataFrame()) or ONE_RUN
    if name in ("ablation", "time_breakdown", "second_order_update", "scaling") and not raw.empty:
        text = _ratio_spread(tables.vs_sgd_spread(raw))
        if text is None:
            return ONE_RUN
        errors = takeaways.read_result(results, "scaling_errors.csv") if name == "scaling" else None
        if errors is not None:
            held = takeaways.held_out_errors(errors)[0]
            text += f"; held-out phase error {held.mean():.0f}% mean, {held.median():.0f}% median"
        return text
    if name == "convergence":
        final = takeaways.read_result(results, "convergence_final.csv")
        if final is not None and int(final["seeds"].max()) > 1:
            return (
                f"accuracy std over seeds {final['std'].median():.4f} (median), "
                f"{final['std'].max():.4f} at most"
            )
        return "one seed per run: not measured"
    if name == "convergence_scale":
        cells = takeaways.read_result(results, "convergence_scale_cells.csv")
        if cells is not None:
            several = cells[cells["seeds"] > 1]
            if len(several):
                return (
                    f"final accuracy std over seeds {several['final_acc_std'].median():.4f} "
                    f"(median over {len(several)} cells with several seeds)"
                )
        return "one seed per cell: not measured"
    if name == "fidelity":
        return "one run per model: not measured"
    return "exact (no timing)"


def index(results: Path) -> list[str]:
    """The lines of ``results/README.md``."""
    lines = [
        "# Results",
        "",
        "Every table here is written by a command and read back by the notebook",
        "(`notebooks/results.ipynb`); measured tables ran on this project's CPU machine, so",
        "absolute times are a CPU's and only ratios measured side by side carry over. `runs`:",
        "repeated runs (seeds) behind each number; `noise`: how far those runs disagreed.",
        "This page is generated (`make notebook`).",
        "",
        "| table | kind | what | measured on | runs | noise | recipe |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in TABLES.values():
        if not entry.shown or not (results / f"{entry.name}.md").exists():
            continue
        path = results / "raw" / f"{entry.name}.csv"
        raw = tables.load_rows([path]) if path.exists() else pd.DataFrame()
        if not raw.empty:
            raw = raw[raw["error"] == ""]
        if entry.shown in ("predicted", "simulated"):
            measured = runs = "–"
        else:
            measured, runs = _conditions(raw, entry.name), _runs(raw)
        lines.append(
            f"| [{entry.name}]({entry.name}.md) | {entry.shown} | {entry.what} | {measured} | "
            f"{runs} | {_noise(entry.name, raw, results)} | `{entry.recipe}` |"
        )
    return lines


if __name__ == "__main__":
    import sys

    results = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("results")
    print(write_page(results / "README.md", index(results)))
