"""The network table (experiments/bench/network_table.py), built from small rows written here.

Rows of SGD, dp_kfac and an overlapped config at two emulated rates, three runs each (and
a loopback row, which the table must leave out), with round numbers, so that every split of
the step (compute, exposed and hidden communication), every floor and every range can be
checked by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from test_benchmark_tables import COMMON, fake_row

from dpkfac.plan.hardware import wire_bytes
from experiments.bench import network_table, predict, tables, takeaways

OVERLAP = {"strategy": "dp_kfac", **COMMON, "grad_reduction": "owner", "overlap": True}


def _row(strategy: str, rate: float, seed: int, iteration_ms: float, **over: object) -> dict:
    """A row of ``strategy`` on the emulated network at ``rate``, run ``seed``."""
    base = "dp_kfac_owner" if strategy == "dp_kfac_owner_overlap" else strategy
    row = fake_row(base, 2, setting="practical")
    row.update(
        strategy=strategy,
        seed=seed,
        iteration_s=iteration_ms / 1e3,
        network="emulated",
        network_rate_bps=rate,
        network_faithful_bps=3e9,
        network_probe="[]",
        link_probes="[]",
        **over,
    )
    if strategy == "dp_kfac_owner_overlap":
        row["kfac_options"] = json.dumps(OVERLAP)
        row["configuration"] = "owner, overlap"  # what the scheme describes it as
    return row


def _rows() -> pd.DataFrame:
    rows = []
    # At 1 Gbit/s a step's 1.5 MB take 12 ms on the wire; at 2 Gbit/s 6 ms.
    for rate, slow in ((1e9, 1.0), (2e9, 0.5)):
        for seed, jitter in ((0, 0.0), (1, 2.0), (2, -1.0)):
            wire = {"wire_grad_allreduce": 1_500_000}
            sgd = 0.008 if rate == 1e9 else 0.003  # DDP's waits inside (at 2 Gbit/s: none)
            rows.append(_row("none", rate, seed, 10 + 12 * slow + jitter, fwd_bwd_s=sgd, **wire))
            rows.append(_row("dp_kfac", rate, seed, 20 + 12 * slow + jitter, **wire))
            rows.append(_row("dp_kfac_owner_overlap", rate, seed, 16 + jitter, **wire))
    rows.append({**_row("dp_kfac", 1e9, 0, 99.0), "network": "loopback"})
    return pd.DataFrame(rows)


def test_each_step_is_split_into_compute_exposed_and_hidden_communication() -> None:
    frame = network_table.network_frame(_rows())
    assert len(frame) == 6  # 3 configs x 2 rates; the loopback row is not the network's
    one = frame[frame["rate_bps"] == 1e9].set_index("strategy")
    # dp_kfac's forward/backward (4 ms, no transfer inside) is pure compute, the overlapped
    # config's too, and SGD's (its own 8 ms hold DDP's waits; the lesser of the two).
    # K-FAC compute 1 + 3 + 0.5 ms; after the last transfer: optimizer 1 ms + other 1 ms.
    assert one["pure_fwd_bwd_ms"].tolist() == pytest.approx([4.0, 4.0, 4.0])
    assert one.loc["none", "compute_ms"] == pytest.approx(4 + 1)
    assert one.loc["dp_kfac", "compute_ms"] == pytest.approx(4 + 4.5 + 2)
    assert one.loc["dp_kfac", "wire_ms"] == pytest.approx(12.0)
    # The median run (seed 0: totals 22+32+16 against 24+34+18 and 21+31+15).
    assert one.loc["dp_kfac", "iteration_ms"] == pytest.approx(32.0)
    assert one.loc["dp_kfac", "exposed_comm_ms"] == pytest.approx(32 - 10.5)
    assert one.loc["dp_kfac", "hidden_comm_ms"] == 0.0
    overlap = one.loc["dp_kfac_owner_overlap"]
    assert overlap["exposed_comm_ms"] == pytest.approx(16 - 10.5)
    assert overlap["hidden_comm_ms"] == pytest.approx(12 - 5.5)
    # Floor: the longer of compute (10.5) and wire + forward (4/3) + after (2).
    assert overlap["floor_ms"] == pytest.approx(12 + 4 / 3 + 2)
    assert overlap["vs_floor"] == pytest.approx(16 / (12 + 4 / 3 + 2))
    assert overlap["floor_vs_sgd"] == pytest.approx((12 + 4 / 3 + 2) / 22)
    # Ranges over the three runs, each ratio taken within its run.
    assert (overlap["iteration_min_ms"], overlap["iteration_max_ms"]) == (15.0, 18.0)
    assert overlap["vs_sgd"] == pytest.approx(16 / 22)
    assert overlap["vs_sgd_min"] == pytest.approx(min(16 / 22, 18 / 24, 15 / 21))
    assert int(overlap["runs"]) == 3
    # The last gradient bucket (DDP's rule; the whole tiny MLP here) goes out after the backward.
    shapes, _ = predict.row_shapes(_row("dp_kfac", 1e9, 0, 1.0))
    last = 1e3 * wire_bytes("allreduce", 4 * shapes.num_params, 2) * 8 / 1e9
    assert overlap["last_bucket_ms"] == pytest.approx(last)
    assert overlap["floor_ms"] == max(10.5, 4 / 3 + 12 + 2, 4 + last + 2)
    two = frame[frame["rate_bps"] == 2e9].set_index("strategy")
    assert two.loc["none", "pure_fwd_bwd_ms"] == 3.0  # its own where that is less
    assert two.loc["dp_kfac", "wire_ms"] == pytest.approx(6.0)
    assert two.loc["dp_kfac", "floor_ms"] == pytest.approx(10.5)  # compute-bound there


def test_sgds_compute_is_its_own_pass_without_reductions_where_measured() -> None:
    """Where the K-FAC rows capture every step (the paper setting) their forward/backward
    holds the hooks' work: SGD's pass run again under ``no_sync`` is its reference instead,
    so the wait DDP left exposed is read whole, not cut by the K-FAC hooks' time."""
    rows = _rows()
    sgd = rows["strategy"] == "none"
    rows.loc[sgd, "fwd_bwd_local_s"] = 0.0035
    rows.loc[rows["strategy"] == "dp_kfac", "fwd_bwd_s"] = 0.006  # the hooks' work inside
    one = network_table.network_frame(rows).set_index(["rate_bps", "strategy"])
    assert one.loc[(1e9, "none"), "pure_fwd_bwd_ms"] == pytest.approx(3.5)
    assert one.loc[(1e9, "none"), "exposed_comm_ms"] == pytest.approx(22 - 3.5 - 1)
    assert one.loc[(1e9, "dp_kfac"), "pure_fwd_bwd_ms"] == pytest.approx(6.0)  # its own
    # Rows from before the pass: the lesser of SGD's own and the K-FAC rows' median (6 ms).
    old = network_table.network_frame(rows.drop(columns="fwd_bwd_local_s"))
    assert old.set_index(["rate_bps", "strategy"]).loc[
        (1e9, "none"), "pure_fwd_bwd_ms"
    ] == pytest.approx(6.0)


@pytest.mark.parametrize(
    ("options", "sends"),
    [
        ({"strategy": "dp_kfac", **COMMON}, False),
        (OVERLAP, True),  # gradients reduced from the backward hooks
        ({**OVERLAP, "overlap": "auto"}, True),  # may choose that
        ({"strategy": "spd_kfac", **COMMON}, True),  # factors all-reduced from the hooks
        ({"strategy": "d_kfac", **COMMON}, False),
    ],
)
def test_a_row_that_sends_during_its_pass_takes_its_jobs_plain_forward_backward(
    options: dict, sends: bool
) -> None:
    """A transfer beside the pass stretches it on the rank's core: such a row's own
    ``fwd_bwd`` holds communication, so its pure forward/backward is the median of the job's
    K-FAC rows that send nothing during theirs, and the stretch is read as exposed
    communication."""
    rows = _rows()
    probe = rows["strategy"] == "dp_kfac_owner_overlap"
    rows.loc[probe, "kfac_options"] = json.dumps(options)
    rows.loc[probe, "fwd_bwd_s"] = 0.009  # 5 ms more than dp_kfac's 4
    frame = network_table.network_frame(rows, predict=False)
    row = frame[frame["rate_bps"] == 1e9].set_index("strategy").loc["dp_kfac_owner_overlap"]
    assert row["pure_fwd_bwd_ms"] == pytest.approx(4.0 if sends else 9.0)
    assert row["exposed_comm_ms"] == pytest.approx(16 - row["compute_ms"])


def test_the_floor_holds_the_updates_of_layers_completed_before_the_last_bucket() -> None:
    """A 16-600-600-10 MLP: DDP's first bucket (1 MiB cap) holds the last two layers, whose
    gradients are reduced during the backward pass. An owner sends their updates, which
    either lengthen its backward pass (preconditioned there) or follow the last bucket on
    the link: its floor holds the cheaper (``early_update_ms``, computed from the config's
    placement), SGD's nothing."""
    rows = _rows()
    wide = {"_target_": "experiments.models.mlp.MLP", "d_in": 16, "hidden": [600, 600]}
    rows["model_config"] = json.dumps(wide)
    frame = network_table.network_frame(rows, predict=False)
    one = frame[frame["rate_bps"] == 1e9].set_index("strategy")
    assert one.loc["none", "early_update_ms"] == 0.0
    for strategy in ("dp_kfac", "dp_kfac_owner_overlap"):
        r = one.loc[strategy]
        assert r["early_update_ms"] > 0
        third = r["pure_fwd_bwd_ms"] + r["early_update_ms"] + r["last_bucket_ms"] + r["after_ms"]
        second = r["pure_fwd_bwd_ms"] / 3 + r["wire_ms"] + r["after_ms"]
        assert r["floor_ms"] == pytest.approx(max(r["compute_ms"], second, third))
        assert r["floor_ms"] == pytest.approx(third)  # the link-bound term here
    # Each owner's layers of the first bucket are 600x600 and 600x10: at 1 Gbit/s their
    # bytes (1.44 MB: 11.5 ms) or their preconditioning, whichever is less, per owner.
    assert 0 < one.loc["dp_kfac", "early_update_ms"] <= 1e3 * 4 * (600 * 601 + 10 * 601) * 8 / 1e9


def test_a_configs_ratios_are_its_own_median_run_not_the_median_jobs() -> None:
    """The median job is ranked by every config together; here it holds the overlapped
    config's slowest run (18 ms), and its ratios are read from its own median run."""
    wire = {"wire_grad_allreduce": 1_500_000}
    times = {0: (22, 32, 18), 1: (24, 36, 15), 2: (21, 31, 16)}  # totals 72, 75, 68
    rows = []
    for seed, (sgd, plain, overlapped) in times.items():
        rows.append(_row("none", 1e9, seed, sgd, fwd_bwd_s=0.008, **wire))
        rows.append(_row("dp_kfac", 1e9, seed, plain, **wire))
        rows.append(_row("dp_kfac_owner_overlap", 1e9, seed, overlapped, **wire))
    frame = network_table.network_frame(pd.DataFrame(rows), predict=False)
    overlap = frame.set_index("strategy").loc["dp_kfac_owner_overlap"]
    assert overlap["iteration_ms"] == 18.0  # the median job's row (seed 0)
    assert overlap["vs_sgd"] == pytest.approx(16 / 21)  # ratios 18/22, 15/24, 16/21
    assert (overlap["vs_sgd_min"], overlap["vs_sgd_max"]) == pytest.approx((15 / 24, 18 / 22))
    floor = 12 + 4 / 3 + 2  # the same in every run: wire, forward, after
    assert overlap["vs_floor"] == pytest.approx(16 / floor)
    assert (overlap["vs_floor_min"], overlap["vs_floor_max"]) == pytest.approx(
        (15 / floor, 18 / floor)
    )
    assert overlap["floor_vs_sgd"] == pytest.approx(floor / 22)  # the median job's SGD
    answer = takeaways.network(frame)
    assert f"{16 / 21:.2f}× ({15 / 24:.2f}–{18 / 22:.2f}) SGD" in answer[0]
    assert f"{16 / floor:.2f}× ({15 / floor:.2f}–{18 / floor:.2f}) its floor" in answer[0]


def test_the_cost_model_predicts_every_row_from_its_probe_alone() -> None:
    frame = network_table.network_frame(_rows())
    assert frame["pred_iteration_ms"].gt(0).all()
    sgd = frame[frame["first_order"]].set_index("rate_bps")["pred_iteration_ms"]
    for r in frame.itertuples():
        assert r.pred_vs_sgd == pytest.approx(r.pred_iteration_ms / sgd[r.rate_bps])
    # Nothing of the rows' timings enters it: slower measured steps, same prediction.
    slower = _rows()
    slower["iteration_s"] *= 3
    again = network_table.network_frame(slower)
    assert again["pred_iteration_ms"].tolist() == pytest.approx(frame["pred_iteration_ms"].tolist())


def test_the_page_opens_with_its_answer_then_the_figure(tmp_path: Path) -> None:
    paths = tables.write_table("network", _rows(), tmp_path)
    assert {"csv", "md", "png", "raw"} <= set(paths)
    lines = paths["md"].read_text().splitlines()
    assert lines[0].startswith("# K-FAC on an emulated cluster network")
    figure = next(i for i, x in enumerate(lines) if x.startswith("!["))
    answer = [x for x in lines[1:figure] if x.strip()]
    assert 1 <= len(answer) <= 5
    assert answer[0].startswith("- **mlp label, practical, 1gbit**: DDP SGD 22 ms")
    assert "dp_kfac_owner_overlap 0.73× (0.71–0.75)" in answer[0]
    # Its slowest run (18 ms) beats dp_kfac's fastest (31 ms): ranges apart.
    assert "faster than every other K-FAC config in every run" in answer[0]
    assert any(
        "carries 3gbit faithfully (the median of the probes of 2 job(s)" in x for x in answer
    )
    for rate in ("1gbit", "2gbit"):
        assert f"## mlp label, practical setting, {rate}" in lines
    headers = [x for x in lines if x.startswith("| strategy | iteration ms")]
    assert len(headers) == 2 and all(x.count("|") - 1 <= 8 for x in headers)
    assert "| dp_kfac_owner_overlap | 16 (15–18) | 0.73 (0.71–0.75) |" in paths["md"].read_text()
    # The committed rows render to the same page (the CSV read back as the sweep's rows).
    again = tables.write_table("network", tables.load_rows([paths["raw"]]), tmp_path / "again")
    assert again["md"].read_text() == paths["md"].read_text()


def test_a_sweep_without_network_rows_writes_an_empty_page(tmp_path: Path) -> None:
    rows = pd.DataFrame([{**_row("dp_kfac", 1e9, 0, 30.0), "network": "loopback"}])
    paths = tables.write_table("network", rows, tmp_path)
    assert "png" not in paths
    assert paths["md"].read_text().startswith("# K-FAC on an emulated cluster network")


def test_the_cost_model_is_checked_per_part_of_the_step(tmp_path: Path) -> None:
    frame = network_table.network_frame(_rows())
    parts = [f"pred_{p}_ms" for p in network_table.MODEL_PHASES]
    # The parts partition the predicted step, as the measured parts partition the measured one.
    assert frame[parts].sum(axis=1).tolist() == pytest.approx(frame["pred_iteration_ms"].tolist())
    measured = [network_table.MEASURED[p] for p in network_table.MODEL_PHASES]
    dp = frame[(frame["strategy"] == "dp_kfac") & (frame["rate_bps"] == 1e9)].iloc[0]
    assert sum(dp[c] for c in measured) == pytest.approx(dp["iteration_ms"])
    assert dp["pred_comm_error_%"] == pytest.approx(
        100 * (dp["pred_comm_ms"] / dp["exposed_comm_ms"] - 1)
    )
    errors = network_table.model_errors(frame).set_index("part")
    assert list(errors.index) == ["step", *network_table.MODEL_PHASE_NAMES.values()]
    assert errors.loc["K-FAC compute", "rows"] == 4  # SGD's rows have none
    step = frame["pred_error_%"].abs()
    assert errors.loc["step", "mean abs. error %"] == pytest.approx(step.mean())
    paper = frame.assign(setting="paper")
    both = network_table.model_errors_by_setting(pd.concat([frame, paper])).set_index("part")
    assert list(both.columns) == ["practical", "paper"]
    assert both.loc["step", "paper"] == pytest.approx(step.mean())
    text = tables.write_table("network", _rows(), tmp_path)["md"].read_text()
    assert "## The cost model, held out" in text
    assert "These rows predate the compute probes" in text
    assert "measured / predicted ms" in text


def test_a_part_below_its_runs_spread_is_scored_apart(tmp_path: Path) -> None:
    """Communication is the step less its compute: a part smaller than the row's spread over
    runs is noise, and its error is counted apart, in milliseconds."""
    frame = network_table.network_frame(_rows())
    spread = frame["iteration_max_ms"] - frame["iteration_min_ms"]
    assert spread.tolist() == pytest.approx([3.0] * len(frame))  # jitters -1 and +2 ms
    frame["exposed_comm_ms"] = [0.5 if i % 2 else 30.0 for i in range(len(frame))]
    frame["pred_comm_ms"] = 33.0
    frame["pred_comm_error_%"] = 100 * (33.0 / frame["exposed_comm_ms"] - 1)
    frame["comm_resolved"] = frame["exposed_comm_ms"] >= spread
    comm = network_table.model_errors(frame).set_index("part").loc["communication"]
    kept = frame["exposed_comm_ms"] == 30.0
    assert comm["rows"] == len(frame)
    assert comm["resolved rows"] == kept.sum()
    assert comm["mean abs. error % (resolved)"] == pytest.approx(10.0)
    assert comm["unresolved abs. error ms"] == pytest.approx(32.5)
    assert comm["mean abs. error %"] > 1000  # every row: 6500% where 0.5 ms was predicted 33
    line = next(x for x in takeaways.network(frame) if "cost model" in x)
    assert f"communication {comm['mean abs. error %']:.0f}% (10% in the {kept.sum()} rows" in line
    # The frame marks it: in these rows every part exceeds the 3 ms spread but communication.
    rows = network_table.network_frame(_rows())
    assert (rows["comm_resolved"] == (rows["exposed_comm_ms"] >= 3.0)).all()


def test_wire_time_and_floor_are_at_the_rate_the_link_probe_measured() -> None:
    """TCP/IP headers take part of the shaped rate: a job whose probes saw the link carry
    0.8 Gbit/s of payload has its wire time, hidden communication and floor at that rate."""
    # A 16 MiB all-reduce (16 MiB on each rank's wire at P=2) in 167.8 ms: 0.8 Gbit/s.
    probe = [
        {"kind": "allreduce", "nbytes": n, "seconds": n * 8 / 0.8e9, "world_size": 2, "calls": 1}
        for n in (2**21, 2**24)
    ]
    df = _rows()
    df["link_probes"] = json.dumps(probe)
    frame = network_table.network_frame(df, predict=False)
    one = frame[frame["rate_bps"] == 1e9].set_index("strategy")
    assert one["link_bps"].tolist() == pytest.approx([0.8e9] * 3)
    assert one.loc["dp_kfac", "wire_ms"] == pytest.approx(12.0 / 0.8)
    overlap = one.loc["dp_kfac_owner_overlap"]
    assert overlap["hidden_comm_ms"] == pytest.approx(15 - 5.5)
    assert overlap["floor_ms"] == pytest.approx(15 + 4 / 3 + 2)
    plain = network_table.network_frame(_rows(), predict=False)  # no probes: the shaped rate
    assert plain["link_bps"].tolist() == pytest.approx(plain["rate_bps"].tolist())


def test_the_answer_names_the_configs_whose_range_meets_the_focus_configs() -> None:
    from experiments.bench import takeaways

    frame = network_table.network_frame(_rows(), predict=False)
    lucky = (frame["strategy"] == "dp_kfac") & (frame["rate_bps"] == 1e9)
    frame.loc[lucky, "iteration_min_ms"] = 17.0  # one run of dp_kfac beat the focus's 18 ms
    first = takeaways.network(frame)[0]
    assert "its range meets 1 other K-FAC config(s)' (dp_kfac)" in first
    # A config whose "auto" resolved to the focus's choices is the focus, not a rival.
    frame.loc[lucky, "configuration"] = "owner, overlap"
    first = takeaways.network(frame)[0]
    assert "dp_kfac chose the same configuration (owner, overlap)" in first
    assert "meets" not in first and "fastest K-FAC" not in first
    # The fastest is named by the ratio the line states (each config's own median run),
    # not by the median job's row, which can be a config's slowest run.
    rival = frame.assign(configuration=frame["configuration"].where(~lucky, "owner"))
    rival.loc[lucky, "iteration_ms"] = 1.0
    assert "fastest K-FAC" not in takeaways.network(rival)[0]
    rival.loc[lucky, "vs_sgd"] = 0.5
    assert "fastest K-FAC: dp_kfac 0.50×" in takeaways.network(rival)[0]
    # A chooser that resolved to the focus's configuration in some runs only: those runs
    # are the focus's; its other runs are the rival, compared with the focus's range.
    frame.loc[lucky, "configuration"] = "owner"
    frame.loc[lucky, "runs_by_configuration"] = json.dumps(
        {"owner, overlap": [2, 17.0], "owner": [1, 25.0]}
    )
    first = takeaways.network(frame)[0]
    assert "dp_kfac chose the same configuration in 2 of 3 runs" in first
    assert "faster than every other K-FAC config in every run" in first
    frame.loc[lucky, "runs_by_configuration"] = json.dumps(
        {"owner, overlap": [2, 25.0], "owner": [1, 17.0]}
    )
    assert "its range meets 1 other K-FAC config(s)' (dp_kfac)" in takeaways.network(frame)[0]


def test_each_run_is_counted_under_the_configuration_it_ran() -> None:
    df = _rows()
    auto = (df["strategy"] == "dp_kfac") & (df["network"] == "emulated")  # 3 runs per rate
    df.loc[auto, "configuration"] = ["owner, overlap", "owner", "owner, overlap"] * 2
    frame = network_table.network_frame(df, predict=False)
    runs = frame.loc[frame["strategy"] == "dp_kfac", "runs_by_configuration"]
    assert len(runs) == 2
    for text in runs:
        by = json.loads(text)
        assert {c: n for c, (n, _) in by.items()} == {"owner, overlap": 2, "owner": 1}


def test_rows_without_the_eigh_probe_say_their_decompositions_are_the_presets(
    tmp_path: Path,
) -> None:
    rows = _rows()
    factor = {"kind": "factor", "work": {"factor": [4, 1e8]}, "seconds": 5e-3}
    rows["compute_probes"] = json.dumps([factor])
    text = tables.write_table("network", rows, tmp_path)["md"].read_text()
    assert "These rows predate the eigh probe" in text
    eigh = {"kind": "eigh", "work": {"eigh": [6, 3e9]}, "seconds": 0.05}
    rows["compute_probes"] = json.dumps([factor, eigh])
    text = tables.write_table("network", rows, tmp_path / "probed")["md"].read_text()
    assert "predate" not in text


@pytest.mark.parametrize(
    ("configuration", "expected"),
    [("owner", ("owner", False)), ("owner, overlap", ("owner", True)), ("", ("allreduce", False))],
)
def test_a_row_is_priced_at_its_world_size_as_its_run_resolved_auto(
    configuration: str, expected: tuple[str, bool]
) -> None:
    """A row of "auto" is predicted at its own world size as what it ran (its
    ``configuration``), not as what the cost model would choose today: a chooser's rows stay
    comparable across its changes. At another world size the run would choose again."""
    row = fake_row("dp_kfac")
    kfac = {**json.loads(row["kfac_options"]), "grad_reduction": "auto", "overlap": "auto"}
    row.update(kfac_options=json.dumps(kfac), configuration=configuration)
    m = predict.measurement(row)
    assert m.options.grad_reduction == "auto"  # what the run was given
    options = predict.as_ran(row, m).options
    assert (options.grad_reduction, options.overlap) == expected
    unknown = {**row, "configuration": float("nan")}  # nothing recorded: resolved when priced
    assert predict.as_ran(unknown, m).options.grad_reduction == "auto"
