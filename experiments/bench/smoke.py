"""The training presets' smoke status, for the ``convergence`` table.

The training side's smoke test (``tests/test_experiments_smoke.py``) runs
every preset with every strategy for two steps on fake data. The table
reports its outcome per (preset, strategy) from the JUnit XML report that
``make smoke-report`` has pytest write (``results/raw/smoke_junit.xml``,
:data:`JUNIT` under the results folder); nothing here runs the tests. Without
a report the table says so.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
#: Where the smoke report lies, relative to the results folder (the Makefile's smoke-report).
JUNIT = Path("raw") / "smoke_junit.xml"
#: The elements by which a JUnit test case says it did not pass, the first found winning.
OUTCOMES = ("failure", "error", "skipped")


def junit_cases(path: Path) -> Iterator[tuple[ET.Element, str, str]]:
    """Each ``testcase`` of a JUnit XML report with its outcome (the first of
    :data:`OUTCOMES` it holds; "" for a pass) and that element's message: the one
    reader of pytest's reports, for the smoke table and the GPU report."""
    for case in ET.parse(path).getroot().iter("testcase"):
        found = next(((t, e) for t in OUTCOMES if (e := case.find(t)) is not None), None)
        yield case, *(("", "") if found is None else (found[0], found[1].get("message") or ""))


def smoke_cases(junit: Path) -> pd.DataFrame:
    """Every test case of a JUnit report: name, status and seconds."""
    if not junit.exists():
        return pd.DataFrame()
    words = {"failure": "failed", "error": "error", "skipped": "skipped"}
    rows = [
        (case.get("name", ""), words.get(outcome, "passed"), float(case.get("time", "nan")))
        for case, outcome, _ in junit_cases(junit)
    ]
    return pd.DataFrame(rows, columns=["test", "status", "seconds"])


def smoke_matrix(cases: pd.DataFrame) -> pd.DataFrame:
    """Preset x strategy status (with seconds) of the parametrised smoke cases.

    Case ids are matched against the preset and strategy names in ``conf/``,
    so the order pytest joins parameters in does not matter. Cases that name
    no preset are left out (the full list is in the CSV).
    """
    if cases.empty:
        return cases
    presets = sorted((p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")), key=len)
    strategies = [p.stem for p in (ROOT / "conf" / "strategy").glob("*.yaml")]
    cells: dict[str, dict[str, str]] = {}
    for case in cases.itertuples():
        match = re.search(r"\[(.*)\]", case.test)
        if not match:
            continue
        parts = match.group(1).split("-")
        preset = next((p for p in reversed(presets) if p in parts), None)
        strategy = next((s for s in strategies if s in parts), None)
        if preset is None or strategy is None:
            continue
        cells.setdefault(preset, {})[strategy] = f"{case.status} ({case.seconds:.1f} s)"
    frame = pd.DataFrame.from_dict(cells, orient="index").sort_index()
    frame.index.name = "preset"
    return frame.reset_index()


def smoke_summary(matrix: pd.DataFrame) -> pd.DataFrame:
    """One row per preset of :func:`smoke_matrix`: how many strategy configs ran and passed,
    which did not (with their status) and the slowest case's seconds.

    The page's table: the matrix has a column per strategy config, too wide to read
    (the cases' CSV keeps every one).
    """
    rows = []
    for record in matrix.to_dict("records"):
        cells = {s: v for s, v in record.items() if s != "preset" and isinstance(v, str)}
        other = [f"{s}: {v}" for s, v in cells.items() if not v.startswith("passed")]
        seconds = [
            float(m.group(1)) for v in cells.values() if (m := re.search(r"\(([\d.]+) s\)", v))
        ]
        rows.append(
            {
                "preset": record["preset"],
                "strategies": len(cells),
                "passed": len(cells) - len(other),
                "not passed": "; ".join(other) or "–",
                "slowest s": max(seconds, default=float("nan")),
            }
        )
    return pd.DataFrame(rows)
