"""The ``network`` table: K-FAC on an emulated cluster network, against its floor.

``python -m experiments.bench -m table=network`` measures SGD (DDP) and every K-FAC
configuration interleaved at P=2 on an emulated network (:mod:`experiments.network`, one
node per rank, each link shaped to ``network.rate``), three runs per job. This module turns
the rows into ``results/network.{csv,md,png}``.

Per step, each row is split into what the rank computes and what it waits for:

* **compute** is the pure forward/backward (:func:`_pure_fwd_bwd`: SGD's own pass again
  without DDP's reductions, and the ``fwd_bwd`` of the job's K-FAC rows that reduce
  gradients after the backward pass, whose backward holds no transfer), plus the row's own
  K-FAC compute (factors, decompositions, preconditioning), other work in ``step()`` and the
  optimizer step;
* **exposed communication** is the rest of the measured step (the time it waited for the
  wire, whichever phase the wait fell in);
* **hidden communication** is what the row's wire bytes need at the link's rate beyond
  that: transfers that ran under compute.

The link's rate is what the job's link probe measured it to carry (the all-reduce link
:func:`experiments.bench.predict.probe_links` fits, per accounted wire byte): about 96% of the
shaped rate at 1 Gbit/s, the rest being TCP/IP headers, which the token bucket counts and no
collective can send payload in. Rows without probes take the shaped rate.

Its **floor** is what no schedule can beat on this link, the longest of: the compute; the
wire time plus what no transfer can overlap (the forward pass, taken as a third of
forward/backward, and the optimizer step and other work after the last transfer); and the
whole forward/backward, then the last gradient bucket's transfer (DDP's buckets: its
gradients are ready only when the backward pass ends), then that work after it. In that last
term, a config whose owners send the updates of layers that an earlier bucket completes pays
for them too: each owner either preconditions such a layer before its backward pass ends,
which lengthens it, or sends its update after, beside the last bucket on its link; the floor
takes the least either way costs (``early_update_ms``,
:func:`dpkfac.costmodel.timing.early_update_seconds`). Beside each row
is the cost model's prediction from the job's link probe alone
(:func:`experiments.bench.predict.probe_hardware`), held out from every measured step.
"""

from __future__ import annotations

import json
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
#: The step's parts the cost model is checked on, one after another along the step, and
#: the cost model's breakdown entries (:class:`dpkfac.costmodel.StepPrediction`) of each.
#: Measured: the pure forward/backward, the K-FAC compute of the busiest rank, ``step()``'s
#: other work and the optimizer, and the communication the step waited for (the rest; in
#: the configs that send during the pass, :func:`_sends_in_pass`, also their transfers'
#: stretch of it and their backward hooks' own work, which the pure forward/backward leaves
#: out: their packing is the breakdown's ``hooks``).
MODEL_PHASES = {
    "fwd_bwd": ("forward_backward",),
    "kfac_compute": KFAC_COMPUTE,
    "comm": (
        "ddp_grad_comm",
        "grad_comm",
        "factor_comm",
        "decomposition_comm",
        "precond_comm",
        "hooks",
    ),
    "other": ("step_other", "optimizer"),
}
#: The frame's measured column of each.
MEASURED = {
    "fwd_bwd": "pure_fwd_bwd_ms",
    "kfac_compute": "kfac_compute_ms",
    "comm": "exposed_comm_ms",
    "other": "after_ms",
}
#: Their names on the page.
MODEL_PHASE_NAMES = takeaways.NETWORK_PARTS


def _sends_in_pass(row: dict[str, Any]) -> bool:
    """Whether a K-FAC row launches collectives from its hooks, so that their transfers run
    during its forward/backward pass: it reduces gradients from its backward hooks (the
    overlapped modes, or ``overlap="auto"``, which may choose them) or all-reduces its
    factors from the capture hooks (``factor_comm="pipelined"``: spd_kfac). On a rank's one
    core a transfer beside the pass stretches it (over the committed network rows,
    spd_kfac's paper-setting pass took 94 ms on BERT-base at 1 Gbit/s against its job's
    plain 49), so the row's ``fwd_bwd`` holds communication."""
    from dpkfac.plan import scheme_of, scheme_options
    from experiments.bench.predict import row_strategy

    name, own = row_strategy(row)
    if name is None:
        return False
    scheme, options = scheme_of(name), scheme_options(name, own)
    return scheme.may_overlap(options) or scheme.traits(options).factor_comm == "pipelined"


def _ms(row: dict[str, Any], key: str) -> float:
    """A row's ``<key>_s`` in milliseconds (0 where it has none)."""
    value = row.get(f"{key}_s")
    return 0.0 if value is None or value != value else 1e3 * float(value)


def _text(value: Any) -> str:
    """A row's text field ('' where it has none: a NaN read back from CSV)."""
    return "" if value is None or value != value else str(value)


def _wire_bytes(row: dict[str, Any]) -> float:
    """Bytes one rank put on the wire per step, every collective category (gradients too)."""
    values = (row.get(f"wire_{c}") for c in COMM_CATEGORIES)
    return sum(float(v) for v in values if v is not None and v == v)


def _pure_fwd_bwd(row: dict[str, Any], job: list[dict[str, Any]]) -> float:
    """Milliseconds of ``row``'s forward/backward without any transfer in it.

    A K-FAC row that sends nothing during its pass has nothing else in its ``fwd_bwd`` (its
    factor hooks are timed apart): its own. A row that does (:func:`_sends_in_pass`) holds
    those transfers, so it takes the median of the other K-FAC rows of its job. SGD's holds
    DDP's exposed waits: it takes its own forward/backward run again without DDP's
    reductions, in turn with the steps (``fwd_bwd_local_s``,
    :meth:`experiments.bench.measure._Stepper.step`).
    Rows measured before that pass existed take the lesser of their own and that median,
    which holds the K-FAC hooks' capture work where they capture every step (the paper
    setting) and so reads SGD's exposed wait short.
    """
    local = _ms(row, "fwd_bwd_local")
    if first_order(row) and local > 0:
        return local
    plain = [_ms(r, "fwd_bwd") for r in job if not first_order(r) and not _sends_in_pass(r)]
    median = float(pd.Series(plain).median()) if plain else math.inf
    if first_order(row):
        return min(_ms(row, "fwd_bwd"), median)
    return _ms(row, "fwd_bwd") if not _sends_in_pass(row) else median


def _model_terms(rows: list[dict[str, Any]], rate: float, predict: bool) -> list[dict[str, float]]:
    """Per row, what its model's shapes say: the last gradient bucket's bytes; what the link
    carries (``link_bps``: what the job's link probe measured, else the shaped ``rate``); the
    least time the updates of the layers completed before that bucket add after it
    (``early_update_ms``, :func:`dpkfac.costmodel.timing.early_update_seconds`: the config's
    placement as the cost model makes it, each layer's preconditioning priced by the job's
    probed engines); and the cost model's iteration and :data:`MODEL_PHASES` (ms,
    ``pred_<phase>_ms``) from the job's own probes alone (``predict``; its forward/backward
    priced by the job's hook-free pass in the steps' rotation where it has one,
    :func:`experiments.bench.predict.rotation_forward_backward`), weighted over the step
    kinds like the row."""
    from dpkfac.costmodel import fitting
    from dpkfac.costmodel.timing import early_update_seconds
    from dpkfac.costmodel.traffic import ddp_bucket_params
    from dpkfac.plan.fusion import DDP_DEFAULT_CAP_BYTES
    from experiments.bench import predict as predict_lib

    out = []
    in_rotation = predict_lib.rotation_forward_backward(rows)
    for r, (shapes, sharing) in zip(rows, predict_lib.shapes_per_row(rows), strict=True):
        last = ddp_bucket_params(shapes, itemsize=4, cap_bytes=DDP_DEFAULT_CAP_BYTES)[-1]
        link = predict_lib.probe_links(r).get("allreduce")
        carried = 8 / link.beta if link is not None and link.beta > 0 else rate
        terms = {
            "last_bucket_bytes": float(4 * sum(n for _, n in last)),
            "link_bps": carried,
            "early_update_ms": 0.0,
        }
        if first_order(r) and not predict:
            out.append(terms)
            continue
        m = predict_lib.as_ran(r, predict_lib.measurement(r, shapes=shapes, weight_sharing=sharing))
        hw = predict_lib.probe_hardware(r, in_rotation_s=in_rotation)
        pred = fitting.predict_measurement(m, hw)
        if pred.plan is not None:
            early = early_update_seconds(
                shapes,
                pred.plan,
                {i for i, _ in last if i >= 0},
                hw,
                seconds_per_byte=8 / carried,
                compute_method=m.kfac.compute_method,
                itemsize=m.param_itemsize,
                kl_clip=m.kfac.kl_clip is not None,
            )
            terms["early_update_ms"] = 1e3 * early
        if predict:
            amortised = predict_lib.amortised_prediction(r, pred)["iteration_s"]
            terms["pred_iteration_ms"] = 1e3 * amortised
            for phase in MODEL_PHASES:
                terms[f"pred_{phase}_ms"] = 0.0
            for kind, weight in predict_lib.step_weights(r).items():
                step = pred.steps[predict_lib.STEP_OF_KIND[kind]]
                for phase, parts in MODEL_PHASES.items():
                    seconds = sum(step.breakdown.get(part, 0.0) for part in parts)
                    terms[f"pred_{phase}_ms"] += 1e3 * weight * seconds
        out.append(terms)
    return out


def _job_entries(
    job: list[dict[str, Any]], rate: float, terms: list[dict[str, float]]
) -> list[dict[str, Any]]:
    """The frame's entries of one job (one run of one model, setting and rate)."""
    p = int(job[0]["world_size"])
    out = []
    for r, model in zip(job, terms, strict=True):
        carried = model["link_bps"]
        pure = _pure_fwd_bwd(r, job)
        kfac = sum(_ms(r, k) for k in KFAC_COMPUTE)
        after = _ms(r, "optimizer") + _ms(r, "step_other")
        compute = pure + kfac + after
        iteration = _ms(r, "iteration")
        wire_ms = 1e3 * _wire_bytes(r) * 8 / carried
        exposed = max(iteration - compute, 0.0)
        # The last bucket's gradients are ready when the backward pass ends; the updates of
        # the layers completed before it delay that end or follow on the link.
        last_ms = 1e3 * wire_bytes("allreduce", int(model["last_bucket_bytes"]), p) * 8 / carried
        early = model["early_update_ms"]
        floor = max(compute, FORWARD_SHARE * pure + wire_ms + after, pure + early + last_ms + after)
        out.append(
            {
                "model": r["model"],
                "label": r["label"],
                "setting": r["setting"],
                "world_size": int(r["world_size"]),
                "rate_bps": rate,
                "link_bps": carried,
                "strategy": r["strategy"],
                # What the config ran as: its scheme and what it chose ("auto" resolved).
                "scheme": (json_value(r.get("kfac_options")) or {}).get("strategy", ""),
                "configuration": _text(r.get("configuration")),
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
                "early_update_ms": early,
                "floor_ms": floor,
                "vs_floor": iteration / floor if floor > 0 else math.nan,
                **{f"{phase}_ms": _ms(r, phase) for phase in PHASES},
                "faithful_bps": float(r.get("network_faithful_bps") or math.nan),
                **{k: v for k, v in model.items() if k.startswith("pred_")},
            }
        )
    return out


def _runs_by_configuration(runs: pd.DataFrame) -> pd.DataFrame:
    """Per job and strategy, what each run resolved to: ``runs_by_configuration`` (JSON, so that
    the page's CSV carries it) maps each configuration (what "auto" chose; "" for a fixed
    config) to its runs' count and fastest iteration (ms). A chooser is not a configuration:
    its runs are compared with the configurations they ran."""
    configs = runs["configuration"].map(_text) if "configuration" in runs else ""
    timed = runs.assign(ms=1e3 * runs["iteration_s"], configuration=configs)
    out = []
    for key, g in timed.groupby([*JOB, "strategy"]):
        by = g.groupby("configuration")["ms"].agg(["count", "min"])
        entry = dict(zip([*JOB, "strategy"], key, strict=True))
        entry["runs_by_configuration"] = json.dumps(
            {str(c): [int(n), float(m)] for c, (n, m) in by.iterrows()}, sort_keys=True
        )
        out.append(entry)
    frame = pd.DataFrame(out, columns=[*JOB, "strategy", "runs_by_configuration"])
    frame["world_size"] = frame["world_size"].astype(int)
    return frame


def _run_ratios(runs: pd.DataFrame, rate: float) -> pd.DataFrame:
    """Per job and strategy config, its ratios taken within each run, over the runs:
    ``vs_sgd`` and ``vs_floor`` (the medians) and ``vs_floor_min``/``vs_floor_max``.

    The median job is ranked by every config's time together, so one config's row in it
    can be that config's slowest run (it was, once, for BERT-base's overlapped owner mode:
    its runs 304, 314 and 326 ms, the median job holding the 326). A statement about one
    configuration (its time over SGD's, over its floor) reads that configuration's own
    median run: the median of its ratios, each taken within its run against the same run's
    SGD and floor.
    """
    from experiments.bench.tables import over_sgd

    entries = []
    for seed, run in runs.groupby("seed", sort=False, dropna=False):
        for _, job in run.groupby(JOB, sort=False):
            rows = job.to_dict("records")
            found = _job_entries(rows, rate, _model_terms(rows, rate, predict=False))
            entries += [{**e, "run": seed} for e in found]
    each = pd.DataFrame(entries)
    if each.empty:
        return pd.DataFrame(columns=[*JOB, "strategy", "vs_sgd", "vs_floor"])
    each["vs_sgd"] = over_sgd(each, [*JOB, "run"], "iteration_ms")
    ratios = each.groupby([*JOB, "strategy"], sort=False).agg(
        vs_sgd=("vs_sgd", "median"),
        vs_floor=("vs_floor", "median"),
        vs_floor_min=("vs_floor", "min"),
        vs_floor_max=("vs_floor", "max"),
    )
    return ratios.reset_index()


def network_frame(df: pd.DataFrame, *, predict: bool = True) -> pd.DataFrame:
    """One row per (model, setting, rate, strategy config): the median run, split and floored.

    Of the runs of each job (model, setting, P, rate) the median one is kept whole
    (:func:`experiments.bench.pages.ok_rows`); ``iteration_min_ms``/``iteration_max_ms`` and
    ``vs_sgd_min``/``vs_sgd_max`` are the ranges over every run, each ratio taken within its
    run; ``vs_sgd`` and ``vs_floor`` (with ``vs_floor_min``/``vs_floor_max``) are the
    config's own median run's (:func:`_run_ratios`). ``floor_vs_sgd`` is the row's floor over
    SGD's measured iteration, and
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
            entries += _job_entries(rows, float(rate), _model_terms(rows, float(rate), predict))
        frame = pd.DataFrame(entries)
        ranges = runs.assign(ms=1e3 * runs["iteration_s"]).groupby([*JOB, "strategy"])["ms"]
        bounds = ranges.agg(iteration_min_ms="min", iteration_max_ms="max").reset_index()
        bounds["world_size"] = bounds["world_size"].astype(int)
        frame = frame.merge(bounds, on=[*JOB, "strategy"], how="left")
        frame = frame.merge(_runs_by_configuration(runs), on=[*JOB, "strategy"], how="left")
        ratios = _run_ratios(runs, float(rate)).rename(columns={"vs_sgd": "vs_sgd_runs"})
        frame = frame.drop(columns="vs_floor").merge(ratios, on=[*JOB, "strategy"], how="left")
        parts.append(with_spread(frame, vs_sgd_spread(runs), "world_size"))
    if not parts:
        return pd.DataFrame()
    frame = pd.concat(parts, ignore_index=True)
    group = ["model", "setting", "rate_bps"]
    # The floor against the median job's SGD; the ratios each config's own median run's.
    frame["floor_vs_sgd"] = (
        frame["floor_ms"] / frame["iteration_ms"] * over_sgd(frame, group, "iteration_ms")
    )
    frame["vs_sgd"] = frame.pop("vs_sgd_runs")
    if "pred_iteration_ms" in frame:
        frame["pred_vs_sgd"] = over_sgd(frame, group, "pred_iteration_ms")
        frame["pred_error_%"] = 100 * (frame["pred_iteration_ms"] / frame["iteration_ms"] - 1)
        spread = frame["iteration_max_ms"] - frame["iteration_min_ms"]
        for phase in MODEL_PHASES:
            measured = frame[MEASURED[phase]].where(frame[MEASURED[phase]] > 0)
            frame[f"pred_{phase}_error_%"] = 100 * (frame[f"pred_{phase}_ms"] / measured - 1)
            frame[f"{phase}_resolved"] = measured >= spread
    return plots.in_order(frame, ["model", "setting", "rate_bps", "strategy"])


def model_errors(frame: pd.DataFrame) -> pd.DataFrame:
    """The cost model's held-out error per step and per :data:`MODEL_PHASES` part: the mean,
    median and largest absolute error (%) over the rows where the part was measured (K-FAC
    compute has none in SGD's rows), and how many rows that is.

    A part smaller than its row's spread over runs (the slowest run's iteration less the
    fastest's) is measured as no more than noise: communication is the step less its
    compute, and 0.1 ms of it predicted as 3 ms is a 3000% error of nothing. So beside the
    mean over every row, ``resolved rows`` and ``mean abs. error % (resolved)`` count only
    the rows where the part is at least that spread, and ``unresolved abs. error ms`` is
    the others' mean absolute error in milliseconds.
    """
    if frame.empty or "pred_error_%" not in frame:
        return pd.DataFrame()
    parts = {"step": ("step", "pred_error_%")}
    parts.update({p: (MODEL_PHASE_NAMES[p], f"pred_{p}_error_%") for p in MODEL_PHASES})
    out = []
    for phase, (name, column) in parts.items():
        errors = frame[column].abs().dropna()
        if errors.empty:
            continue
        entry = {
            "part": name,
            "rows": len(errors),
            "mean abs. error %": errors.mean(),
            "median abs. error %": errors.median(),
            "max abs. error %": errors.max(),
            "mean error %": frame[column].dropna().mean(),
        }
        if f"{phase}_resolved" in frame:
            kept = takeaways.resolved_errors(frame, column, phase)
            dropped = frame.loc[errors.index.difference(kept.index)]
            miss = (dropped[f"pred_{phase}_ms"] - dropped[MEASURED[phase]]).abs()
            entry.update(
                {
                    "resolved rows": len(kept),
                    "mean abs. error % (resolved)": kept.mean() if len(kept) else math.nan,
                    "unresolved abs. error ms": miss.mean() if len(miss) else math.nan,
                }
            )
        out.append(entry)
    return pd.DataFrame(out)


def model_errors_by_setting(frame: pd.DataFrame) -> pd.DataFrame:
    """:func:`model_errors`' mean absolute error (%) per part, one column per setting: the
    settings weigh the parts differently (the paper setting decomposes every step)."""
    columns = {}
    for setting, g in frame.groupby("setting", sort=False):
        errors = model_errors(g)
        if not errors.empty:
            columns[str(setting)] = errors.set_index("part")["mean abs. error %"]
    if not columns:
        return pd.DataFrame()
    return pd.DataFrame(columns).rename_axis("part").reset_index()


def _phase_table(g: pd.DataFrame) -> pd.DataFrame:
    """Measured and predicted milliseconds of each :data:`MODEL_PHASES` part, per config."""
    show = pd.DataFrame({"strategy": g["strategy"].to_numpy()})
    for phase, name in MODEL_PHASE_NAMES.items():
        show[name] = [
            f"{m:.1f} / {p:.1f}"
            for m, p in zip(g[MEASURED[phase]], g[f"pred_{phase}_ms"], strict=True)
        ]
    show["step"] = [
        f"{m:.0f} / {p:.0f} ({e:+.0f}%)"
        for m, p, e in zip(
            g["iteration_ms"], g["pred_iteration_ms"], g["pred_error_%"], strict=True
        )
    ]
    return show


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
    show["vs floor"] = [
        ratio_text(r.vs_floor, r.vs_floor_min, r.vs_floor_max, int(r.runs)) for r in g.itertuples()
    ]
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
        "early_update_ms": "early updates ms",
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


def _has_probes(value: Any, kind: str | None = None) -> bool:
    """Whether a row's ``compute_probes`` cell holds any probe (of ``kind``, if given)."""
    probes = json_value(value) if isinstance(value, str) and value else value
    if not isinstance(probes, list):
        return False
    return any(kind is None or p.get("kind") == kind for p in probes)


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
            "brackets); `× SGD` and `× floor` are each config's median over its runs of the",
            "ratio taken within the run (the median run is ranked by every config's time",
            "together, so one config's row in it can be that config's slowest run).",
            "`exposed comm` is the time the step waited for the wire (the step less",
            "its compute: pure forward/backward, K-FAC compute, other work and the optimizer);",
            "`hidden comm` is what its wire bytes need at the link's rate beyond that (transfers",
            "that ran under compute; the link's rate is what the job's link probe measured it to",
            "carry, about 96% of the shaped rate, the rest being TCP/IP headers). `× floor`:",
            "the iteration over the config's floor, the longest of its compute; its wire time",
            "plus what no transfer overlaps (the forward pass, "
            f"{FORWARD_SHARE:.2g} of forward/backward,",
            "and the work after the last transfer); and forward/backward, then the last gradient",
            "bucket's transfer, then that work, with the least that the updates an owner sends of",
            "layers an earlier bucket completes add there (`early updates ms`: preconditioned",
            "before the backward pass ends, they lengthen it; after, they follow on the link).",
            "`predicted ms`: the cost model on the job's own probes alone (links fitted to its",
            "link probe, engines to its compute probe where it has one, forward/backward to",
            "the hook-free pass timed in turn with the steps; nothing fitted on these rows: see",
            "the end of the page). Bandwidth per node is emulated both ways; latency is the",
            "host's (no netem here).",
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
            if "pred_iteration_ms" in g:
                md += ["", "<details><summary>The cost model per part of the step: measured / "
                       "predicted ms</summary>", "", to_markdown(_phase_table(g), {}), "",
                       "</details>"]  # fmt: skip
        errors = model_errors(frame)
        if not errors.empty:
            md += [
                "",
                "## The cost model, held out",
                "",
                "Each row's step predicted from its job's own probes alone: the link probes'",
                "links (gloo's other kinds derived from the all-reduce on the emulated link),",
                "and engines scaled to the job's compute probes where its rows have them (else",
                "the base preset's), the forward/backward to the job's hook-free pass timed in",
                "turn with the steps (SGD's under `no_sync`: the probe timed before the steps",
                "read a median 12% below the steps' own pass). Nothing is fitted on these rows.",
                "Per part of the step, as the detail tables split it: forward/backward (the pure",
                "one; of a config that sends during its pass, the overlapped modes and",
                "spd_kfac's pipelined factors, its job's plain one), K-FAC compute (busiest",
                "rank), other work in `step()` and the optimizer, and communication (the rest of",
                "the step: what it waited for, the transfers' stretch of the pass, and the",
                "overlapped modes' work in their backward hooks). Errors over the rows;",
                "`(resolved)`: over the rows where",
                "the part is at least the row's spread over its runs (below that it is noise:",
                "communication is the step less its compute), the others' error in ms beside:",
                "",
                to_markdown(errors, {**dict.fromkeys(errors.columns[2:], 1), "resolved rows": 0}),
            ]
            by_setting = model_errors_by_setting(frame)
            if len(by_setting.columns) > 2:  # more than one setting
                md += [
                    "",
                    "Mean absolute error (%) per setting:",
                    "",
                    to_markdown(by_setting, dict.fromkeys(by_setting.columns[1:], 1)),
                ]
            if "compute_probes" not in df or not df["compute_probes"].map(_has_probes).any():
                md += [
                    "",
                    "These rows predate the compute probes (`compute_probes`): their engines are",
                    "the base preset's, timed alone on an idle machine; re-measure the table for",
                    "engines of this host in the job.",
                ]
            elif not df["compute_probes"].map(lambda v: _has_probes(v, "eigh")).any():
                md += [
                    "",
                    "These rows predate the eigh probe: decompositions are priced at the base",
                    "preset's eigh rate, fitted on another machine's LAPACK, which prices this",
                    "host's eigh at up to 2.7× its time (769 wide). The paper setting, which",
                    "decomposes every step, carries that error: its K-FAC compute is",
                    "overpredicted about twice over. Re-measure the table to price",
                    "decompositions from the job's own probe.",
                ]
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
