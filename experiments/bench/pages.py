"""What every results page shares: the rows a table may use and how a page is written.

The table writers (:mod:`experiments.bench.tables`), the paper table
(:mod:`experiments.bench.paper`), the scale simulation and the convergence-at-scale
table all build their pages from these pieces, so this module sits below them
all and imports none of them: which rows count (successful ones; of a job
repeated over seeds, the median run, whole), the markdown table, and a
page's layout (its answer first, then its figure, its tables, and its notes on
method below them), the machine its rows ran on, ranges over runs and ties.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
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
    bad = df[df["error"].fillna("") != ""]
    lines = []
    for r in bad.to_dict("records"):
        # A timing job names its setting; a training run of the convergence study its point.
        where = [str(r["setting"])] if _text(r.get("setting")) else []
        where += [f"{k} {r[k]:g}" for k in ("lr_multiplier", "damping") if _number(r.get(k))]
        where += [f"seed {int(r['seed'])}"] if _number(r.get("seed")) and "setting" not in r else []
        lines.append(
            f"{r['model']} {r['strategy']} P={r['world_size']} {' '.join(where)}: {r['error']}"
        )
    return lines


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and value == value


def ratio_text(value: float, low: float, high: float, runs: int, unit: str = "") -> str:
    """``1.19 (1.15–1.23)``: a ratio (then ``unit``) and its range over ``runs`` repeated runs
    (if several)."""
    if value != value:  # NaN
        return "–"
    spread = f" ({low:.2f}–{high:.2f})" if runs > 1 and low == low and low != high else ""
    return f"{value:.2f}{unit}{spread}"


def overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two ranges over runs (``(low, high)``) overlap: then neither side won.

    On a shared machine one run can favour either side, so a difference is only
    claimed where every run agrees on it; a ratio's range is compared with
    ``(1, 1)`` (equal cost). NaN bounds (no range) never overlap.
    """
    return a[0] <= b[1] and b[0] <= a[1]


#: Row values that name an architecture, not a CPU: what rows written before
#: :func:`experiments.bench.machine.cpu_model` read the model name hold.
ARCHITECTURES = frozenset({"x86_64", "amd64", "aarch64", "arm64", "i386", "i686", "ppc64le"})


def _text(value: Any) -> str:
    """A row cell as text: "" for NaN and None, integral floats without ``.0``."""
    if value is None or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def machine_label(row: Mapping[str, Any]) -> str:
    """``AMD EPYC, 2 cores, AVX-512 (torch's AVX512 kernels)``: the machine a row names.

    From the columns :func:`experiments.bench.machine.machine` writes (``cpu``,
    ``cpus``, ``cpu_isa``, ``cpu_capability``). Rows from before they held the CPU's
    model name carry only the architecture (``x86_64``) and no ISA; their label says
    so, so that a page never passes such rows off as a known machine.
    """
    cpu, cores = _text(row.get("cpu")), _text(row.get("cpus"))
    isa, kernels = _text(row.get("cpu_isa")), _text(row.get("cpu_capability"))
    if not cpu or cpu.lower() in ARCHITECTURES:
        cpu = f"{cpu or 'CPU'} (model not recorded)"
    parts = [cpu, f"{cores} cores" if cores else "cores not recorded"]
    if isa and kernels:
        parts.append(f"{isa} (torch's {kernels} kernels)")
    elif isa or kernels:
        parts.append(isa or f"torch's {kernels} kernels")
    else:
        parts.append("vector ISA not recorded")
    return ", ".join(parts)


#: The vector ISA fields a row may leave empty (written before they were recorded).
VECTOR_FIELDS = ("cpu_isa", "cpu_capability")


def _completed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` with a vector field a row leaves empty taken from the rows that name the
    same CPU model and cores and agree on every vector field it does name, where those
    name one value: rows written before ``cpu_isa`` was recorded, on the machine that
    later rows describe in full, are that machine. A row that names no CPU model (an
    architecture only) is left as it is."""
    out = []
    for r in records:
        cpu = _text(r.get("cpu"))
        missing = [f for f in VECTOR_FIELDS if not _text(r.get(f))]
        if not missing or not cpu or cpu.lower() in ARCHITECTURES:
            out.append(r)
            continue
        named = {f: _text(r.get(f)) for f in VECTOR_FIELDS if f not in missing}
        peers = [
            q
            for q in records
            if _text(q.get("cpu")) == cpu
            and _text(q.get("cpus")) == _text(r.get("cpus"))
            and all(_text(q.get(f)) == v for f, v in named.items())
        ]
        filled = dict(r)
        for f in missing:
            values = {_text(q.get(f)) for q in peers} - {""}
            if len(values) == 1:
                filled[f] = values.pop()
        out.append(filled)
    return out


def machines(df: pd.DataFrame) -> pd.Series:
    """How many rows each machine (:func:`machine_label`) holds, most rows first (then by
    name). A row that leaves a vector field empty counts as the machine the rows naming
    it describe, where they agree on everything it names (:func:`_completed`)."""
    if df.empty:
        return pd.Series(dtype=int)
    records = _completed(df.to_dict("records"))
    labels = pd.Series([machine_label(r) for r in records], index=df.index)
    counts = labels.value_counts().sort_index()  # ties by name, so pages do not reorder
    return counts.sort_values(ascending=False, kind="stable")


class MixedMachines(ValueError):
    """A table's rows come from more than one machine (its message names them)."""


def one_machine(df: pd.DataFrame, table: str) -> str:
    """The one machine ``df``'s rows ran on; :class:`MixedMachines` naming them all if not.

    Timing tables call this: their ratios are taken within a run, but the runs
    of one table are read side by side (one model against another, P=1 against
    P=4, a cost model fitted to all of them), which two CPUs would confound.
    """
    found = machines(df)
    if len(found) > 1:
        named = "; ".join(f"{label} ({n} rows)" for label, n in found.items())
        raise MixedMachines(
            f"{table}: its rows come from {len(found)} machines: {named}. Measure the table "
            "again on one machine, or pass one machine's rows (--rows)."
        )
    return str(found.index[0]) if len(found) else "no rows"


def _span_of_times(df: pd.DataFrame) -> str:
    """``2026-12-01 13:50–14:36``: when the rows were measured (their ``time`` column)."""
    times = sorted(str(t) for t in df.get("time", pd.Series(dtype=str)).dropna())
    if not times:
        return "their times are not recorded"
    first, last = times[0].replace("T", " ")[:16], times[-1].replace("T", " ")[:16]
    return first if first == last else f"{first}–{last[11:] if last[:10] == first[:10] else last}"


def machine_line(df: pd.DataFrame) -> str:
    """A page's line on where its rows ran: the one machine, or that they mix machines.

    Rows that do not name their CPU model and ISA (:func:`machine_label`) are never
    called one machine: the line gives what they name and when they ran. Timing
    tables refuse rows of several machines before this (:func:`one_machine`);
    accuracy tables may hold them (runs on two CPUs differ only in rounding), and
    the line then says so at the page's top.
    """
    found = machines(df)
    when = _span_of_times(df)
    if len(found) > 1:
        named = "; ".join(f"{label} ({n} rows)" for label, n in found.items())
        when = "" if "not recorded" in when else f"; {when}"
        return (
            f"**Rows from {len(found)} machines** ({named}{when}): runs on different CPUs "
            "are alike, not bitwise equal, and their times are not comparable."
        )
    label = str(found.index[0]) if len(found) else "no rows"
    if "not recorded" in label:
        ran = f"they were measured {when}" if "not recorded" not in when else when
        return (
            f"Machine: {label}. The rows predate the machine record "
            f"(`experiments.bench.machine.machine`); {ran}."
        )
    return f"Measured on one machine: {label} ({when})."


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


#: The most lines a page's answer may take (issue 42: a page answers in its first lines).
ANSWER_LINES = 5


def page(
    title: str,
    answer: Sequence[str],
    body: Sequence[str],
    method: Sequence[str] = (),
    figure: str | None = None,
) -> list[str]:
    """A results page in the order a reader needs it: the answer, the figure, the tables,
    then the notes on method.

    Args:
        title: The page's heading.
        answer: At most :data:`ANSWER_LINES` lines right under it (the takeaway and where
            the rows ran); more raises ValueError, since a page that needs more to answer
            has not found its answer.
        body: The tables (and their section headings).
        method: How the numbers were made, under ``## Method``.
        figure: The PNG beside the page (``name.png``), shown under the answer.
    """
    answer = [line for line in answer if line]
    if len(answer) > ANSWER_LINES:
        raise ValueError(f"{title!r}: an answer of {len(answer)} lines (at most {ANSWER_LINES})")
    lines = [f"# {title}", "", *answer]
    if figure:
        lines += ["", f"![{figure.removesuffix('.png')}]({figure})"]
    lines += ["", *body]
    if method:
        lines += ["", "## Method", "", *method]
    return lines


def with_takeaway(md: list[str], takeaway: list[str]) -> list[str]:
    """The table's lines with its takeaway right under the title."""
    return [md[0], "", *takeaway, *md[1:]] if takeaway else md


def write_page(path: Path, lines: Sequence[str]) -> Path:
    """Write a table's markdown lines (one trailing newline)."""
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path
