"""What every results page shares: the rows a table may use and how a page is written.

The table writers (:mod:`experiments.bench.tables`), the paper table
(:mod:`experiments.bench.paper`), the scale simulation and the convergence-at-scale
table all build their pages from these pieces, so this module sits below them
all and imports none of them: which rows count (successful ones; of a job
repeated over seeds, the median run, whole), the markdown table, and a
page's takeaway and footer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd


def first_order(row: dict[str, Any]) -> bool:
    """Whether a row measured no preconditioner: its ``kfac_options`` are null.

    Decided from what was configured, not from the strategy config's name.
    """
    value = row.get("kfac_options")
    if isinstance(value, str):
        value = json.loads(value) if value.strip() else None
    return value is None or (isinstance(value, float) and value != value)


def ok_rows(df: pd.DataFrame, task: str = "timing") -> pd.DataFrame:
    """Successful rows of one task; a timing measurement repeated over jobs is its median run
    (:func:`median_runs`)."""
    if df.empty:
        return df
    keep = (df["error"] == "") & (df.get("task", task) == task)
    rows = df[keep].copy()
    return median_runs(rows) if task == "timing" else rows


#: What makes jobs repeats of one another: a sweep over ``seed`` differs in nothing else.
JOB = ["model", "setting", "world_size"]


def median_runs(df: pd.DataFrame) -> pd.DataFrame:
    """One job per repeated measurement: of the jobs that repeat it, the median run, whole.

    A sweep over ``seed`` runs each job several times; on a shared machine a
    whole run can be faster or slower than the next (oversubscribed ranks,
    other tenants), which medians over steps within a run cannot remove. Jobs
    are ranked by the total iteration time of their strategies and the middle
    one is kept with all its rows (the lower middle of an even count), so a
    table's ratios still come from strategies measured in turns under one
    load, and each row's phases, link probes and step records are one run's.
    Jobs run once pass unchanged.
    """
    if df.empty or "seed" not in df:
        return df
    seed = df["seed"].fillna(-1)
    keep = pd.Series(False, index=df.index)
    for _, job in df.groupby(JOB, sort=False, dropna=False):
        totals = job.groupby(seed[job.index])["iteration_s"].sum().sort_values(kind="stable")
        keep[job.index] = seed[job.index] == totals.index[(len(totals) - 1) // 2]
    return df[keep]


def failures(df: pd.DataFrame) -> list[str]:
    """One line per failed job, for the table's footer."""
    if df.empty:
        return []
    bad = df[df["error"] != ""]
    return [
        f"{r.model} {r.strategy} P={r.world_size} {r.setting}: {r.error}" for r in bad.itertuples()
    ]


def ratio_text(value: float, low: float, high: float, runs: int, unit: str = "") -> str:
    """``1.19 (1.15–1.23)``: a ratio (then ``unit``) and its range over ``runs`` repeated runs
    (if several)."""
    if value != value:  # NaN
        return "–"
    spread = f" ({low:.2f}–{high:.2f})" if runs > 1 and low == low and low != high else ""
    return f"{value:.2f}{unit}{spread}"


def _fmt(value: Any, digits: int) -> str:
    if not isinstance(value, float):
        return str(value)
    return "–" if value != value else f"{value:.{digits}f}"  # NaN: –


def to_markdown(df: pd.DataFrame, digits: int | dict[str, int] = 2) -> str:
    """A GitHub markdown table (numbers right-aligned), without extra dependencies."""
    cols = list(df.columns)
    width = {c: digits.get(c, 2) if isinstance(digits, dict) else digits for c in cols}
    numeric = {c: pd.api.types.is_numeric_dtype(df[c]) for c in cols}
    lines = [
        "| " + " | ".join(str(c) for c in cols) + " |",
        "|" + "|".join("---:" if numeric[c] else "---" for c in cols) + "|",
    ]
    for row in df.itertuples(index=False):
        cells = (_fmt(v, width[c]) for v, c in zip(row, cols, strict=True))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def distinct_values(df: pd.DataFrame, column: str) -> str:
    """``2/4``: the distinct values of a column, in order (``?`` for none)."""
    if column not in df:
        return "?"
    seen = dict.fromkeys(
        str(int(v)) if isinstance(v, float) else str(v) for v in df[column].dropna()
    )
    return "/".join(seen) or "?"


def conditions(df: pd.DataFrame) -> str:
    """One line on where the rows ran: threads per rank, cores, torch (what the rows say)."""
    return (
        f"Ran with {distinct_values(df, 'threads')} thread(s) per rank on a machine of "
        f"{distinct_values(df, 'cpus')} core(s), torch {distinct_values(df, 'torch')}."
    )


def footer(df: pd.DataFrame) -> list[str]:
    """A table's closing lines: where its rows ran, and its failed jobs if any."""
    lines = failures(df)
    failed = ["", "## Failed jobs", "", *[f"- {x}" for x in lines]] if lines else []
    return ["", conditions(df), *failed] if not df.empty else failed


def with_takeaway(md: list[str], takeaway: list[str]) -> list[str]:
    """The table's lines with its takeaway right under the title."""
    return [md[0], "", *takeaway, *md[1:]] if takeaway else md


def write_page(path: Path, lines: Sequence[str]) -> Path:
    """Write a table's markdown lines (one trailing newline)."""
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path
