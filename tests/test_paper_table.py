"""`python -m experiments.bench.tables paper`: the paper's 64-GPU ratios, predicted from configs."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from dpkfac.costmodel import PRESETS, predict
from dpkfac.costmodel.memory import activation_bytes, process_memory_of
from experiments.bench import paper, tables
from experiments.bench.predict import measurement, row_shapes

ROOT = Path(__file__).resolve().parents[1]
RATIOS = ("computation", "comm_time", "comm_bytes", "process_memory", "kfac_memory")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[pd.DataFrame, str]:
    out = tmp_path_factory.mktemp("results")
    tables.main(["paper", "--results", str(out)])
    frame = pd.read_csv(out / "paper.csv", keep_default_na=False, na_values=[""])
    return frame, (out / "paper.md").read_text()


def test_the_command_writes_one_row_per_paper_model(written: tuple[pd.DataFrame, str]) -> None:
    frame, md = written
    assert list(frame["model"]) == list(paper.MODELS)
    by = frame.set_index("model")
    assert by.loc["resnet50", "setting"] == "batch 32, px 224 per GPU"
    assert by.loc["bert_large", "setting"] == "batch 4, seq 384 per GPU"
    assert set(frame["P"]) == {64}
    for metric in RATIOS:
        assert all(math.isfinite(x) and x > 0 for x in frame[f"{metric}_x"]), metric
        assert set(frame[f"{metric}_best"]) <= set(paper.BASELINES), metric
    assert set(frame["paper_computation"]) == {"1.55–1.65"}
    assert set(frame["paper_communication"]) == {"2.79–3.15"}
    assert set(frame["paper_memory"]) == {"1.14–1.47"}
    for r in frame.itertuples():
        # One sentence per row, carrying the row's own numbers and where they fall.
        text = r.explanation
        assert text.count(". ") == 0 and text.endswith(".")
        assert f"computation {r.computation_x:.2f}× is " in text
        assert f"{r.comm_bytes_x:.2f}× in bytes" in text
        lo, hi = paper.PAPER["memory"]
        where = (
            "below" if r.process_memory_x < lo else "above" if r.process_memory_x > hi else "within"
        )
        assert f"memory is {r.process_memory_x:.2f}× ({where} the paper's" in text
        assert f"- {text}" in md
    assert md.startswith("# The DP-KFAC paper's headline, predicted: P=64")


def test_ratios_are_the_cost_models_own(written: tuple[pd.DataFrame, str]) -> None:
    """Each ratio equals predict() called directly on the same shapes, options and preset."""
    frame, _ = written
    rows = [r for r in paper.described_rows(["resnet50"])]
    shapes, sharing = row_shapes(rows[0], paper=True)
    preds = {}
    for r in rows:
        m = measurement(r, shapes=shapes, weight_sharing=sharing)
        preds[r["strategy"]] = predict(
            shapes,
            strategy=m.strategy,
            world_size=64,
            hardware=PRESETS["v100_ib100"],
            kfac=m.kfac,
            options=m.options,
        )
    got = frame.set_index("model").loc["resnet50"]
    dp = preds["dp_kfac"]
    comp = {b: preds[b].update.computation / dp.update.computation for b in paper.BASELINES}
    assert got["computation_best"] == min(comp, key=lambda b: comp[b])
    assert got["computation_x"] == pytest.approx(min(comp.values()))
    assert got["kfac_memory_x"] == pytest.approx(
        min(preds[b].memory_max for b in paper.BASELINES) / dp.memory_max
    )

    def whole(b: str) -> int:
        state = process_memory_of(preds[b], shapes, optimizer="sgd_momentum")
        return state.total + activation_bytes(shapes)

    assert got["process_memory_x"] == pytest.approx(
        min(whole(b) for b in paper.BASELINES) / whole("dp_kfac")
    )


def test_the_committed_table_is_the_commands_output(written: tuple[pd.DataFrame, str]) -> None:
    frame, md = written
    committed = pd.read_csv(ROOT / "results" / "paper.csv", keep_default_na=False, na_values=[""])
    pd.testing.assert_frame_equal(frame, committed)
    assert (ROOT / "results" / "paper.md").read_text() == md
