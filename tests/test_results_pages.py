"""The results pages answer first, name their machine, and their figures show spreads.

Issue 42, parts 4 and 5: every page but ``convergence_scale`` (its own tests) opens with
its answer in at most five lines, then its figure, then tables of at most eight columns,
then its notes on method; a table's rows come from one machine, which its page names;
measured bars and lines carry their range over runs, and predicted bars never look like
measured ones.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.container import ErrorbarContainer
from omegaconf import OmegaConf
from test_benchmark_tables import ablation_rows, convergence_rows, fake_row

from experiments.bench import machine, pages, plots, tables

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
#: Every results page this file holds to the layout (convergence_scale has its own).
PAGES = (
    "second_order_update",
    "time_breakdown",
    "scaling",
    "ablation",
    "convergence",
    "fidelity",
    "paper",
    "scale_sim",
)


def _layout(text: str) -> tuple[list[str], str | None, list[list[str]], int, int]:
    """A page's answer lines, its first image, its tables' headers, the line of its last
    table and of its ``## Method`` heading (-1 where it has none)."""
    lines = text.split("\n")
    answer = []
    for line in lines[2:]:
        if not line:
            break
        answer.append(line)
    after = lines[2 + len(answer) + 1] if len(lines) > 3 + len(answer) else ""
    image = after if after.startswith("![") else None
    headers, last = [], -1
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and lines[i + 1].startswith("|---"):
            headers.append([c.strip() for c in line.strip("|").split("|")])
        if line.startswith("|"):
            last = i
    method = lines.index("## Method") if "## Method" in lines else -1
    return answer, image, headers, last, method


@pytest.mark.parametrize("name", PAGES)
def test_a_committed_page_answers_first(name: str) -> None:
    text = (RESULTS / f"{name}.md").read_text()
    answer, image, headers, last, method = _layout(text)
    assert text.startswith("# ") and answer[0].startswith("**Takeaway")
    assert len(answer) <= pages.ANSWER_LINES, answer
    if (RESULTS / f"{name}.png").exists():
        assert image == f"![{name}]({name}.png)"
    assert headers and all(len(h) <= 8 for h in headers), [h for h in headers if len(h) > 8]
    assert last < method, "notes on method go below the tables"
    if name not in ("paper",):  # measured (or, for scale_sim, host-timed): the machine named
        assert any(x.startswith(("Machine", "Measured on", "**Rows from")) for x in answer)


def test_a_page_with_a_long_answer_is_refused() -> None:
    with pytest.raises(ValueError, match="at most 5"):
        pages.page("t", [f"line {i}" for i in range(6)], [])
    lines = pages.page("t", ["a", "", "b"], ["| x |", "|---|"], ["how"], "t.png")
    assert lines == [
        "# t",
        "",
        "a",
        "b",
        "",
        "![t](t.png)",
        "",
        "| x |",
        "|---|",
        "",
        "## Method",
        "",
        "how",
    ]


# ------------------------------------------------------------------ machines
EPYC = {"cpu": "AMD EPYC", "cpus": 2, "cpu_isa": "AVX-512", "cpu_capability": "AVX512"}
XEON = {"cpu": "Intel Xeon", "cpus": 2, "cpu_isa": "AVX2", "cpu_capability": "AVX2"}


def test_a_row_names_its_cpu_cores_and_vector_isa() -> None:
    where = machine.machine()
    assert where["cpu"] and where["cpus"] and where["cpu_capability"]
    assert "cpu_isa" in where  # "" only where the CPU lists no vector flag
    assert pages.machine_label(EPYC) == "AMD EPYC, 2 cores, AVX-512 (torch's AVX512 kernels)"
    # Rows from before the model name was recorded held the architecture alone.
    old = {"cpu": "x86_64", "cpus": 2.0, "cpu_capability": float("nan")}
    assert pages.machine_label(old) == (
        "x86_64 (model not recorded), 2 cores, vector ISA not recorded"
    )


def test_rows_that_predate_the_isa_record_count_as_the_machine_that_names_it() -> None:
    """A row without ``cpu_isa`` (written before it was recorded) is the machine of the rows
    that name the same CPU, cores and torch kernels; it never joins a machine it disagrees
    with, and a row naming an architecture only stays unrecorded."""
    older = {**EPYC, "cpu_isa": ""}
    rows = pd.DataFrame([EPYC, EPYC, older])
    assert dict(pages.machines(rows)) == {pages.machine_label(EPYC): 3}
    # The torch kernels disagree with every row naming the ISA: nothing is filled in.
    other = {**EPYC, "cpu_isa": "", "cpu_capability": "AVX2"}
    assert len(pages.machines(pd.DataFrame([EPYC, other]))) == 2
    # Two machines name two ISAs for that CPU: which one is unknown, so nothing is filled.
    avx2 = {**EPYC, "cpu_isa": "AVX2"}
    assert len(pages.machines(pd.DataFrame([EPYC, avx2, older]))) == 3
    arch = {"cpu": "x86_64", "cpus": 2, "cpu_isa": "", "cpu_capability": "AVX512"}
    assert "model not recorded" in pages.machines(pd.DataFrame([EPYC, arch])).index[-1]


def test_a_timing_table_refuses_rows_of_two_machines(tmp_path: Path) -> None:
    rows = pd.DataFrame(
        [{**fake_row(s), **EPYC} for s in ("none", "dp_kfac")]
        + [{**fake_row("d_kfac", scale=2.0), **XEON}]
    )
    with pytest.raises(pages.MixedMachines, match=r"2 machines: AMD EPYC.*Intel Xeon"):
        tables.write_table("time_breakdown", rows, tmp_path)
    one = rows.assign(**EPYC)
    md = tables.write_table("time_breakdown", one, tmp_path)["md"].read_text()
    assert "Measured on one machine: AMD EPYC, 2 cores, AVX-512" in md.split("\n\n")[1]


def test_a_sweep_of_two_machines_keeps_its_rows_and_writes_no_table(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At a sweep's end the refusal is logged, not raised: the rows stay in raw/ to be
    measured again on one machine or merged with --rows."""
    job = tmp_path / "sweep" / "0"
    job.mkdir(parents=True)
    rows = [{**fake_row("none"), **EPYC}, {**fake_row("dp_kfac"), **XEON}]
    (job / "rows.json").write_text(json.dumps(rows))
    results = tmp_path / "results"
    config = OmegaConf.create(
        {"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}, "results_dir": str(results)}
    )
    with caplog.at_level(logging.ERROR):
        tables.TableCallback("time_breakdown").on_multirun_end(config)
    assert (results / "raw" / "time_breakdown.csv").exists()
    assert not (results / "time_breakdown.md").exists()
    assert "table time_breakdown not written: time_breakdown: its rows come from 2" in caplog.text


def test_an_accuracy_table_of_two_machines_says_so_at_its_top(tmp_path: Path) -> None:
    rows = convergence_rows()
    machine = [EPYC if i % 2 else XEON for i in range(len(rows))]
    rows = pd.concat([rows, pd.DataFrame(machine)], axis=1)
    md = tables.write_table("convergence", rows, tmp_path)["md"].read_text()
    answer = _layout(md)[0]
    assert answer[-1].startswith("**Rows from 2 machines** (AMD EPYC")
    assert "untuned-SGD comparison" in " ".join(answer)


# ------------------------------------------------------------------- figures
def _repeated(strategies: tuple[str, ...]) -> pd.DataFrame:
    rows = []
    for seed, load in ((0, 1.0), (1, 1.3), (2, 0.8)):
        for s in strategies:
            row = fake_row(s, scale=2.0 if s == "d_kfac" else 1.0)
            row = {**row, "seed": seed, "iteration_s": row["iteration_s"] * load}
            row["compute_s"] *= load if s == "dp_kfac" else 1.0
            rows.append(row)
    return pd.DataFrame(rows)


def _errorbars(fig: object) -> int:
    """How many sets of error bars (of bars or of points) a figure draws."""
    axes = fig.axes  # type: ignore[attr-defined]
    return sum(isinstance(c, ErrorbarContainer) for ax in axes for c in ax.containers)


def test_measured_figures_show_their_range_over_runs() -> None:
    rows = _repeated(("none", "dp_kfac", "d_kfac"))
    long, head = tables.second_order_frames(rows)
    for cost in ("compute", "comm"):
        spread = tables.cost_ratio_spread(rows, cost).drop(columns="runs")
        long = long.merge(spread, on=["model", "P", "setting", "strategy"])
    assert _errorbars(plots.ratio_bars(head, long)) == 2  # computation and communication
    wide = tables.breakdown_frame(rows)
    assert _errorbars(plots.stacked_breakdown(wide, list(tables.ITERATION_PARTS))) == 1
    curves, _ = tables.convergence_frames(convergence_rows())
    fig = plots.accuracy_curves(curves.assign(test_acc=curves["test_acc"] - 0.5))
    assert all(ax.get_ylim()[0] < 0.35 for ax in fig.axes if ax.lines)  # not cut at 0.5
    assert all(ax.collections for ax in fig.axes if ax.lines)  # seed bands


def test_predicted_bars_are_hatched_and_keyed() -> None:
    frame = tables.ablation_frame(ablation_rows())
    fig = plots.ablation_bars(frame)
    measured, predicted = fig.axes[0], fig.axes[len(fig.axes) // 2]
    assert all(not p.get_hatch() for p in measured.patches)
    assert predicted.patches and all(p.get_hatch() == "//" for p in predicted.patches)
    labels = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert "predicted by the cost model (hatched)" in labels
    assert "measured here (solid)" in labels
