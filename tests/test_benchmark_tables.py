"""Table writers, aggregation and the results notebook, on synthetic benchmark rows.

No test here measures anything or asserts a wall time: rows are written by
hand with known numbers, so ratios, amortisation and file outputs can be
checked exactly, and the notebook is executed on them so it cannot rot.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from experiments.bench import pages, tables
from experiments.bench.aggregate import aggregate, kind_weights
from experiments.bench.measure import flushed_denormals, step_kinds
from experiments.bench.predict import measured_phases

ROOT = Path(__file__).resolve().parents[1]
CATS = ("grad_allreduce", "factor_allreduce", "decomposition_broadcast", "precond_broadcast")
PHASES = (
    "factor_compute",
    "factor_comm",
    "decomposition",
    "decomposition_comm",
    "precondition",
    "precond_comm",
    "grad_comm",
)


#: The tiny model's columns, as ``python -m experiments.bench`` records them.
MLP_COLUMNS = {
    "model_config": json.dumps(
        {"_target_": "experiments.models.mlp.MLP", "d_in": 16, "hidden": 32}
    ),
    "model_batch": json.dumps(
        {"_target_": "experiments.bench.workloads.VectorBatches", "batch_size": 8, "features": 16}
    ),
    "model_paper": "{}",
    "skip_layers": "[]",
    "weight_sharing": "expand",
}
COMMON = {
    "compute_method": "eigen",
    "damping": 0.003,
    "factor_decay": 0.95,
    "kl_clip": 0.001,
    "skip_layers": [],
    "weight_sharing": "expand",
    "bucket_cap_mb": 25.0,
    "lr": 0.1,
}

D_KFAC = {"placement": "lpt"}
#: The ablation table's strategy configs (conf/table/ablation.yaml), as rows record them.
ABLATION_KFAC = {
    "d_kfac_eager": {
        "strategy": "d_kfac",
        **COMMON,
        **D_KFAC,
        "triangle": False,
        "lazy_factor_sync": False,
    },
    "d_kfac_triangle": {
        "strategy": "d_kfac",
        **COMMON,
        **D_KFAC,
        "triangle": True,
        "lazy_factor_sync": False,
    },
    "d_kfac_lazy": {
        "strategy": "d_kfac",
        **COMMON,
        **D_KFAC,
        "triangle": True,
        "lazy_factor_sync": True,
    },
    "kaisa_comm_opt": {"strategy": "kaisa", **COMMON, "grad_worker_fraction": "comm_opt"},
    "kaisa_mem_opt": {"strategy": "kaisa", **COMMON, "grad_worker_fraction": "mem_opt"},
    "dp_kfac_owner": {"strategy": "dp_kfac", **COMMON, "grad_reduction": "owner"},
}
ABLATION_ORDER = [
    "none",
    "d_kfac_eager",
    "d_kfac_triangle",
    "d_kfac_lazy",
    "spd_kfac",
    "kaisa_comm_opt",
    "kaisa_mem_opt",
    "dp_kfac",
    "dp_kfac_owner",
]


def fake_row(
    strategy: str,
    p: int = 2,
    *,
    model: str = "mlp",
    scale: float = 1.0,
    setting: str = "paper",
    **over: float,
) -> dict:
    """A timing row as ``python -m experiments.bench`` writes it, with round numbers."""
    kfac = {
        "none": None,
        "dp_kfac": {"strategy": "dp_kfac", **COMMON, "grad_reduction": "allreduce"},
        "d_kfac": {"strategy": "d_kfac", **COMMON},
        "spd_kfac": {"strategy": "spd_kfac", **COMMON, "local_threshold": 1024},
        **ABLATION_KFAC,
    }[strategy]
    k = 0.0 if kfac is None else scale
    row = {
        "task": "timing",
        "model": model,
        "label": f"{model} label",
        "strategy": strategy,
        "world_size": p,
        "setting": setting,
        "factor_update_steps": 1,
        "inv_update_steps": 1,
        "iteration_s": 0.010 + 0.010 * k,
        "fwd_bwd_s": 0.004,
        "optimizer_s": 0.001,
        "step_other_s": 0.001 * k,
        "grad_comm_s": 0.002,
        "factor_compute_s": 0.001 * k,
        "factor_comm_s": 0.002 * k,
        "decomposition_s": 0.003 * k,
        "decomposition_comm_s": 0.001 * k,
        "precondition_s": 0.0005 * k,
        "precond_comm_s": 0.0005 * k,
        "mem_kfac": int(2**20 * k),
        "mem_rank": 0,
        **MLP_COLUMNS,
        "kfac_options": json.dumps(kfac),
        "fusion_plan": "null",
        "compute_method": "eigen",
        "error": "",
        "rank_timings": json.dumps([{ph: 1e-3 * (i + 1) * k for ph in PHASES} for i in range(p)]),
    }
    for cat in CATS:
        row[f"bytes_{cat}"] = row[f"wire_{cat}"] = 0
        row[f"calls_{cat}"] = 0
    row["bytes_grad_allreduce"] = 4000
    row["bytes_second_order"] = int(1e6 * k)
    row["wire_second_order"] = int(1e6 * k)
    row["compute_s"] = row["factor_compute_s"] + row["decomposition_s"] + row["precondition_s"]
    row["comm_s"] = row["factor_comm_s"] + row["decomposition_comm_s"] + row["precond_comm_s"]
    row.update(over)
    return row


def timing_rows() -> pd.DataFrame:
    rows = [
        fake_row("none"),
        fake_row("dp_kfac"),
        fake_row("d_kfac", scale=2.0),
        fake_row("spd_kfac", scale=1.5),
    ]
    failed = {
        "task": "timing",
        "model": "mlp",
        "strategy": "d_kfac",
        "world_size": 4,
        "setting": "paper",
        "error": "ChildFailedError: rank 1 died",
    }
    return pd.DataFrame([*rows, failed])


def convergence_rows() -> pd.DataFrame:
    rows = []
    for strategy in ("none", "dp_kfac"):
        for p in (1, 2):
            curve = [
                {"epoch": e, "test_acc": 0.8 + 0.05 * e, "train_loss": 1.0 / e, "seconds": float(e)}
                for e in (1, 2, 3)
            ]
            rows.append(
                {
                    "task": "convergence",
                    "model": "digits_cnn",
                    "strategy": strategy,
                    "world_size": p,
                    "setting": "paper",
                    "epochs": 3,
                    "steps_per_epoch": 10,
                    "final_acc": 0.95,
                    "best_acc": 0.95,
                    "seconds": 3.0,
                    "curve": json.dumps(curve),
                    "replicas_identical": True,
                    "error": "",
                }
            )
    return pd.DataFrame(rows)


# ------------------------------------------------------------------ aggregation
def test_timed_steps_flush_subnormals_and_restore_them() -> None:
    """A fitted fixed batch makes subnormal gradients; timed steps flush them, then not."""
    tiny = 1e-40  # subnormal in float32
    with flushed_denormals():
        if torch.tensor([tiny]).item() != 0.0:
            pytest.skip("this CPU cannot flush subnormals")
        assert (torch.tensor([1e-20]) * torch.tensor([1e-20])).item() == 0.0
    assert torch.tensor([tiny]).item() != 0.0


def test_step_kinds_and_weights() -> None:
    assert step_kinds(1, 1) == ["decomp"]
    assert step_kinds(10, 100) == ["decomp", "factor", "plain", "plain"]
    assert step_kinds(10, 10) == ["decomp", "plain"]
    assert step_kinds(1, 5) == ["decomp", "factor"]
    w = kind_weights(10, 100)
    assert w == pytest.approx({"decomp": 0.01, "factor": 0.09, "plain": 0.9})
    assert sum(w.values()) == pytest.approx(1.0)


def _record(kind: str, seconds: float, nbytes: int) -> dict:
    phases = {p: 0.0 for p in PHASES}
    phases["decomposition"] = seconds if kind == "decomp" else 0.0
    phases["factor_compute"] = seconds / 10
    return {
        "step": 0,
        "kind": kind,
        "loss": 1.0,
        "fwd_bwd_wall": 0.5 + seconds / 10,
        "step_wall": seconds + 0.1,
        "optimizer": 0.01,
        "iteration": 1.0 + seconds,
        "phases": phases,
        "comm": {c: {"bytes": nbytes, "calls": 1, "wire_bytes": nbytes} for c in CATS},
        "memory": {"factors_bytes": 100, "decompositions_bytes": 50, "buffers_bytes": 10},
    }


def test_aggregate_takes_busiest_rank_median_and_amortises() -> None:
    kinds = ["decomp", "factor", "plain"] * 2
    fast = [_record(k, {"decomp": 2.0, "factor": 0.5, "plain": 0.0}[k], 300) for k in kinds]
    slow = [_record(k, {"decomp": 4.0, "factor": 0.5, "plain": 0.0}[k], 300) for k in kinds]
    slow[0]["memory"]["factors_bytes"] = 1000
    results = [{"rank": 0, "records": fast}, {"rank": 1, "records": slow}]
    row = aggregate(results, 10, 100)
    # Decomposition only on decomp steps (busiest rank: 4 s) -> amortised 4/100.
    assert row["decomposition_s"] == pytest.approx(0.04)
    assert row["iteration_decomp_s"] == pytest.approx(5.0)
    assert row["iteration_plain_s"] == pytest.approx(1.0)
    assert row["iteration_s"] == pytest.approx(0.01 * 5.0 + 0.09 * 1.5 + 0.9 * 1.0)
    # Forward/backward excludes the factor computation timed inside the hooks.
    assert row["fwd_bwd_s"] == pytest.approx(0.5)
    assert row["bytes_factor_allreduce"] == pytest.approx(300)
    assert (row["mem_kfac"], row["mem_rank"]) == (1060, 1)
    paper = aggregate([{"rank": 0, "records": [_record("decomp", 2.0, 8)] * 3}], 1, 1)
    assert paper["decomposition_s"] == pytest.approx(2.0)
    assert paper["compute_s"] == pytest.approx(2.0 + 0.2)


def test_phases_timed_in_the_backward_pass_leave_forward_backward() -> None:
    """dp_kfac's overlap decomposes and preconditions inside the backward: not fwd/bwd time."""
    record = _record("decomp", 2.0, 8)
    record["phases"]["precondition"] = 0.3
    # In the hooks: the factors (0.2 s), the decomposition and 0.1 s of preconditioning.
    record["phases_in_fwd_bwd"] = {"factor_compute": 0.2, "decomposition": 2.0, "precondition": 0.1}
    record["fwd_bwd_wall"] = 0.5 + 0.2 + 2.0 + 0.1
    record["step_wall"] = 0.2 + 0.05  # the rest of the preconditioning, and other work
    row = aggregate([{"rank": 0, "records": [record] * 3}], 1, 1)
    assert row["fwd_bwd_s"] == pytest.approx(0.5)
    assert row["step_other_s"] == pytest.approx(0.05)
    assert row["decomposition_s"] == pytest.approx(2.0)


def test_sgds_pass_without_reductions_is_read_as_its_steps_are() -> None:
    """DDP SGD's ``no_sync`` pass (``fwd_bwd_local``): per step the slower rank, then the
    median over steps; rows of steppers without it have no such column."""
    ranks = []
    for per_step in ([0.3, 0.1, 0.2], [0.1, 0.4, 0.1]):
        records = [{**_record("decomp", 0.0, 8), "fwd_bwd_local": t} for t in per_step]
        ranks.append({"rank": len(ranks), "records": records})
    assert aggregate(ranks, 1, 1)["fwd_bwd_local_s"] == pytest.approx(0.3)  # 0.3, 0.4, 0.2
    assert "fwd_bwd_local_s" not in aggregate(
        [{"rank": 0, "records": [_record("decomp", 0, 8)]}], 1, 1
    )


def test_least_wait_is_the_per_step_minimum_over_ranks() -> None:
    """Whichever rank arrives last waits only for the transfer, and that rank changes."""
    waits = [[9.0, 1.0, 9.0], [1.0, 9.0, 9.0], [9.0, 9.0, 1.0]]  # per rank, per step
    results = []
    for rank, per_step in enumerate(waits):
        records = [_record("decomp", 1.0, 8) for _ in per_step]
        for rec, wait in zip(records, per_step, strict=True):
            rec["phases"] = {**rec["phases"], "grad_comm": wait, "precond_comm": 2 * wait}
        results.append({"rank": rank, "records": records})
    row = aggregate(results, 1, 1)
    assert row["least_wait"]["grad_comm"] == pytest.approx(1.0)
    assert row["least_wait"]["precond_comm"] == pytest.approx(2.0)
    # Each rank's own median is 9: the per-rank view would report nine times the transfer.
    assert min(r["grad_comm"] for r in row["rank_timings"]) == pytest.approx(9.0)
    measured = measured_phases({**row, "least_wait": json.dumps(row["least_wait"])})
    assert measured["grad_comm"] == pytest.approx(1.0)
    assert measured["decomposition"] == pytest.approx(1.0)  # compute: busiest rank
    # Rows from before least_wait existed fall back to the per-rank minimum.
    assert measured_phases({"rank_timings": row["rank_timings"]})["grad_comm"] == 9.0


# ---------------------------------------------------------------- table writers
def test_second_order_update_ratios_and_files(tmp_path: Path) -> None:
    paths = tables.write_table("second_order_update", timing_rows(), tmp_path)
    for key in ("csv", "md", "png", "raw"):
        assert paths[key].exists() and paths[key].stat().st_size > 0
    long, head = tables.second_order_frames(timing_rows())
    h = head.iloc[0]
    assert h["compute_d_kfac/dp"] == pytest.approx(2.0)
    assert h["compute_spd_kfac/dp"] == pytest.approx(1.5)
    assert h["compute_best/dp"] == pytest.approx(1.5)
    assert h["comm_best/dp"] == pytest.approx(1.5)
    assert h["MB_d_kfac/dp"] == pytest.approx(2.0)
    assert h["memory_d_kfac/dp"] == pytest.approx(2.0)
    by = long.set_index("strategy")
    assert by.loc["dp_kfac", "iteration_vs_sgd"] == pytest.approx(2.0)
    assert by.loc["d_kfac", "compute/dp"] == pytest.approx(2.0)
    assert list(long["strategy"]) == ["none", "dp_kfac", "d_kfac", "spd_kfac"]
    md = paths["md"].read_text()
    assert "ChildFailedError" in md and "| mlp |" in md
    csv = pd.read_csv(paths["csv"])
    assert set(csv["strategy"]) == {"none", "dp_kfac", "d_kfac", "spd_kfac"}


def test_first_order_rows_are_found_from_their_options(tmp_path: Path) -> None:
    """The baseline is the row without a preconditioner, whatever its config is called."""
    rows = timing_rows()
    rows.loc[rows["strategy"] == "none", "strategy"] = "sgd_alone"
    long, _ = tables.second_order_frames(rows)
    assert long.set_index("strategy").loc["dp_kfac", "iteration_vs_sgd"] == pytest.approx(2.0)
    wide = tables.breakdown_frame(rows).set_index("strategy")
    assert wide.loc["d_kfac", "vs_sgd"] == pytest.approx(3.0)
    assert pages.first_order({"kfac_options": "null"})
    assert not pages.first_order({"kfac_options": json.dumps({"strategy": "d_kfac"})})


def test_time_breakdown_parts_add_up(tmp_path: Path) -> None:
    paths = tables.write_table("time_breakdown", timing_rows(), tmp_path)
    assert paths["png"].exists()
    wide = pd.read_csv(paths["csv"]).set_index("strategy")
    parts = [f"{p}_ms" for p in tables.ITERATION_PARTS]
    assert wide.loc["d_kfac", parts].sum() == pytest.approx(wide.loc["d_kfac", "sum_ms"])
    assert wide.loc["d_kfac", "factor_comm_ms"] == pytest.approx(4.0)
    assert wide.loc["dp_kfac", "vs_sgd"] == pytest.approx(2.0)
    assert "## mlp label, paper setting, P=2" in paths["md"].read_text()


def test_scaling_predicts_to_256_and_reports_errors(tmp_path: Path) -> None:
    rows = pd.DataFrame([fake_row(s, p) for s in ("none", "dp_kfac", "d_kfac") for p in (1, 2)])
    paths = tables.write_table("scaling", rows, tmp_path)
    frame = pd.read_csv(paths["csv"])
    calibrated = frame[frame["source"] == "calibrated"]
    assert sorted(calibrated["world_size"].unique()) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert (frame["source"] == "v100_ib100, paper size").any()
    errors = pd.read_csv(paths["errors"])
    assert set(errors["world_size"]) == {2}
    assert {"decomposition", "grad_comm"} <= set(errors["phase"])
    assert "median |error| %" in paths["md"].read_text()


def test_ratios_carry_their_range_over_repeated_runs(tmp_path: Path) -> None:
    """Each run's ratio to SGD is taken within that run; the table shows the median run's
    ratio with the lowest and highest over runs, and a job run once shows the ratio alone."""
    rows = []
    # (seed, SGD ms, dp_kfac ms): ratios 1.2, 1.5, 1.1; seed 0 is the median job.
    for seed, sgd, dp in ((0, 20.0, 24.0), (1, 10.0, 15.0), (2, 30.0, 33.0)):
        rows.append({**fake_row("none", 2), "seed": seed, "iteration_s": sgd / 1e3})
        rows.append({**fake_row("dp_kfac", 2), "seed": seed, "iteration_s": dp / 1e3})
    df = pd.DataFrame(rows)
    spread = tables.vs_sgd_spread(df).set_index("strategy")
    assert spread.loc["dp_kfac", "vs_sgd_min"] == pytest.approx(1.1)
    assert spread.loc["dp_kfac", "vs_sgd_max"] == pytest.approx(1.5)
    assert spread.loc["dp_kfac", "runs"] == 3
    wide = tables.breakdown_frame(df).set_index("strategy")
    assert wide.loc["dp_kfac", "vs_sgd"] == pytest.approx(1.2)
    assert tables.ratio_text(1.2, 1.1, 1.5, 3) == "1.20 (1.10–1.50)"
    assert tables.ratio_text(1.0, 1.0, 1.0, 3) == "1.00"  # SGD against itself
    assert tables.ratio_text(1.2, float("nan"), float("nan"), 1) == "1.20"
    md = tables.write_table("time_breakdown", df, tmp_path)["md"].read_text()
    assert "| 1.20 (1.10–1.50) |" in md
    once = tables.breakdown_frame(pd.DataFrame(rows[:2])).set_index("strategy")
    assert once.loc["dp_kfac", "runs"] == 1


def test_repeated_jobs_keep_the_median_job_whole() -> None:
    """A seed sweep repeats each job: the job with the median total iteration time is kept with
    all its rows (ratios stay within one run); jobs run once pass unchanged; the lower middle
    of an even count."""
    rows = []
    for seed, scale in ((0, 3.0), (1, 1.0), (2, 2.0)):  # seed 2 is the median job at P=2
        for strategy, ms in (("none", 10.0), ("dp_kfac", 12.0)):
            rows.append({**fake_row(strategy, 2), "seed": seed, "iteration_s": scale * ms / 1e3})
    rows.append({**fake_row("dp_kfac", 1), "seed": 0, "iteration_s": 0.05})
    for seed, ms in ((0, 8.0), (1, 6.0)):
        rows.append({**fake_row("none", 4), "seed": seed, "iteration_s": ms / 1e3})
    df = pd.DataFrame(rows)
    kept = pages.median_runs(df)
    assert sorted(kept.index) == [4, 5, 6, 8]
    assert set(kept.loc[[4, 5], "seed"]) == {2}  # whole job: both strategies of seed 2
    assert kept.loc[8, "seed"] == 1  # 6 ms: the lower of two
    assert kept.loc[4].equals(df.loc[4])  # rows untouched
    once = pd.DataFrame([fake_row(s, 2) for s in ("none", "dp_kfac")])
    assert pages.median_runs(once).equals(once)
    unseeded = once.assign(seed=float("nan"))  # rows written before seeds were recorded
    assert pages.median_runs(unseeded).equals(unseeded)


def test_calibration_separates_one_core_and_shared_core_regimes() -> None:
    """Rows the model itself generates give back both regimes' links and overlaps."""
    from dataclasses import replace

    from dpkfac.costmodel import PRESETS, Link, fitting, scaled
    from dpkfac.costmodel.timing import COMM_PHASES
    from experiments.bench import predict as bp

    one_core = replace(
        scaled(PRESETS["cpu_gloo_local"], network=0.5),
        overlap=0.2,
    )
    shared_links = {
        "allreduce": Link(alpha=5e-3, beta=9e-10),
        "broadcast": Link(alpha=1e-4, beta=8e-10),
        "reduce": Link(alpha=2e-4, beta=1e-9),
    }
    from dpkfac.costmodel.traffic import factor_keys

    # Every factor in a bucket of its own, so part of spd_kfac's traffic can hide.
    keys = factor_keys(bp.row_shapes(fake_row("spd_kfac"))[0])
    plan = json.dumps([[list(k)] for k in keys])
    rows = []
    for p in (2, 4):  # two cores: P=4 ranks share them
        hw = one_core if p == 2 else replace(scaled(one_core, compute=0.5), links=shared_links)
        # As fitting.hardware_for prices them: the rank that waits least lands its buffers
        # on a core of its own.
        hw = replace(hw, engines={**hw.engines, "unpack": one_core.engine("unpack")})
        hw = replace(hw, overlap=0.2 if p == 2 else 0.7)
        for strategy in ("none", "dp_kfac", "d_kfac", "spd_kfac"):
            row = fake_row(strategy, p, cpus=2, device="cpu", fusion_plan=plan)
            ranks = bp.predict_row(row, hw).update.phases_per_rank
            row["rank_timings"] = json.dumps(ranks)
            row["least_wait"] = json.dumps({ph: min(r[ph] for r in ranks) for ph in COMM_PHASES})
            rows.append(row)
    ms = [bp.measurement(r) for r in rows]
    cal = fitting.calibrate_measurements(ms, PRESETS["cpu_gloo_local"], "calibrated")
    shared = fitting.shared_core_links(ms, cal)
    assert set(shared) == {4}
    for kind in ("allreduce", "broadcast"):
        assert cal.link(kind).alpha == pytest.approx(one_core.link(kind).alpha, rel=1e-3)
        assert cal.link(kind).beta == pytest.approx(one_core.link(kind).beta, rel=1e-3)
        fitted = shared[4].links[kind]
        assert fitted.alpha == pytest.approx(shared_links[kind].alpha, rel=1e-3)
        assert fitted.beta == pytest.approx(shared_links[kind].beta, rel=1e-3)
    overlap, regimes = fitting.fit_overlap([fitting.ModelFit(cal, tuple(ms))], shared)
    assert overlap == pytest.approx(0.2, abs=0.01)
    hw = replace(cal, overlap=overlap)
    assert regimes[4].overlap == pytest.approx(0.7, abs=0.01)
    for row, m in zip(rows, ms, strict=True):
        predicted = fitting.predict_measurement(m, fitting.hardware_for(m, hw, regimes))
        for phase, seconds in bp.measured_phases(row).items():
            assert predicted.update.phases[phase] == pytest.approx(seconds, rel=0.01, abs=1e-9)


def ablation_rows() -> pd.DataFrame:
    """Both settings, every strategy config in the preset's order, d_kfac_eager twice as costly."""
    rows = []
    for setting, (f, i) in (("paper", (1, 1)), ("practical", (10, 100))):
        for strategy in ABLATION_ORDER:
            scale = 2.0 if strategy == "d_kfac_eager" else 1.0
            rows.append(
                fake_row(
                    strategy,
                    setting=setting,
                    scale=scale,
                    factor_update_steps=f,
                    inv_update_steps=i,
                )
            )
    failed = {"task": "timing", "model": "mlp", "strategy": "spd_kfac", "world_size": 2}
    return pd.DataFrame([*rows, {**failed, "setting": "paper", "error": "timeout"}])


def test_ablation_table_measured_and_predicted(tmp_path: Path) -> None:
    from dpkfac.costmodel import PRESETS
    from experiments.bench import predict as bp

    paths = tables.write_table("ablation", ablation_rows(), tmp_path)
    for key in ("csv", "md", "png", "raw"):
        assert paths[key].exists() and paths[key].stat().st_size > 0
    frame = pd.read_csv(paths["csv"], keep_default_na=False, na_values=[""])
    # The preset's order, one group per setting, failed job left out.
    assert list(frame["setting"]) == ["paper"] * 9 + ["practical"] * 9
    assert list(frame["strategy"]) == ABLATION_ORDER * 2
    paper = frame[frame["setting"] == "paper"].set_index("strategy")
    assert paper.loc["d_kfac_eager", "vs_sgd"] == pytest.approx(3.0)
    assert paper.loc["dp_kfac", "vs_sgd"] == pytest.approx(2.0)
    assert paper.loc["d_kfac_eager", "compute_ms"] == pytest.approx(2 * 4.5)
    assert paper.loc["d_kfac_eager", "MB"] == pytest.approx(2.0)
    assert paper.loc["d_kfac_lazy", "algorithm"] == "d_kfac"
    assert paper.loc["d_kfac_lazy", "options"] == (
        "placement=lpt, triangle=true, lazy_factor_sync=true"
    )
    assert paper.loc["none", "grad_MB"] == pytest.approx(0.004)
    # Predictions: P=64 on v100_ib100, exactly the cost model's, amortised like the row.
    assert set(frame["pred_P"]) == {64}
    rows = ablation_rows()
    for setting in ("paper", "practical"):
        for strategy in ("d_kfac_lazy", "kaisa_mem_opt", "dp_kfac_owner"):
            (row,) = rows[(rows["strategy"] == strategy) & (rows["setting"] == setting)].to_dict(
                "records"
            )
            pred = bp.predict_row(row, PRESETS["v100_ib100"], world_size=64)
            want = bp.amortised_prediction(row, pred)
            got = frame[(frame["strategy"] == strategy) & (frame["setting"] == setting)].iloc[0]
            assert got["pred_iteration_ms"] == pytest.approx(1e3 * want["iteration_s"])
            assert got["pred_MB"] == pytest.approx(want["bytes_second_order"] / 1e6)
            assert got["pred_memory_MiB"] == pytest.approx(pred.memory_max / 2**20)
    practical = frame[frame["setting"] == "practical"].set_index("strategy")
    # What each switch saves, as the cost model prices it at P=64.
    assert paper.loc["d_kfac_triangle", "pred_MB"] < paper.loc["d_kfac_eager", "pred_MB"]
    assert paper.loc["d_kfac_lazy", "pred_MB"] == pytest.approx(
        paper.loc["d_kfac_triangle", "pred_MB"]
    )
    assert practical.loc["d_kfac_lazy", "pred_MB"] < practical.loc["d_kfac_triangle", "pred_MB"]
    assert (
        paper.loc["dp_kfac_owner", "pred_total_wire_MB"]
        < paper.loc["dp_kfac", "pred_total_wire_MB"]
    )
    assert (
        paper.loc["kaisa_mem_opt", "pred_memory_MiB"]
        < paper.loc["kaisa_comm_opt", "pred_memory_MiB"]
    )
    assert paper.loc["none", "pred_vs_sgd"] == pytest.approx(1.0)
    md = paths["md"].read_text()
    assert "## mlp label, practical setting, measured at P=2" in md
    assert "### Predicted at P=64 (`v100_ib100`, paper-size model)" in md and "timeout" in md
    assert "- `d_kfac_eager`: d_kfac, placement=lpt, triangle=false, lazy_factor_sync=false" in md
    assert "- `none`: no preconditioner (SGD)" in md


def test_convergence_table_and_smoke_status(tmp_path: Path) -> None:
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "smoke_junit.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="t" name="test_smoke[digits_cnn-dp_kfac]" time="1.5"/>'
        '<testcase classname="t" name="test_smoke[squad_bert_adamw-d_kfac]" time="2.0">'
        '<failure message="boom"/></testcase>'
        '<testcase classname="t" name="test_wandb" time="0.5"/></testsuite></testsuites>'
    )
    paths = tables.write_table("convergence", convergence_rows(), tmp_path)
    curves = pd.read_csv(paths["csv"])
    assert len(curves) == 4 * 3 and curves["test_acc"].max() == pytest.approx(0.95)
    md = paths["md"].read_text()
    assert "| P=1 | P=2 |" in md.replace("strategy | ", "")
    # One row per preset (the full matrix of strategies is in convergence_smoke.csv).
    assert "| digits_cnn | 1 | 1 | – | 1.5 |" in md
    assert "| squad_bert_adamw | 1 | 0 | d_kfac: failed (2.0 s) | 2.0 |" in md
    assert "Cases: 1 failed, 2 passed" in md
    assert paths["png"].exists()


def test_convergence_table_without_a_smoke_report_says_so(tmp_path: Path) -> None:
    paths = tables.write_table("convergence", convergence_rows(), tmp_path)
    md = paths["md"].read_text()
    assert "No smoke report" in md and "`make smoke-report`" in md
    assert not (tmp_path / "convergence_smoke.csv").exists()


def test_the_smoke_report_comes_from_the_makefile_not_the_benchmark() -> None:
    """No module of experiments/ runs pytest; ``make smoke-report`` writes what the table reads."""
    import re

    from experiments.bench import smoke

    for path in (ROOT / "experiments").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"[\"']pytest[\"']", text), f"{path} runs pytest"
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\nsmoke-report:", 1)[1].split("\n\n", 1)[0]
    assert "tests/test_experiments_smoke.py::test_preset_runs_two_steps" in recipe
    assert f"--junitxml=results/{smoke.JUNIT.as_posix()}" in recipe
    assert "-m experiments.bench.tables convergence" in recipe


def test_old_rows_read_in_present_terms(tmp_path: Path) -> None:
    """Rows from before the renames: interval columns and the batch module, values kept."""
    old = fake_row("dp_kfac", factor_update_steps=10, inv_update_steps=100)
    old["factor_every"], old["inv_every"] = (
        old.pop("factor_update_steps"),
        old.pop("inv_update_steps"),
    )
    earlier = "experiments.bench.earlier_name.VectorBatches"
    old["model_batch"] = json.dumps({**json.loads(old["model_batch"]), "_target_": earlier})
    pd.DataFrame([old]).to_csv(tmp_path / "old.csv", index=False)
    columns = list(pd.read_csv(tmp_path / "old.csv").columns)
    rows = tables.load_rows([tmp_path / "old.csv"])
    renamed = [tables.RENAMED_COLUMNS.get(c, c) for c in columns]
    assert list(rows.columns) == renamed  # same place, new names
    (row,) = rows.to_dict("records")
    assert (row["factor_update_steps"], row["inv_update_steps"]) == (10, 100)
    assert json.loads(row["model_batch"]) == json.loads(MLP_COLUMNS["model_batch"])
    # Old and new rows together.
    (tmp_path / "new.json").write_text(json.dumps([fake_row("none")]))
    both = tables.load_rows([tmp_path / "old.csv", tmp_path / "new.json"])
    assert "factor_every" not in both and list(both["inv_update_steps"]) == [100, 1]


def test_load_rows_reads_sweep_folders_and_csv(tmp_path: Path) -> None:
    for num, strategy in ((2, "none"), (10, "dp_kfac")):  # job 10 comes after job 2
        job = tmp_path / "sweep" / str(num)
        job.mkdir(parents=True)
        (job / "rows.json").write_text(json.dumps([fake_row(strategy)]))
    rows = tables.load_rows([tmp_path / "sweep"])
    assert list(rows["strategy"]) == ["none", "dp_kfac"]
    rows.to_csv(tmp_path / "rows.csv", index=False)
    again = tables.load_rows([tmp_path / "rows.csv"])
    assert again["error"].tolist() == ["", ""]
    with pytest.raises(FileNotFoundError):
        tables.load_rows([tmp_path / "missing.txt"])


# ------------------------------------------------------------------- notebook
def test_results_notebook_executes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    results = tmp_path / "results"
    tables.write_table("second_order_update", timing_rows(), results)
    tables.write_table("time_breakdown", timing_rows(), results)
    tables.write_table("convergence", convergence_rows(), results)
    rows = pd.DataFrame([fake_row(s, p) for s in ("none", "dp_kfac") for p in (1, 2)])
    tables.write_table("scaling", rows, results)
    tables.write_table("ablation", ablation_rows(), results)
    from test_convergence_scale import _STUDY, _compose_node, _study_rows

    from experiments.bench import convergence_scale

    # The convergence study's writer plans from the rows with the study's settings: the
    # small study the rows were made for.
    monkeypatch.setattr(convergence_scale, "study_node", lambda overrides=(): _compose_node(_STUDY))
    tables.write_table("convergence_scale", _study_rows(lambda seed: 300 + seed), results)
    (results / "fidelity.csv").write_text(
        "run,world_size,strategy,step,layer,cosine,rel_error\n"
        "digits_cnn,2,dp_kfac,1,conv,0.99,0.01\ndigits_cnn,2,dp_kfac,3,fc,0.8,0.5\n"
    )
    monkeypatch.setenv("RESULTS_DIR", str(results))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(ROOT / "notebooks" / "results.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    text = "\n".join(
        out.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )
    assert str(results.resolve()) in text and "not generated yet" not in text
    images = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if "image/png" in out.get("data", {})
    ]
    assert len(images) == 7  # one figure per table section
    assert os.environ["RESULTS_DIR"] == str(results)


# ------------------------------------------------------------ results up front
def _median_seed(job: pd.DataFrame) -> Any:
    """The seed of a repeated job's median run: its strategies' total iteration time, the
    lower middle of an even count (the rule docs/reproduction.md states)."""
    totals = job.groupby("seed")["iteration_s"].sum().sort_values(kind="stable")
    return totals.index[(len(totals) - 1) // 2]


def _raw(table: str) -> pd.DataFrame:
    rows = pd.read_csv(ROOT / "results" / "raw" / f"{table}.csv", keep_default_na=False)
    return rows[rows["error"] == ""]


def _algorithm(options: Any) -> str:
    """The library strategy of a row's ``kfac_options`` ("" for SGD)."""
    value = json.loads(options) if isinstance(options, str) and options.strip() else None
    return "" if value is None else str(value["strategy"])


def _headline_line(start: str) -> str:
    from experiments.bench import takeaways

    block = takeaways.block_lines(ROOT / "README.md", takeaways.HEADLINE)
    (line,) = [x for x in block if x.startswith(start)]
    return line


def test_the_readme_headline_is_generated_from_the_results() -> None:
    """The README's first-screen results are the tables' own (rerun the generator if not)."""
    from experiments.bench import takeaways

    expected = takeaways.headline(ROOT / "results")
    assert 3 <= len(expected) <= 7
    assert takeaways.block_lines(ROOT / "README.md", takeaways.HEADLINE) == expected, (
        "README headline is stale: run python -m experiments.bench.takeaways"
    )
    # The digits table's SGD trained at a fixed, untuned learning rate: not a headline.
    assert not any(x.startswith("- **Convergence** (digits") for x in expected)


def test_the_readme_per_update_ratios_recompute_from_the_rows() -> None:
    """By the bullet's own rule, from the raw rows: in each run, the cheapest baseline's
    computation (and communication time) over that run's dp_kfac; per model the median
    run's ratio, and the range over every run."""
    from dpkfac.plan.configs import BASELINES

    raw = _raw("second_order_update")
    line = _headline_line("- **Per second-order update**")
    runs = raw["seed"].nunique()
    for column, what in (("compute_s", "computation"), ("comm_s", "communication time")):
        per_run, median, tied = [], [], []
        for model, job in raw.groupby("model", sort=False):
            seed = _median_seed(job)
            ratios = []
            for run_seed, run in job.groupby("seed"):
                by = run.set_index("strategy")[column]
                ratios.append(by[list(BASELINES)].min() / by["dp_kfac"])
                if run_seed == seed:
                    median.append(ratios[-1])
            per_run += ratios
            if min(ratios) <= 1 <= max(ratios):
                tied.append(f"{model} ({min(ratios):.2f}–{max(ratios):.2f})")
        text = (
            f"{min(median):.2f}–{max(median):.2f}× less {what} "
            f"({min(per_run):.2f}–{max(per_run):.2f} over {runs} runs)"
        )
        text += f", a tie on {', '.join(tied)}" if tied else ""
        assert text in line, (text, line)
        if not tied:
            assert f"{text}, a tie on" not in line


def test_the_readme_iteration_times_recompute_from_the_rows() -> None:
    """By the bullet's own rule, from the raw ablation rows (practical setting): per model
    and run dp_kfac's iteration over SGD's and the cheapest baseline's over SGD's, the
    median run's value and the range over runs; overlapping ranges are a tie."""
    raw = _raw("ablation")
    raw = raw[raw["setting"] == "practical"]
    line = _headline_line("- **Iteration time, practical setting**")
    verdicts = {}
    for model, job in raw.groupby("model", sort=False):
        seed = _median_seed(job)
        dp, best = {}, {}
        for run_seed, run in job.groupby("seed"):
            algorithm = run["kfac_options"].map(_algorithm)
            sgd = run.loc[algorithm == "", "iteration_s"].iloc[0]
            dp[run_seed] = run.loc[run["strategy"] == "dp_kfac", "iteration_s"].iloc[0] / sgd
            baselines = run[algorithm.isin(["d_kfac", "spd_kfac", "kaisa"])]
            best[run_seed] = baselines["iteration_s"].min() / sgd
        lo, hi = min(dp.values()), max(dp.values())
        blo, bhi = min(best.values()), max(best.values())
        tie = lo <= bhi and blo <= hi
        verdicts[model] = tie
        word = "a tie" if tie else "dp_kfac faster in every run"
        assert f"{model}: dp_kfac {dp[seed]:.2f}× ({lo:.2f}–{hi:.2f})" in line, line
        assert f"the cheapest baseline {best[seed]:.2f}× ({blo:.2f}–{bhi:.2f}): {word}" in line
    # The case: BERT-base's dp_kfac and kaisa_mem_opt within 0.01 ms of each other.
    assert verdicts["bert_base"]


def test_the_default_runs_figures_in_the_docs_are_generated() -> None:
    """docs/experiments.md takes make train's time and accuracy from the convergence rows."""
    from experiments.bench import takeaways

    doc = ROOT / "docs" / "experiments.md"
    expected = takeaways.default_run(ROOT / "results")
    assert takeaways.block_lines(doc, takeaways.DEFAULT_RUN) == expected, (
        "docs/experiments.md's default run is stale: run python -m experiments.bench.takeaways"
    )


def test_the_default_run_is_the_mean_of_its_seeds(tmp_path: Path) -> None:
    from experiments.bench import takeaways

    (tmp_path / "raw").mkdir()
    rows = pd.DataFrame(
        [
            {
                "strategy": s,
                "world_size": p,
                "final_acc": a,
                "seconds": t,
                "epochs": 10,
                "threads": 1,
                "cpus": 2,
            }
            for s, p, a, t in [
                ("dp_kfac", 1, 0.98, 5.0),
                ("dp_kfac", 1, 0.99, 7.0),
                ("dp_kfac", 2, 0.5, 1.0),
                ("none", 1, 0.1, 1.0),
            ]
        ]
    )
    rows.to_csv(tmp_path / "raw" / "convergence.csv", index=False)
    assert takeaways.default_run(tmp_path) == [
        "On this project's machine (2 CPU cores, 1 thread(s)) its 10 epochs train in 5.0–7.0 s "
        "and reach 0.985 ± 0.007 test accuracy (mean ± std over 2 seeds; "
        "`results/convergence.md`, dp_kfac at P=1)."
    ]


@pytest.mark.parametrize(
    "table", ["second_order_update", "time_breakdown", "scaling", "ablation", "convergence"]
)
def test_every_results_table_opens_with_its_takeaway(table: str) -> None:
    from pathlib import Path

    lines = (
        (Path(__file__).resolve().parents[1] / "results" / f"{table}.md").read_text().split("\n")
    )
    assert lines[0].startswith("# ") and lines[2].startswith("**Takeaway")


def _texts(nb: Any) -> list[str]:
    """A notebook's text outputs (stdout and plain-text reprs), images left out.

    stderr is left out: it carries library warnings whose text names the machine's
    interpreter path, not the tables."""
    return [
        out.get("text") or out.get("data", {}).get("text/plain", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if ("text" in out and out.get("name") != "stderr") or "text/plain" in out.get("data", {})
    ]


def test_the_notebooks_saved_outputs_are_the_tables_of_today(monkeypatch, tmp_path) -> None:
    """Executed on ``results/`` now, the notebook prints what it was committed with
    (run ``make notebook`` after the results change)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("RESULTS_DIR", str(ROOT / "results"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.delenv("RUN_FIDELITY", raising=False)
    saved = nbformat.read(ROOT / "notebooks" / "results.ipynb", as_version=4)
    fresh = nbformat.read(ROOT / "notebooks" / "results.ipynb", as_version=4)
    nbclient.NotebookClient(
        fresh, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    assert _texts(fresh) == _texts(saved), "notebook outputs are stale: run make notebook"


def test_the_notebook_is_committed_with_its_outputs() -> None:
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(ROOT / "notebooks" / "results.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("outputs") for c in code)
    first = "".join(o.get("text", "") for o in code[0]["outputs"])
    assert "results from" in first  # it says which folder it read
    assert "not generated yet" not in "".join(o.get("text", "") for c in code for o in c["outputs"])
    assert "the cheapest of the baselines" in nb.cells[2].source


def test_the_results_index_is_generated_from_the_results() -> None:
    """``results/README.md`` lists every table with its runs and noise, read from the rows."""
    from experiments.bench import results_index

    text = (ROOT / "results" / "README.md").read_text()
    assert text.rstrip("\n").split("\n") == results_index.index(ROOT / "results"), (
        "results/README.md is stale: run make notebook"
    )
    for entry in results_index.TABLES.values():
        if (ROOT / "results" / f"{entry.name}.md").exists():
            assert f"[{entry.name}]({entry.name}.md)" in text


def test_the_results_index_states_runs_and_noise(tmp_path: Path) -> None:
    from experiments.bench import results_index

    rows = []
    for seed, sgd, dp in ((0, 20.0, 24.0), (1, 10.0, 15.0), (2, 30.0, 33.0)):
        rows.append({**fake_row("none", 2), "seed": seed, "iteration_s": sgd / 1e3})
        rows.append({**fake_row("dp_kfac", 2), "seed": seed, "iteration_s": dp / 1e3})
    tables.write_table("time_breakdown", pd.DataFrame(rows), tmp_path)
    line = next(x for x in results_index.index(tmp_path) if x.startswith("| [time_breakdown]"))
    cells = [c.strip() for c in line.split("|")]
    assert cells[5] == "3"  # runs
    # dp_kfac's ratios 1.1-1.5 span 0.4 / 1.3 = 31% of themselves (SGD's own is left out).
    assert cells[6].startswith("the ratio to SGD spans 31% of itself over the runs")
    assert "31% at most" in cells[6]


def test_the_computation_ratio_carries_its_range_over_runs(tmp_path: Path) -> None:
    """second_order_update repeated over seeds: each run's computation ratio is taken
    within that run, and the headline shows the range of each run's cheapest baseline."""
    from experiments.bench import takeaways

    rows = []
    for seed, scale in ((0, 1.5), (1, 2.0), (2, 1.2)):  # d_kfac's compute over dp_kfac's
        rows.append({**fake_row("none", 2), "seed": seed})
        rows.append({**fake_row("dp_kfac", 2), "seed": seed})
        rows.append({**fake_row("d_kfac", 2, scale=scale), "seed": seed})
    spread = tables.cost_ratio_spread(pd.DataFrame(rows)).set_index("strategy")
    assert spread.loc["d_kfac", "compute/dp_min"] == pytest.approx(1.2)
    assert spread.loc["d_kfac", "compute/dp_max"] == pytest.approx(2.0)
    assert spread.loc["d_kfac", "runs"] == 3
    tables.write_table("second_order_update", pd.DataFrame(rows), tmp_path)
    line = takeaways.headline(tmp_path)[0]
    assert "1.50× less computation (1.20–2.00 over 3 runs)" in line
    assert tables.cost_ratio_spread(pd.DataFrame(rows[:3])).empty  # one run: no range


def test_the_cheapest_baseline_is_taken_within_each_run() -> None:
    """A baseline that is cheap in one run and dear in another must not widen the range:
    per run the cheapest one counts (issue 42's 1.50, kaisa_comm_opt on ResNet-32 in a run
    where another baseline was cheaper)."""
    rows = []
    # (seed, d_kfac scale, spd_kfac scale): the cheapest per run is 1.2, 1.3, 1.4.
    for seed, d, spd in ((0, 1.2, 1.9), (1, 2.5, 1.3), (2, 1.4, 1.5)):
        rows += [
            {**fake_row("none"), "seed": seed},
            {**fake_row("dp_kfac"), "seed": seed},
            {**fake_row("d_kfac", scale=d), "seed": seed},
            {**fake_row("spd_kfac", scale=spd), "seed": seed},
        ]
    best = tables.cheapest_per_run(
        pd.DataFrame(rows), ["d_kfac", "spd_kfac"], "dp_kfac", "compute_s", "c"
    ).iloc[0]
    assert (best["c_min"], best["c_max"], best["c_runs"]) == pytest.approx((1.2, 1.4, 3))
    spread = tables.cost_ratio_spread(pd.DataFrame(rows)).set_index("strategy")
    assert spread["compute/dp_max"].max() == pytest.approx(2.5)  # what a per-strategy range says


def test_overlapping_ranges_are_a_tie() -> None:
    """dp_kfac against the cheapest baseline of each run, × SGD: a verdict only where every
    run agrees; the page and the headline say "a tie" otherwise."""
    from experiments.bench import takeaways

    rows = []
    # (seed, SGD, dp_kfac, d_kfac) ms: dp 1.2/1.5/1.1, d_kfac 1.4/1.3/1.6: overlapping.
    for seed, sgd, dp, d in ((0, 20.0, 24.0, 28.0), (1, 10.0, 15.0, 13.0), (2, 30, 33, 48)):
        rows += [
            {**fake_row("none"), "seed": seed, "iteration_s": sgd / 1e3},
            {**fake_row("dp_kfac"), "seed": seed, "iteration_s": dp / 1e3},
            {**fake_row("d_kfac"), "seed": seed, "iteration_s": d / 1e3},
        ]
    df = pd.DataFrame(rows)
    (verdict,) = tables.iteration_verdicts(
        df, tables.breakdown_frame(df), ["d_kfac"], "world_size"
    ).to_dict("records")
    assert verdict["verdict"] == "tie"
    assert (verdict["baseline_vs_sgd_min"], verdict["baseline_vs_sgd_max"]) == pytest.approx(
        (1.3, 1.6)
    )
    assert "the cheapest baseline 1.40× (1.30–1.60): a tie" in takeaways.verdict_text(verdict)
    faster = df.assign(iteration_s=df["iteration_s"] * (1 + (df["strategy"] == "d_kfac")))
    (verdict,) = tables.iteration_verdicts(
        faster, tables.breakdown_frame(faster), ["d_kfac"], "world_size"
    ).to_dict("records")
    assert verdict["verdict"] == "faster"
    assert tables.verdict((1.0, 1.1), (1.2, 1.3)) == "faster"
    assert tables.verdict((1.4, 1.5), (1.2, 1.3)) == "slower"
