"""Whole-process memory in the benchmark: step records -> rows -> ``second_order_update``."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
from test_benchmark_tables import _record, fake_row, timing_rows

from experiments.bench import pages, predict, tables
from experiments.bench.aggregate import aggregate

MiB = 2**20


def _with_process(record: dict, total: int, peak: int | None = None) -> dict:
    kfac = sum(record["memory"].values())
    process = {
        "parameters": 100,
        "gradients": 100,
        "optimizer": 100,
        "module_buffers": 8,
        "kfac": kfac,
        "total": total,
    }
    if peak is not None:
        process["peak_cuda"] = peak
    return {**record, "process_memory": process}


def test_rows_carry_the_busiest_ranks_process_memory_and_the_highest_cuda_peak() -> None:
    fast = [_with_process(_record("decomp", 1.0, 8), 500, peak=9000) for _ in range(2)]
    slow = [_with_process(_record("decomp", 2.0, 8), 900, peak=7000) for _ in range(2)]
    slow[1]["memory"] = {**slow[1]["memory"], "factors_bytes": 1000}  # rank 1 holds the most
    row = aggregate([{"rank": 0, "records": fast}, {"rank": 1, "records": slow}], 1, 1)
    assert (row["mem_rank"], row["mem_process"]) == (1, 900)
    assert row["mem_process_parameters"] == row["mem_process_optimizer"] == 100
    assert row["mem_process_module_buffers"] == 8
    assert row["mem_process_peak_cuda"] == 9000
    # Records from before the tally: no process columns at all, the rest unchanged.
    old = aggregate([{"rank": 0, "records": [_record("decomp", 1.0, 8)]}], 1, 1)
    assert not any(k.startswith("mem_process") for k in old)


def test_second_order_update_shows_measured_and_predicted_process_memory(tmp_path: Path) -> None:
    rows = timing_rows()
    mem = {"none": 10, "dp_kfac": 20, "d_kfac": 50, "spd_kfac": 40}
    rows["mem_process"] = [mem.get(s, float("nan")) * MiB for s in rows["strategy"]]
    long, head = tables.second_order_frames(rows)
    by = long.set_index("strategy")
    assert by.loc["d_kfac", "process_memory"] == pytest.approx(50)
    assert by.loc["d_kfac", "process_memory/dp"] == pytest.approx(2.5)
    assert head.iloc[0]["process_memory_best/dp"] == pytest.approx(2.0)  # spd_kfac's 40 / 20
    columns = list(head.columns)
    assert columns.index("process_memory_best/dp") == columns.index("memory_best/dp") + 1
    # The prediction is the cost model's, row by row: the state tally plus the activations.
    ok = pages.ok_rows(rows)
    shapes, sharing = predict.row_shapes(ok.iloc[0].to_dict())
    for strategy in ("none", "dp_kfac", "d_kfac"):
        row = ok[ok["strategy"] == strategy].iloc[0].to_dict()
        want = predict.row_process_memory(row, shapes, sharing)
        assert want["process_bytes"] == want["process_state_bytes"] + want["activation_bytes"]
        assert by.loc[strategy, "pred_process_memory"] == pytest.approx(want["process_bytes"] / MiB)
    # dp_kfac holds less K-FAC state than d_kfac; everything else is the same model's.
    assert 1.0 < head.iloc[0]["pred_process_memory_best/dp"] < head.iloc[0]["memory_best/dp"]
    paths = tables.write_table("second_order_update", rows, tmp_path)
    csv = pd.read_csv(paths["csv"])
    assert {"process_memory_MiB", "pred_process_memory_MiB"} <= set(csv.columns)
    assert "Whole-process memory: 2.00× less measured" in paths["md"].read_text()


def test_old_rows_without_the_tally_still_render(tmp_path: Path) -> None:
    rows = timing_rows()  # no mem_process column: rows measured before the tally
    paths = tables.write_table("second_order_update", rows, tmp_path)
    again = tables.load_rows([paths["raw"]])
    long, head = tables.second_order_frames(again)
    assert long["process_memory"].isna().all()
    assert math.isnan(head.iloc[0]["process_memory_best/dp"])
    assert math.isfinite(head.iloc[0]["pred_process_memory_best/dp"])
    md = paths["md"].read_text()
    assert "not measured in these rows" in md and "| – |" in md


def test_a_row_without_its_model_gets_no_prediction() -> None:
    row = fake_row("dp_kfac")
    del row["model_config"]
    assert math.isnan(tables.predicted_process_memory([row])[0])
