"""The committed tables are what their committed rows render to, byte for byte.

A table page is a function of its rows (``results/raw/<table>.csv``): rendering
those rows again must give the committed files. This holds the table code to its
output while it is rewritten, and catches a writer that reads its own CSV back
differently from the sweep's rows (an empty CSV cell reads back as NaN).
The cheap tables are checked here; ``scaling`` (minutes of held-out fitting),
``ablation`` and ``second_order_update`` (the cost model at P=64 per row) are
checked by hand with ``python -m experiments.bench.tables NAME --results DIR``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

from experiments.bench.tables import load_rows, write_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


@pytest.mark.parametrize("table", ["convergence", "convergence_scale", "time_breakdown"])
def test_a_committed_table_is_what_its_rows_render_to(table: str, tmp_path: Path) -> None:
    raw = RESULTS / "raw"
    (tmp_path / "raw").mkdir()
    for extra in raw.glob("*.xml"):  # the smoke report the convergence page embeds
        shutil.copy(extra, tmp_path / "raw" / extra.name)
    paths = write_table(table, load_rows([raw / f"{table}.csv"]), tmp_path)
    written = [p for key, p in paths.items() if key != "raw" and p.suffix in {".md", ".csv"}]
    assert written, paths
    for path in written:
        committed = RESULTS / path.name
        if path.suffix == ".md":
            assert path.read_text() == committed.read_text(), f"{path.name} differs"
        else:  # the last bit of a float may differ with the BLAS's thread count
            pd.testing.assert_frame_equal(pd.read_csv(path), pd.read_csv(committed), rtol=1e-12)
