"""The GPU report's own code, run on the CPU (``--device cpu``): every section is written."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from experiments.bench import gpu_report

JUNIT = """<?xml version="1.0"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.test_gpu" name="test_a"/>
<testcase classname="tests.test_gpu" name="test_b"><failure message="boom">x</failure></testcase>
<testcase classname="tests.test_gpu" name="test_c"><skipped message="needs 2 GPUs"/></testcase>
</testsuite></testsuites>
"""


@pytest.mark.slow
def test_the_report_writes_every_section_on_the_cpu(tmp_path: Path, single_thread: None) -> None:
    junit = tmp_path / "gpu-tests.xml"
    junit.write_text(JUNIT)
    out = tmp_path / "results"
    argv = ["--device", "cpu", "--junit", str(junit), "--out", str(out), "--steps", "2"]
    argv += ["--warmup", "1", "--batch", "2", "--strategies", "dp_kfac,kaisa_mem_opt"]
    assert gpu_report.main(argv) == 0
    rows = list(csv.DictReader((out / "gpu.csv").open()))
    by = {(r["section"], r["name"]): r for r in rows}
    assert by[("tests", "test_b")]["status"] == "FAILED"
    assert by[("tests", "test_c")]["status"] == "skipped"
    for name in ("dp_kfac", "kaisa_mem_opt"):
        row = by[("strategy", name)]
        assert row["status"] == "ok", row
        assert float(row["max_rel_err"]) == 0.0  # the CPU against itself
        # One read per factor step, plus one per decomposition (5 layers, A and G) at step 2.
        assert "host reads per step after the first: [1, 11, 1]" in row["detail"]
    assert {n for s, n in by if s == "resnet32"} == set(gpu_report.SIDE_BY_SIDE)
    assert float(by[("resnet32", "dp_kfac")]["iteration_ms"]) > 0
    text = (out / "gpu.md").read_text()
    assert "not ok: tests/test_b." in text
    assert "## ResNet-32, side by side" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_the_report_refuses_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_report.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_a_missing_junit_file_is_reported_not_run(tmp_path: Path) -> None:
    (row,) = gpu_report.read_junit(tmp_path / "absent.xml")
    assert row.status == "NOT RUN"
