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
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
#: Where the smoke report lies, relative to the results folder (the Makefile's smoke-report).
JUNIT = Path("raw") / "smoke_junit.xml"


def smoke_cases(junit: Path) -> pd.DataFrame:
    """Every test case of a JUnit report: name, status and seconds."""
    if not junit.exists():
        return pd.DataFrame()
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        status = "passed"
        for tag, word in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
            if case.find(tag) is not None:
                status = word
        rows.append(
            {
                "test": case.get("name", ""),
                "status": status,
                "seconds": float(case.get("time", "nan")),
            }
        )
    return pd.DataFrame(rows)


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
