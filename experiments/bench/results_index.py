"""``results/README.md``: what each table in ``results/`` is, and how far to trust it.

One line of prose per table says what it holds and whether it was measured
here or predicted; the rest is read from the saved rows, so it cannot drift:
the hardware (cores, threads per rank, torch), how many repeated runs stand
behind each number, and how noisy they were (the spread of the measured ratio
to SGD over those runs, of the accuracy over seeds). ``make notebook`` (through
``python -m experiments.bench.results_index``) rewrites it; a test compares it
with a fresh :func:`index`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from experiments.bench import tables


@dataclass(frozen=True)
class Entry:
    """One table of ``results/``.

    Attributes:
        name: the file stem (``results/<name>.md``).
        kind: "measured" (on this machine), "predicted" (the cost model) or "simulated".
        what: what it holds, in one sentence.
        recipe: the command that writes it.
    """

    name: str
    kind: str
    what: str
    recipe: str


TABLES = (
    Entry(
        "second_order_update",
        "measured",
        "Cost of one second-order update per strategy (compute, bytes, K-FAC memory), "
        "DP-KFAC against the baselines, six models.",
        "python -m experiments.bench -m table=second_order_update",
    ),
    Entry(
        "ablation",
        "measured + predicted",
        "From D-KFAC to DP-KFAC one switch at a time, every strategy config interleaved at "
        "P=2, beside the cost model's prediction at P=64 on V100/InfiniBand.",
        "python -m experiments.bench -m table=ablation",
    ),
    Entry(
        "time_breakdown",
        "measured",
        "One iteration split into its phases per strategy (the stacked bars).",
        "python -m experiments.bench -m table=time_breakdown",
    ),
    Entry(
        "scaling",
        "measured + predicted",
        "Iteration time at P=1, 2, 4 and predicted to 256; the cost model's per-phase error "
        "with the predicted world size held out (scaling_errors.csv).",
        "python -m experiments.bench -m table=scaling",
    ),
    Entry(
        "convergence",
        "measured",
        "Test accuracy per epoch on scikit-learn digits (the default preset) per strategy "
        "and P, and the smoke status of every training preset.",
        "python -m experiments.bench -m table=convergence",
    ),
    Entry(
        "fidelity",
        "measured",
        "Cosine between the update from an owner's local factors and the one from all "
        "ranks' factors, per layer over training steps.",
        "python -m experiments.bench table=fidelity",
    ),
    Entry(
        "paper",
        "predicted",
        "The DP-KFAC paper's headline ratios predicted at P=64 on V100/InfiniBand for the "
        "paper-size models.",
        "python -m experiments.bench.tables paper",
    ),
    Entry(
        "scale_sim",
        "simulated",
        "One rank of a P=64-1024 job on torch's fake process group: its bytes, calls and "
        "memory against the cost model's, exactly.",
        "python -m experiments.bench table=scale_sim",
    ),
)


def _conditions(raw: pd.DataFrame) -> str:
    if raw.empty:
        return "–"
    cores = "/".join(dict.fromkeys(str(int(c)) for c in raw.get("cpus", pd.Series()).dropna()))
    threads = "/".join(dict.fromkeys(str(int(c)) for c in raw.get("threads", pd.Series()).dropna()))
    backend = "gloo" if int(raw.get("world_size", pd.Series([1])).max()) > 1 else "one process"
    return f"{cores or '?'} CPU cores, {threads or '?'} thread(s)/rank, {backend}"


def _runs(raw: pd.DataFrame) -> str:
    if raw.empty or "seed" not in raw:
        return "1" if not raw.empty else "–"
    per_job = raw.groupby(["model", "setting", "world_size", "strategy"], dropna=False)["seed"]
    counts = per_job.nunique(dropna=False)
    lo, hi = int(counts.min()), int(counts.max())
    return str(lo) if lo == hi else f"{lo}–{hi}"


def _noise(name: str, raw: pd.DataFrame, results: Path) -> str:
    """How much the table's headline numbers moved between repeated runs."""
    if name in ("ablation", "time_breakdown", "second_order_update", "scaling") and not raw.empty:
        spread = tables.vs_sgd_spread(raw)
        if not spread.empty:  # K-FAC configs repeated; SGD's own ratio is 1 by definition
            spread = spread[(spread["runs"] > 1) & ~spread["first_order"].astype(bool)]
        if spread.empty:
            return "one run per job: not measured"
        middle = (spread["vs_sgd_max"] + spread["vs_sgd_min"]) / 2
        width = 100 * (spread["vs_sgd_max"] - spread["vs_sgd_min"]) / middle
        text = (
            f"the ratio to SGD spans {width.median():.0f}% of itself over the runs (median "
            f"over configs), {width.max():.0f}% at most"
        )
        errors = results / "scaling_errors.csv"
        if name == "scaling" and errors.exists():
            from experiments.bench.predict import phase_errors

            held = phase_errors(pd.read_csv(errors))["held_out_error_%"].abs().dropna()
            text += f"; held-out phase error {held.mean():.0f}% mean, {held.median():.0f}% median"
        return text
    if name == "convergence":
        path = results / "convergence_final.csv"
        if path.exists():
            final = pd.read_csv(path)
            if int(final["seeds"].max()) > 1:
                return (
                    f"accuracy std over seeds {final['std'].median():.4f} (median), "
                    f"{final['std'].max():.4f} at most"
                )
        return "one seed per run: not measured"
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
    for entry in TABLES:
        if not (results / f"{entry.name}.md").exists():
            continue
        path = results / "raw" / f"{entry.name}.csv"
        raw = tables.load_rows([path]) if path.exists() else pd.DataFrame()
        if not raw.empty:
            raw = raw[raw["error"] == ""]
        measured = "–" if entry.kind in ("predicted", "simulated") else _conditions(raw)
        runs = "–" if entry.kind in ("predicted", "simulated") else _runs(raw)
        lines.append(
            f"| [{entry.name}]({entry.name}.md) | {entry.kind} | {entry.what} | {measured} | "
            f"{runs} | {_noise(entry.name, raw, results)} | `{entry.recipe}` |"
        )
    return lines


def write(results: Path) -> Path:
    """Write ``results/README.md``."""
    path = results / "README.md"
    path.write_text("\n".join(index(results)) + "\n")
    return path


if __name__ == "__main__":
    import sys

    print(write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("results")))
