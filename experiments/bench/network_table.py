"""The ``network`` table: K-FAC on an emulated cluster network, against its floor.

``python -m experiments.bench -m table=network`` measures SGD (DDP) and every K-FAC
configuration interleaved at P=2 on an emulated network (:mod:`experiments.network`, one
node per rank, each link shaped to ``network.rate``), three runs per job. This module turns
the rows into ``results/network.{csv,md,png}``.

Per step, each row is split into what the rank computes and what it waits for:

* **compute** is the pure forward/backward (``fwd_bwd`` of the job's K-FAC rows that
  reduce gradients after the backward pass: their backward holds no transfer), plus the
  row's own K-FAC compute (factors, decompositions, preconditioning), other work in
  ``step()`` and the optimizer step;
* **exposed communication** is the rest of the measured step (the time it waited for the
  wire, whichever phase the wait fell in);
* **hidden communication** is what the row's wire bytes need at the rate beyond that:
  transfers that ran under compute.

Its **floor** is what no schedule can beat on this link, the longest of: the compute; the
wire time plus what no transfer can overlap (the forward pass, taken as a third of
forward/backward, and the optimizer step and other work after the last transfer); and the
whole forward/backward, then the last gradient bucket's transfer (DDP's buckets: its
gradients are ready only when the backward pass ends), then that work after it. Beside each row
is the cost model's prediction from the job's link probe alone
(:func:`experiments.bench.predict.probe_hardware`), held out from every measured step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from dpkfac.plan.hardware import wire_bytes
from dpkfac.stats import COMM_CATEGORIES
from experiments.bench import plots, takeaways
from experiments.bench.pages import (
    JOB,
    first_order,
    footer,
    ok_rows,
    ratio_text,
    to_markdown,
    with_takeaway,
    write_page,
)
from experiments.bench.workloads import json_value
from experiments.network import format_rate

#: The share of forward/backward that is the forward pass (backward taken as twice it):
#: no gradient exists before it ends, so no transfer overlaps it.
FORWARD_SHARE = 1 / 3
#: K-FAC phases of compute, as the rows name them.
KFAC_COMPUTE = ("factor_compute", "decomposition", "precondition")
#: Main table columns (at most 8) and their headers.
MAIN = {
    "strategy": "strategy",
    "iteration": "iteration ms",
    "vs SGD": "× SGD",
    "exposed_comm_ms": "exposed comm",
    "hidden_comm_ms": "hidden comm",
    "kfac_compute_ms": "K-FAC compute",
    "vs floor": "× floor",
    "pred_iteration_ms": "predicted ms",
}
#: The measured phases shown per row in the detail table.
PHASES = ("fwd_bwd", "grad_comm", "factor_comm", "decomposition_comm", "precond_comm")


def _overlapped(row: dict[str, Any]) -> bool:
    """Whether a K-FAC row reduces gradients inside its backward pass (``overlap``)."""
    options = json_value(row.get("kfac_options")) or {}
    return bool(options.get("overlap"))


def _ms(row: dict[str, Any], key: str) -> float:
    """A row's ``<key>_s`` in milliseconds (0 where it has none)."""
    value = row.get(f"{key}_s")
    return 0.0 if value is None or value != value else 1e3 * float(value)


def _wire_bytes(row: dict[str, Any]) -> float:
    """Bytes one rank put on the wire per step, every collective category (gradients too)."""
    values = (row.get(f"wire_{c}") for c in COMM_CATEGORIES)
    return sum(float(v) for v in values if v is not None and v == v)


def _pure_fwd_bwd(job: list[dict[str, Any]]) -> float:
    """Milliseconds of forward/backward without any transfer in it, from a job's rows.

    The K-FAC rows that reduce gradients after the backward pass compute it alone (their
    factor hooks are timed apart); the median of theirs. Without such rows, SGD's (an upper
    bound: DDP's exposed waits are inside it).
    """
    plain = [_ms(r, "fwd_bwd") for r in job if not first_order(r) and not _overlapped(r)]
    if not plain:
        plain = [_ms(r, "fwd_bwd") for r in job]
    return float(pd.Series(plain).median()) if plain else math.nan


def _model_terms(rows: list[dict[str, Any]], predict: bool) -> list[dict[str, float]]:
    """Per row, what its model's shapes say: the last gradient bucket's bytes, and the cost
    model's iteration (ms) from the job's probe alone (``predict``)."""
    from dpkfac.costmodel import fitting
    from dpkfac.costmodel.traffic import ddp_bucket_params
    from dpkfac.plan.fusion import DDP_DEFAULT_CAP_BYTES
    from experiments.bench import predict as predict_lib

    out = []
    for r, (shapes, sharing) in zip(rows, predict_lib.shapes_per_row(rows), strict=True):
        last = ddp_bucket_params(shapes, itemsize=4, cap_bytes=DDP_DEFAULT_CAP_BYTES)[-1]
        terms = {"last_bucket_bytes": float(4 * sum(n for _, n in last))}
        if predict:
            m = predict_lib.measurement(r, shapes=shapes, weight_sharing=sharing)
            pred = fitting.predict_measurement(m, predict_lib.probe_hardware(r))
            amortised = predict_lib.amortised_prediction(r, pred)["iteration_s"]
            terms["pred_iteration_ms"] = 1e3 * amortised
        out.append(terms)
    return out


def _job_entries(
    job: list[dict[str, Any]], rate: float, terms: list[dict[str, float]]
) -> list[dict[str, Any]]:
    """The frame's entries of one job (one run of one model, setting and rate)."""
    pure, p = _pure_fwd_bwd(job), int(job[0]["world_size"])
    out = []
    for r, model in zip(job, terms, strict=True):
        kfac = sum(_ms(r, k) for k in KFAC_COMPUTE)
        after = _ms(r, "optimizer") + _ms(r, "step_other")
        compute = pure + kfac + after
        iteration = _ms(r, "iteration")
        wire_ms = 1e3 * _wire_bytes(r) * 8 / rate
        exposed = max(iteration - compute, 0.0)
        # The last bucket's gradients are ready when the backward pass ends.
        last_ms = 1e3 * wire_bytes("allreduce", int(model["last_bucket_bytes"]), p) * 8 / rate
        floor = max(compute, FORWARD_SHARE * pure + wire_ms + after, pure + last_ms + after)
        out.append(
            {
                "model": r["model"],
                "label": r["label"],
                "setting": r["setting"],
                "world_size": int(r["world_size"]),
                "rate_bps": rate,
                "strategy": r["strategy"],
                "first_order": first_order(r),
                "iteration_ms": iteration,
                "compute_ms": compute,
                "pure_fwd_bwd_ms": pure,
                "kfac_compute_ms": kfac,
                "after_ms": after,
                "exposed_comm_ms": exposed,
                "hidden_comm_ms": max(wire_ms - exposed, 0.0),
                "wire_ms": wire_ms,
                "wire_MB": _wire_bytes(r) / 1e6,
                "last_bucket_ms": last_ms,
                "floor_ms": floor,
                "vs_floor": iteration / floor if floor > 0 else math.nan,
                **{f"{phase}_ms": _ms(r, phase) for phase in PHASES},
                "faithful_bps": float(r.get("network_faithful_bps") or math.nan),
                **{k: v for k, v in model.items() if k.startswith("pred_")},
            }
        )
    return out


def network_frame(df: pd.DataFrame, *, predict: bool = True) -> pd.DataFrame:
    """One row per (model, setting, rate, strategy config): the median run, split and floored.

    Of the runs of each job (model, setting, P, rate) the median one is kept whole
    (:func:`experiments.bench.pages.ok_rows`); ``iteration_min_ms``/``iteration_max_ms`` and
    ``vs_sgd_min``/``vs_sgd_max`` are the ranges over every run, each ratio taken within its
    run. ``floor_vs_sgd`` is the row's floor over SGD's measured iteration, and
    ``pred_iteration_ms``/``pred_vs_sgd`` the cost model's prediction from the job's link
    probe alone (``predict=False``: left out).
    """
    from experiments.bench.tables import over_sgd, vs_sgd_spread, with_spread

    if df.empty or "network" not in df:
        return pd.DataFrame()
    emulated = df[(df["error"] == "") & (df["network"] == "emulated")]
    parts = []
    for rate, runs in emulated.groupby("network_rate_bps", sort=True):
        entries = []
        for _, job in ok_rows(runs).groupby(JOB, sort=False):
            rows = job.to_dict("records")
            entries += _job_entries(rows, float(rate), _model_terms(rows, predict))
        frame = pd.DataFrame(entries)
        ranges = runs.assign(ms=1e3 * runs["iteration_s"]).groupby([*JOB, "strategy"])["ms"]
        bounds = ranges.agg(iteration_min_ms="min", iteration_max_ms="max").reset_index()
        bounds["world_size"] = bounds["world_size"].astype(int)
        frame = frame.merge(bounds, on=[*JOB, "strategy"], how="left")
        parts.append(with_spread(frame, vs_sgd_spread(runs), "world_size"))
    if not parts:
        return pd.DataFrame()
    frame = pd.concat(parts, ignore_index=True)
    group = ["model", "setting", "rate_bps"]
    frame["vs_sgd"] = over_sgd(frame, group, "iteration_ms")
    frame["floor_vs_sgd"] = frame["floor_ms"] / frame["iteration_ms"] * frame["vs_sgd"]
    if "pred_iteration_ms" in frame:
        frame["pred_vs_sgd"] = over_sgd(frame, group, "pred_iteration_ms")
        frame["pred_error_%"] = 100 * (frame["pred_iteration_ms"] / frame["iteration_ms"] - 1)
    return plots.in_order(frame, ["model", "setting", "rate_bps", "strategy"])


def _iteration_text(r: Any) -> str:
    """``312 (305–330)``: the median run's milliseconds and the range over runs."""
    low, high = r.iteration_min_ms, r.iteration_max_ms
    spread = f" ({low:.0f}–{high:.0f})" if int(r.runs) > 1 and low == low and low != high else ""
    return f"{r.iteration_ms:.0f}{spread}"


def main_table(g: pd.DataFrame) -> pd.DataFrame:
    """The page's table of one (model, setting, rate): at most 8 columns."""
    show = pd.DataFrame({"strategy": g["strategy"].to_numpy()})
    show["iteration"] = [_iteration_text(r) for r in g.itertuples()]
    show["vs SGD"] = [
        ratio_text(r.vs_sgd, r.vs_sgd_min, r.vs_sgd_max, int(r.runs)) for r in g.itertuples()
    ]
    for column in ("exposed_comm_ms", "hidden_comm_ms", "kfac_compute_ms"):
        show[column] = g[column].to_numpy()
    show["vs floor"] = g["vs_floor"].to_numpy()
    if "pred_iteration_ms" in g:
        show["pred_iteration_ms"] = g["pred_iteration_ms"].to_numpy()
    return show.rename(columns=MAIN)


def _detail_table(g: pd.DataFrame) -> pd.DataFrame:
    """Every measured phase and the floor's parts of one (model, setting, rate)."""
    columns = {
        "strategy": "strategy",
        **{f"{p}_ms": p for p in PHASES},
        "compute_ms": "compute",
        "wire_MB": "wire MB",
        "wire_ms": "wire ms",
        "last_bucket_ms": "last bucket ms",
        "floor_ms": "floor ms",
        "floor_vs_sgd": "floor × SGD",
    }
    if "pred_vs_sgd" in g:
        columns.update({"pred_vs_sgd": "predicted × SGD", "pred_error_%": "predicted error %"})
    return g[list(columns)].rename(columns=columns)


def model_floors(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (model, setting, rate): the lowest floor of a K-FAC config, × SGD, and whose."""
    kfac = frame[~frame["first_order"]]
    if kfac.empty:
        return pd.DataFrame()
    best = kfac.loc[kfac.groupby(["model", "setting", "rate_bps"], sort=False)["floor_ms"].idxmin()]
    return best[["model", "label", "setting", "rate_bps", "strategy", "floor_ms", "floor_vs_sgd"]]


def _rates(values: pd.Series) -> str:
    """``2gbit`` or ``2gbit–3gbit (median 3gbit)``: the rates measured over jobs."""
    low, high = format_rate(values.min()), format_rate(values.max())
    if low == high:
        return low
    return f"{low}–{high} (median {format_rate(values.median())})"


def write_network(df: pd.DataFrame, out: Path) -> dict[str, Path]:
    """``results/network.*``: every config on the emulated network, against its floor."""
    frame = network_frame(df)
    md = ["# K-FAC on an emulated cluster network (P=2, one node and one core per rank)"]
    if not frame.empty:
        md += ["", "![measured and predicted iteration per config](network.png)", ""]
        md += [
            "Per step, medians over steps of the median run of 3 (ranges over the runs in",
            "brackets): `exposed comm` is the time the step waited for the wire (the step less",
            "its compute: pure forward/backward, K-FAC compute, other work and the optimizer);",
            "`hidden comm` is what its wire bytes need at the rate beyond that (transfers that",
            "ran under compute). `× floor`: the iteration over the config's floor, the longest",
            "of its compute; its wire time plus what no transfer overlaps (the forward pass,",
            f"{FORWARD_SHARE:.2g} of forward/backward, and the work after the last transfer); and",
            "forward/backward, then the last gradient bucket's transfer, then that work.",
            "`predicted ms`: the cost model on the job's link probe alone (base preset engines,",
            "links fitted to the probe; nothing fitted on these rows). Bandwidth per node is",
            "emulated both ways; latency is the host's (no netem here).",
        ]
        floors = model_floors(frame)
        for (label, setting, rate), g in frame.groupby(
            ["label", "setting", "rate_bps"], sort=False
        ):
            md += ["", f"## {label}, {setting} setting, {format_rate(rate)}", ""]
            digits = {h: 1 for h in ("exposed comm", "hidden comm", "K-FAC compute")}
            md.append(to_markdown(main_table(g), {**digits, "predicted ms": 0, "× floor": 2}))
            best = floors[
                (floors["label"] == label) & (floors["setting"] == setting)
                & (floors["rate_bps"] == rate)
            ]  # fmt: skip
            if not best.empty:
                b = best.iloc[0]
                md += ["", f"Floor of the model here: {b.floor_ms:.0f} ms ({b.strategy}), "
                       f"{b.floor_vs_sgd:.2f}× SGD."]  # fmt: skip
            md += ["", "<details><summary>Phases (ms) and floors</summary>", ""]
            detail = _detail_table(g)
            digits = {**dict.fromkeys(detail, 1), "floor × SGD": 2, "predicted × SGD": 2}
            md += [to_markdown(detail, digits), "", "</details>"]
        jobs = frame.drop_duplicates(["model", "setting", "rate_bps"])
        faithful = jobs["faithful_bps"].dropna()
        if not faithful.empty:
            md += [
                "",
                "## Faithful maximum of this host",
                "",
                "Every job times a 16 MiB all-reduce along a ladder of rates on its own",
                "network (`faithful_rate` in experiments/bench/link_probe.py): the highest rate",
                "at which it and every lower rung took at most 1.15× the wire time. Over the "
                f"{len(faithful)} jobs' probes: {_rates(faithful)}.",
            ]
    paths = {"csv": out / "network.csv"}
    frame.to_csv(paths["csv"], index=False)
    lines = with_takeaway([*md, *footer(df)], takeaways.network(frame))
    paths["md"] = write_page(out / "network.md", lines)
    if not frame.empty:
        paths["png"] = plots.save(plots.network_bars(frame), out / "network.png")
    return paths
