"""Benchmark rows meet the cost model (:mod:`dpkfac.costmodel`).

:func:`measurement` turns a row of ``python -m experiments.bench`` into a
:class:`dpkfac.costmodel.Measurement`; fitting and predicting measurements are
the cost model's own (:mod:`dpkfac.costmodel.fitting`). On top of that:
:func:`predict_row` replays a measured job (for a pipelined strategy with the
fusion plan the run fixed) and :func:`byte_mismatches` checks every category's
bytes, calls and wire bytes against it; :func:`amortised_prediction`,
:func:`paper_predictions` and :func:`row_process_memory` report predictions as a
row reports its measurement (the ablation and second_order_update tables);
:func:`scaling_frames` puts measured rows beside predictions at P = 1..256 on
the model calibrated to the rows and on the ``v100_ib100`` preset with the
paper's shapes, with measured-vs-predicted error per phase, in sample and held out.

Whether a row is K-FAC is read from its ``kfac_options`` (JSON ``null``:
first order), never from its strategy label; the strategy of a K-FAC row is
``kfac_options["strategy"]`` and the rest of ``kfac_options`` splits into the
preconditioner's common options and the strategy's own.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import pandas as pd

from dpkfac.costmodel import (
    PRESETS,
    Engine,
    Hardware,
    Measurement,
    ModelShapes,
    Prediction,
    StepPrediction,
)
from dpkfac.costmodel import fitting as fitting_lib
from dpkfac.costmodel.memory import activation_bytes, process_memory_of
from dpkfac.costmodel.timing import COMM_PHASES, COMPUTE_PHASES
from dpkfac.options import KFACOptions
from dpkfac.plan import scheme_of
from dpkfac.plan.hardware import COLLECTIVE_KINDS, Link, Sample, gloo_link
from dpkfac.stats import COMM_CATEGORIES
from dpkfac.strategies import canonical_name, strategy_options
from experiments.bench.aggregate import SECOND_ORDER_CATEGORIES, SECOND_ORDER_COMM, kind_weights
from experiments.bench.measure import OPTIMIZER
from experiments.bench.workloads import json_value, row_model
from experiments.preconditioning import split_options

PREDICTED_P = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: The ``phase`` of the error rows that compare a whole step (measured less its barriers).
ITERATION = "iteration"
CATEGORIES = COMM_CATEGORIES
#: Kinds of measured steps -> the (factor update?, decomposition?) step the cost model prices.
STEP_OF_KIND = {"decomp": (True, True), "factor": (True, False), "plain": (False, False)}
#: Rows of the scaling table predicted with the paper's shapes on this preset.
PAPER_PRESET = "v100_ib100"
#: The base of calibration: kinds the measurements do not cover come from here.
BASE_PRESET = "cpu_gloo_local"


def row_shapes(row: Mapping[str, Any], *, paper: bool = False) -> tuple[ModelShapes, str]:
    """K-FAC shapes of a row's model (or of its paper-sized version) and its weight sharing.

    The model is built on the ``meta`` device when that works (no memory,
    no compute: BERT-large at full size costs nothing), else on the CPU.
    """
    import torch

    from dpkfac.costmodel import shapes_from_model

    def on(device: str) -> tuple[ModelShapes, str]:
        with torch.device(device):
            bench = row_model(row, paper=paper)
            shapes = shapes_from_model(
                bench.model, bench.example_input, bench.batch_size, skip_layers=bench.skip_layers
            )
        return shapes, bench.weight_sharing

    try:
        return on("meta")
    except (NotImplementedError, RuntimeError, TypeError, ValueError):
        # Meta tensors hold no data: a builder that computes on real values
        # while constructing fails there, and is built on the CPU instead
        # (the bundled builders all build on meta).
        return on("cpu")


def _kfac_split(
    row: Mapping[str, Any], weight_sharing: str | None
) -> tuple[str | None, KFACOptions, dict[str, Any]]:
    """Strategy name, common options and strategy options of a row (None: first order).

    ``kfac_options`` holds the strategy's name under ``strategy``, then
    :class:`~dpkfac.options.KFACOptions` fields and the strategy's own
    options (Hydra's private keys, such as ``_target_``, are not options).
    Common options the row does not record come from its columns
    (``compute_method``, ``factor_update_steps``, ``inv_update_steps``) or the defaults;
    ``weight_sharing``, when given, is the model's and wins.
    """
    raw = json_value(row.get("kfac_options"))
    if raw is None:
        name, common, values = None, {}, {}
    elif "strategy" not in raw:
        raise ValueError(f"kfac_options {raw!r} of a K-FAC row name no strategy")
    else:
        given, common, values = split_options(raw)
        name = canonical_name(given)
    common.setdefault("compute_method", row.get("compute_method", "eigen"))
    common.setdefault("factor_update_steps", int(row.get("factor_update_steps", 1)))
    common.setdefault("inv_update_steps", int(row.get("inv_update_steps", 1)))
    if weight_sharing:
        common["weight_sharing"] = weight_sharing
    return name, KFACOptions(**common), values


def _least_wait(row: Mapping[str, Any]) -> dict[str, float] | None:
    least = json_value(row.get("least_wait"))
    return least if isinstance(least, dict) and least else None


def _cores(row: Mapping[str, Any]) -> int | None:
    """CPU cores the row's ranks shared (None: a device per rank)."""
    if not str(row.get("device", "cpu")).startswith("cpu"):
        return None
    return int(row.get("cpus") or os.cpu_count() or 1)


def measurement(
    row: Mapping[str, Any],
    *,
    shapes: ModelShapes | None = None,
    weight_sharing: str | None = None,
) -> Measurement:
    """The cost model's record of a row (``shapes``: of the row's model unless given)."""
    if shapes is None:
        shapes, model_sharing = row_shapes(row)
        weight_sharing = weight_sharing or model_sharing
    name, kfac, own = _kfac_split(row, weight_sharing)
    plan = json_value(row.get("fusion_plan"))
    # The hardware model the run measured at start-up (spd_kfac's placement).
    measured = row.get("measured_hardware")
    measured = measured if isinstance(measured, str) and measured.strip() else None
    return Measurement(
        model=str(row.get("model", "")),
        shapes=shapes,
        strategy=name,
        world_size=int(row["world_size"]),
        kfac=kfac,
        options=strategy_options(name, own) if name is not None else None,
        timings=tuple(json_value(row.get("rank_timings")) or ()),
        least_wait=_least_wait(row),
        forward_backward=float(row.get("fwd_bwd_s") or 0.0),
        cores=_cores(row),
        fusion_plan=tuple(tuple((k[0], k[1]) for k in bucket) for bucket in plan) if plan else None,
        measured_hardware=Hardware.from_json(measured) if measured else None,
        optimizer=OPTIMIZER,
        optimizer_seconds=float(row.get("optimizer_s") or 0.0),
    )


def as_ran(row: Mapping[str, Any], m: Measurement) -> Measurement:
    """``m`` with its strategy's options as its run resolved them, to price the row at its
    own world size: where "auto" chose, the candidate its ``configuration`` names (the
    scheme's own description of it), not what the cost model would choose today (a
    chooser's rows stay comparable across changes to it). At another world size a run
    would choose again: there ``m`` itself is priced."""
    ran = row.get("configuration")
    if m.strategy is None or m.options is None or not isinstance(ran, str):
        return m
    scheme = scheme_of(m.strategy)
    if scheme.resolved(m.options):
        return m
    for candidate in scheme.candidates(m.options, m.world_size):
        if scheme.describe(candidate) == ran:
            return replace(m, options=candidate)
    return m


def shapes_per_row(
    rows: Iterable[Mapping[str, Any]], *, paper: bool = False
) -> Iterator[tuple[ModelShapes, str]]:
    """Each row's :func:`row_shapes`, built once per model (``paper``: at its paper size)."""
    built: dict[str, tuple[ModelShapes, str]] = {}
    for r in rows:
        if str(r["model"]) not in built:
            built[str(r["model"])] = row_shapes(r, paper=paper)
        yield built[str(r["model"])]


def _measurements(rows: list[Mapping[str, Any]], *, paper: bool = False) -> list[Measurement]:
    """Each row's :func:`measurement` (:func:`shapes_per_row`)."""
    pairs = zip(rows, shapes_per_row(rows, paper=paper), strict=True)
    return [measurement(r, shapes=s, weight_sharing=w) for r, (s, w) in pairs]


def predict_row(
    row: Mapping[str, Any], hardware: Hardware, *, world_size: int | None = None
) -> Prediction:
    """The cost model's prediction of a row's job (optionally at another P)."""
    return fitting_lib.predict_measurement(measurement(row), hardware, world_size=world_size)


def predicted_counts(row: Mapping[str, Any], prediction: Prediction) -> dict[str, dict[str, float]]:
    """Bytes, calls and wire bytes per category per step, weighted like the row.

    The paper setting is the update step itself; the practical setting
    weights the decomposition, factor-only and plain steps exactly as
    :func:`experiments.bench.aggregate.kind_weights` does.
    """
    out: dict[str, dict[str, float]] = {}
    for kind, weight in step_weights(row).items():
        for cat, counts in prediction.steps[STEP_OF_KIND[kind]].comm.items():
            entry = out.setdefault(cat, {"bytes": 0.0, "calls": 0.0, "wire_bytes": 0.0})
            for key in entry:
                entry[key] += weight * counts[key]
    return out


def step_weights(row: Mapping[str, Any]) -> dict[str, float]:
    """How often each step kind occurs at the row's update intervals."""
    return kind_weights(int(row.get("factor_update_steps", 1)), int(row.get("inv_update_steps", 1)))


def amortised_prediction(row: Mapping[str, Any], prediction: Prediction) -> dict[str, float]:
    """The prediction as a row reports its measurement: per step, weighted like the row
    (:func:`predicted_counts`), beside the row's own ``iteration_s``, ``compute_s``,
    ``comm_s``, ``grad_comm_s``, ``bytes_second_order`` and ``mem_kfac``.

    Returns:
        ``iteration_s`` (critical path), ``compute_s`` (factor compute,
        decomposition and preconditioning of the busiest rank), ``comm_s``
        (factor, decomposition and preconditioned-gradient communication
        phases), ``grad_comm_s``, ``bytes_second_order`` (bytes of those
        collectives per rank), ``wire_bytes`` (every category's wire bytes
        per rank, gradients included) and ``memory_bytes`` (K-FAC state of
        the busiest rank).
    """
    out = dict.fromkeys(("iteration_s", "compute_s", "comm_s", "grad_comm_s"), 0.0)
    for kind, weight in step_weights(row).items():
        step = prediction.steps[STEP_OF_KIND[kind]]
        phases = step.phases
        out["iteration_s"] += weight * step.iteration
        out["compute_s"] += weight * step.computation
        out["comm_s"] += weight * sum(phases.get(p, 0.0) for p in SECOND_ORDER_COMM)
        out["grad_comm_s"] += weight * phases.get("grad_comm", 0.0)
    counts = predicted_counts(row, prediction)
    zero = {"bytes": 0.0, "wire_bytes": 0.0}
    out["bytes_second_order"] = sum(counts.get(c, zero)["bytes"] for c in SECOND_ORDER_CATEGORIES)
    out["wire_bytes"] = sum(counts.get(c, zero)["wire_bytes"] for c in CATEGORIES)
    out["memory_bytes"] = float(prediction.memory_max)
    return out


def process_memory_prediction(
    prediction: Prediction, shapes: ModelShapes, *, param_itemsize: int = 4
) -> dict[str, float]:
    """The busiest rank's whole-process memory as the cost model predicts it for a row's job
    (optimizer state for :data:`experiments.bench.measure.OPTIMIZER`, the benchmark's only one).

    Returns:
        ``process_state_bytes``: the tally :func:`dpkfac.process_memory`
        reports (parameters, gradients, optimizer state, module buffers,
        K-FAC state; exact); ``activation_bytes``: the activation estimate
        (:func:`dpkfac.costmodel.memory.activation_bytes`, a lower bound);
        ``process_bytes``: their sum, the whole process; and the parts
        ``model_state_bytes`` (all but K-FAC and activations) and
        ``kfac_bytes``.
    """
    state = process_memory_of(
        prediction, shapes, optimizer=OPTIMIZER, param_itemsize=param_itemsize
    )
    activations = activation_bytes(shapes, param_itemsize)
    return {
        "process_state_bytes": float(state.total),
        "activation_bytes": float(activations),
        "process_bytes": float(state.total + activations),
        "model_state_bytes": float(state.model),
        "kfac_bytes": float(state.kfac),
    }


def row_process_memory(
    row: Mapping[str, Any], shapes: ModelShapes, weight_sharing: str
) -> dict[str, float]:
    """:func:`process_memory_prediction` of a row's own job (its shapes, P and options)."""
    m = measurement(row, shapes=shapes, weight_sharing=weight_sharing)
    pred = fitting_lib.predict_measurement(m, PRESETS[BASE_PRESET])
    return process_memory_prediction(pred, shapes, param_itemsize=m.param_itemsize)


def paper_predictions(
    rows: Iterable[Mapping[str, Any]], world_size: int, preset: str = PAPER_PRESET
) -> list[dict[str, Any]]:
    """:func:`amortised_prediction` of every row at ``world_size`` ranks with its paper-size model.

    Each row keeps its strategy, options and update intervals; the shapes are its
    model's at the papers' sizes (``workload.paper``) and the hardware is ``preset``
    (the papers' V100/InfiniBand cluster). Spd_kfac's fusion plan is made from the
    modelled ready times there, not replayed. Each entry also says what the strategy
    chose (``configuration``: grouped's k and f; "": nothing), holds
    :func:`process_memory_prediction`'s keys, the model's K-FAC ``layers`` and the
    ``prediction`` itself, so that a table needing per-rank detail (the ``paper``
    table) prices its rows here rather than repeating the steps.
    """
    rows = list(rows)
    out = []
    for r, m in zip(rows, _measurements(rows, paper=True), strict=True):
        pred = fitting_lib.predict_measurement(m, PRESETS[preset], world_size=world_size)
        chosen = scheme_of(pred.strategy).describe(pred.options) if pred.strategy else ""
        process = process_memory_prediction(pred, m.shapes, param_itemsize=m.param_itemsize)
        out.append({**amortised_prediction(r, pred), "configuration": chosen, **process})
        out[-1].update(layers=len(m.shapes), prediction=pred)
    return out


def row_strategy(row: Mapping[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """The library strategy a row ran (None: first order) and that strategy's own options."""
    name, _, own = _kfac_split(row, None)
    return name, own


def byte_mismatches(row: Mapping[str, Any], prediction: Prediction) -> list[str]:
    """Categories whose measured bytes, calls or wire bytes differ from the prediction."""
    predicted = predicted_counts(row, prediction)
    out = []
    for cat in CATEGORIES:
        for key, col in (("bytes", "bytes"), ("calls", "calls"), ("wire_bytes", "wire")):
            want, got = predicted[cat][key], float(row[f"{col}_{cat}"])
            if abs(want - got) > 1e-9 * max(1.0, abs(want)):
                out.append(f"{cat}.{key}: measured {got:g}, predicted {want:g}")
    return out


def measured_phases(row: Mapping[str, Any]) -> dict[str, float]:
    """Seconds per phase as the cost model defines them (busiest rank / least wait)."""
    return fitting_lib.phases_from_timings(json_value(row["rank_timings"]), _least_wait(row))


def _prediction_row(
    model: str, strategy: str, source: str, p: int, pred: Prediction
) -> dict[str, Any]:
    step = pred.update
    phases = step.phases
    entry = {"model": model, "strategy": strategy, "source": source, "world_size": p}
    entry["iteration_ms"] = 1e3 * step.iteration
    entry["fwd_bwd_ms"] = 1e3 * step.breakdown.get("forward_backward", 0.0)
    for phase in (*COMPUTE_PHASES, *COMM_PHASES):
        entry[f"{phase}_ms"] = 1e3 * phases.get(phase, 0.0)
    entry["bytes_per_rank"] = sum(c.nbytes for c in step.collectives)
    entry["wire_bytes_per_rank"] = sum(c.wire_bytes for c in step.collectives)
    entry["memory_MiB"] = pred.memory_max / 2**20
    return entry


def scaling_frames(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """Measured and predicted rows against P, the per-phase error table and notes.

    Returns:
        ``frame``: one row per (model, strategy, source, P) with iteration
        and phase milliseconds; ``errors``: measured vs predicted per phase
        for every measured row at P > 1, in-sample (calibrated on all rows)
        and held out (calibrated without the rows of that P); ``notes``:
        markdown lines describing the sources.
    """
    if df.empty:
        return pd.DataFrame(), pd.DataFrame(), ["No measured rows."]
    # The paper setting (factors and decompositions every step): the rows fitted.
    rows = [r for r in df.to_dict("records") if r.get("setting", "paper") == "paper"]
    records = []
    for r in rows:
        entry = {"model": r["model"], "strategy": r["strategy"], "source": "measured"}
        entry["world_size"] = int(r["world_size"])
        entry["iteration_ms"] = 1e3 * r["iteration_s"]
        entry["fwd_bwd_ms"] = 1e3 * r["fwd_bwd_s"]
        entry.update({f"{k}_ms": 1e3 * v for k, v in measured_phases(r).items()})
        entry["bytes_per_rank"] = sum(int(r[f"bytes_{c}"]) for c in CATEGORIES)
        entry["wire_bytes_per_rank"] = sum(int(r[f"wire_{c}"]) for c in CATEGORIES)
        entry["memory_MiB"] = r["mem_kfac"] / 2**20
        records.append(entry)

    ms = _measurements(rows)
    base = PRESETS[BASE_PRESET]
    fitted = fitting_lib.fit(ms, base, "calibrated")
    sizes = sorted({m.world_size for m in ms})
    held = {
        p: fitting_lib.fit([m for m in ms if m.world_size != p], base, f"without P={p}")
        for p in sizes
        if p > 1 and len(set(sizes) - {p}) > 0
    }
    errors = []
    paper_hw = PRESETS[PAPER_PRESET]
    for model, model_fit in fitted.models.items():
        hw = model_fit.hardware
        mine = [(r, m) for r, m in zip(rows, ms, strict=True) if m.model == model]
        for r, m in mine:
            if m.world_size == 1:
                continue
            pred = fitting_lib.predict_measurement(
                m, fitting_lib.hardware_for(m, hw, fitted.regimes)
            )
            fit = pred.update.phases
            held_step = _held_out(r, m, held.get(m.world_size))
            hold = held_step.phases if held_step else {}
            for phase, seconds in fitting_lib.measured_phases(m).items():
                if seconds <= 0 and fit.get(phase, 0.0) <= 0:
                    continue
                overlapped = phase in pred.overlapped_phases
                if overlapped and seconds <= 0:
                    continue  # DDP's all-reduces: inside the backward pass, not timed apart
                name = phase + (" (overlapped)" if overlapped else "")
                errors.append(_error_row(r, m, name, seconds, fit.get(phase, 0.0), hold.get(phase)))
            # The whole step, less the benchmark's own barriers (``isolate_comm``).
            measured = float(r["iteration_s"]) - float(r.get("comm_sync_s", 0.0) or 0.0)
            held_iteration = (held_step.iteration if held_step else 0.0) or None  # 0: no fit
            errors.append(
                _error_row(r, m, ITERATION, measured, pred.update.iteration, held_iteration)
            )
        paper_shapes, paper_ws = row_shapes(mine[0][0], paper=True)
        for label in dict.fromkeys(r["strategy"] for r, _ in mine):
            runs = [(r, m) for r, m in mine if r["strategy"] == label]
            ref_row, ref = runs[0]
            paper_ref = measurement(ref_row, shapes=paper_shapes, weight_sharing=paper_ws)
            for p in PREDICTED_P:
                pred = fitting_lib.predict_measurement(ref, hw, world_size=p)
                records.append(_prediction_row(model, label, "calibrated", p, pred))
                here = next((m for _, m in runs if m.world_size == p), None)
                if here is not None and fitting_lib.core_share(here) < 1.0:
                    pred = fitting_lib.predict_measurement(
                        here, fitting_lib.hardware_for(here, hw, fitted.regimes)
                    )
                    records.append(
                        _prediction_row(model, label, "calibrated, shared cores", p, pred)
                    )
                if p >= 8:
                    pred = fitting_lib.predict_measurement(paper_ref, paper_hw, world_size=p)
                    records.append(
                        _prediction_row(model, label, f"{PAPER_PRESET}, paper size", p, pred)
                    )
    notes = [
        f"Sources: `measured` here ({_machine(rows)});",
        "`calibrated`: dpkfac.costmodel fitted to these rows' phase timings (base preset "
        f"`{BASE_PRESET}`, forward/backward rate rescaled per model), same shapes as measured, "
        "one core per rank (links and overlap from the rows with a core per rank); "
        "`calibrated, shared cores`: at the measured P where ranks outnumber cores, compute "
        "slowed by cores/P, links and overlap fitted to that P's communication phases;",
        f"`{PAPER_PRESET}, paper size`: the preset for the papers' 64-GPU V100 cluster with "
        "each model's paper-size shapes (`workload.paper` in conf/workload).",
        "Errors: `error_%` in-sample; `held_out_error_%` calibrated without that P's rows: "
        "engines, forward/backward rate and overlap from the other world sizes' rows, links "
        "from the job's start-up link probes at that P (`link_probes`: each collective timed "
        "as a step meets it, experiments/bench/link_probe.py; rows without probes: the other "
        "rows' links, slowed by cores/P where ranks share cores). "
        "Communication is measured with `isolate_comm` (a barrier before each "
        "phase's collectives), least wait over ranks per step. Phase `iteration`: the whole "
        "step less the benchmark's barriers (`comm_sync`). SGD (`none`) is DDP: its "
        "all-reduces run inside the backward pass and have no phase of their own.",
    ]
    return pd.DataFrame(records), pd.DataFrame(errors), notes


def _held_out(
    row: Mapping[str, Any], m: Measurement, out: fitting_lib.Fit | None
) -> StepPrediction | None:
    """The run's update step on the fit without its world size (None: no such fit), with the
    links of the job's own probes (:func:`probe_links`) where it has them."""
    if out is None or m.model not in out.models:
        return None
    hw = fitting_lib.hardware_for(m, out.models[m.model].hardware, out.regimes)
    if probed := probe_links(row):
        hw = replace(hw, links={**hw.links, **probed})
    return fitting_lib.predict_measurement(m, hw).update


def probe_links(row: Mapping[str, Any], *, link_bound: bool | None = None) -> dict[str, Link]:
    """Links fitted to the job's start-up probes (:mod:`experiments.bench.link_probe`).

    Empty for rows without probes (single-rank jobs, rows that predate them).

    ``link_bound`` (None: whether the row ran on an emulated network,
    :mod:`experiments.network`): the job ran where every transfer is bound by one shaped
    link. There a rooted probe recorded without
    ``calls`` (before the probe rooted a broadcast at every rank) timed a lone root, which
    returns once its bytes are in the socket's buffers, not the transfer (16 MiB took 0.8×,
    2 MiB 0.05× of their time on the wire at 1 Gbit/s): it is left out. On gloo every kind
    the probes do not time is then derived from the probed all-reduce by gloo's algorithms
    (:func:`dpkfac.plan.hardware.gloo_link`), rather than taken from the base preset, whose
    links are loopback's.
    """
    probes = json_value(row.get("link_probes"))
    if not isinstance(probes, list) or not probes:
        return {}
    if link_bound is None:
        link_bound = row.get("network") == "emulated"
    if link_bound:
        probes = [e for e in probes if e["kind"] == "allreduce" or "calls" in e]
    samples = [
        Sample.collective(
            e["kind"],
            int(e["nbytes"]),
            float(e["seconds"]),
            int(e["world_size"]),
            calls=int(e.get("calls", 1)),
        )
        for e in probes
    ]
    # Link-bound, a step's time is its large transfers (BERT's 28 MB bucket): a fit of
    # relative residuals weighs the 64 KiB probe (latency, and tbf's burst, which sends it
    # faster than the rate) as much as the 16 MiB one and left the link's seconds per byte
    # 5% under the 16 MiB probe's. Absolute residuals fit the bandwidth the large ones see.
    fitted = fitting_lib.calibrate(
        samples, name="probes", base=PRESETS[BASE_PRESET], log2p=False, relative=not link_bound
    )
    links = {kind: fitted.links[kind] for kind in {e["kind"] for e in probes}}
    if link_bound and "allreduce" in links and str(row.get("backend", "gloo")) == "gloo":
        p = int(probes[0]["world_size"])
        derived = {k: gloo_link(k, links["allreduce"], p) for k in COLLECTIVE_KINDS}
        links = {**derived, **links}
    return links


def probe_engines(
    row: Mapping[str, Any], base: Hardware, *, forward_backward_s: float | None = None
) -> dict[str, Engine]:
    """``base``'s engines scaled to the job's compute probes
    (:mod:`experiments.bench.compute_probe`); ``forward_backward_s``, where given, stands for
    the forward/backward probe's seconds (:func:`probe_hardware` says why).

    Each probe timed one engine kind on the job's own model (its work as the cost model
    counts it): the kind's engine is sped up, rate and latency alike, until it gives the
    probe's seconds, its other kinds (a factor's memory passes) priced by what was fitted
    before it (:data:`~experiments.bench.compute_probe.COMPUTE_PROBE_KINDS` order). The
    preset keeps how each kind's time grows with its size; the probe says how fast this
    host runs it in a job. A kind the preset leaves free ("host", "launch") gets the probe's
    seconds per call. Empty for rows without probes (rows that predate them).
    """
    from experiments.bench.compute_probe import COMPUTE_PROBE_KINDS

    probes = json_value(row.get("compute_probes"))
    if not isinstance(probes, list) or not probes:
        return {}
    order = {kind: i for i, kind in enumerate(COMPUTE_PROBE_KINDS)}
    hw, out = base, {}
    engines = [e for e in probes if e["kind"] in order]  # not the overlap probe's entry
    for entry in sorted(engines, key=lambda e: order[e["kind"]]):
        kind = str(entry["kind"])
        work = {k: (float(c), float(a)) for k, (c, a) in entry["work"].items()}
        calls, amount = work.pop(kind, (0.0, 0.0))
        predicted = hw.time({kind: (calls, amount)}, 1)
        seconds = float(entry["seconds"])
        if kind == "forward_backward" and forward_backward_s is not None:
            seconds = forward_backward_s
        left = seconds - hw.time(work, 1)
        if left <= 0:
            continue
        if predicted > 0:
            engine, scale = hw.engine(kind), predicted / left
            out[kind] = Engine(engine.rate * scale, engine.latency / scale)
        elif calls > 0:  # a kind the preset leaves free ("host", "launch"): per call
            out[kind] = Engine(math.inf, left / calls)
        else:
            continue
        hw = replace(hw, engines={**hw.engines, kind: out[kind]})
    return out


def probe_overlap(row: Mapping[str, Any]) -> float | None:
    """The job's overlap probe (:func:`experiments.bench.compute_probe.probe_overlap`): how
    much of a transfer ran beside its compute. None where the row has none (one rank, or
    rows that predate it)."""
    from experiments.bench.compute_probe import OVERLAP_KIND

    probes = json_value(row.get("compute_probes"))
    entries = [e for e in probes if e["kind"] == OVERLAP_KIND] if isinstance(probes, list) else []
    return float(entries[0]["overlap"]) if entries else None


def probe_hardware(row: Mapping[str, Any], *, in_rotation_s: float | None = None) -> Hardware:
    """The hardware model of a row from its job's own probes alone: :data:`BASE_PRESET`'s
    engines scaled to the job's compute probes (:func:`probe_engines`, where the row has
    them), with the link probes' links (:func:`probe_links`, link-bound on an emulated
    network) and the overlap probe's overlap (:func:`probe_overlap`, where it has one; the
    preset's otherwise, fitted on loopback).

    ``in_rotation_s``: seconds of a hook-free forward/backward pass of the job's model timed
    in turn with its steps (:func:`rotation_forward_backward`), which then prices the
    forward/backward engine in place of the probe timed before the steps. The steps share
    the process with every config's model copy and state; the probe before them does not,
    and over the committed network rows it read a median 12% below the K-FAC steps' own
    pass, a gap that grows with the configs a job holds
    (:func:`experiments.bench.compute_probe._interleaved_rounds`). The pass in the rotation
    read within the steps' spread, and with it the held-out step error over those rows fell
    from 5.6% to 3.2% (rows over 10%: 20 of 120 to 3).

    Nothing in it is fitted to any row's phase timings (a hook-free pass is no config's
    step), so a prediction on it is held out from every measured step; the network table
    predicts its rows this way.
    """
    base = PRESETS[BASE_PRESET]
    hw = replace(base, name="probes", links={**base.links, **probe_links(row)})
    overlap = probe_overlap(row)
    if overlap is not None:
        hw = replace(hw, overlap=overlap)
    engines = probe_engines(row, hw, forward_backward_s=in_rotation_s)
    return replace(hw, engines={**hw.engines, **engines})


def rotation_forward_backward(job: Sequence[Mapping[str, Any]]) -> float | None:
    """Seconds of the hook-free forward/backward pass a job timed in turn with its steps:
    DDP SGD's pass run again under ``no_sync`` after each of its steps, cold, as the steps
    are (``fwd_bwd_local_s``, :meth:`experiments.bench.measure._Stepper.step`; per step the
    slowest rank, then the median). None where the job has no such row (no SGD under DDP,
    or rows that predate the pass)."""
    for row in job:
        value = row.get("fwd_bwd_local_s")
        if value is not None and value == value and float(value) > 0:
            return float(value)
    return None


def phase_errors(errors: pd.DataFrame) -> pd.DataFrame:
    """The per-phase rows of :func:`scaling_frames`'s errors (without the iteration rows)."""
    return errors[errors["phase"] != ITERATION] if not errors.empty else errors


def iteration_errors(errors: pd.DataFrame) -> pd.DataFrame:
    """The whole-step rows of :func:`scaling_frames`'s errors."""
    return errors[errors["phase"] == ITERATION] if not errors.empty else errors


def _machine(rows: list[Mapping[str, Any]]) -> str:
    """Where the rows ran, e.g. "2 CPU cores, gloo; P=4 oversubscribes the cores"."""
    devices = {str(r.get("device", "cpu")).split(":")[0] for r in rows}
    if devices != {"cpu"}:
        return ", ".join(sorted(devices))
    cores = _cores(rows[0])
    # Where the ranks outnumber the cores.
    over = sorted({int(r["world_size"]) for r in rows if (_cores(r) or 1) < int(r["world_size"])})
    text = f"{cores} CPU cores, gloo"
    if over:
        text += f"; P={', '.join(map(str, over))} oversubscribe{'s' if len(over) == 1 else ''}"
        text += " the cores"
    return text


def _err(predicted: float, measured: float) -> float:
    return 100.0 * (predicted - measured) / measured if measured > 0 else float("nan")


def _error_row(
    row: Mapping[str, Any],
    m: Measurement,
    phase: str,
    measured: float,
    predicted: float,
    held_out: float | None,
) -> dict[str, Any]:
    """One row of :func:`scaling_frames`'s errors (``held_out`` None: no held-out fit)."""
    nan = float("nan")
    return {
        "model": m.model,
        "strategy": row["strategy"],
        "world_size": m.world_size,
        "phase": phase,
        "measured_ms": 1e3 * measured,
        "predicted_ms": 1e3 * predicted,
        "error_%": _err(predicted, measured),
        "held_out_ms": nan if held_out is None else 1e3 * held_out,
        "held_out_error_%": nan if held_out is None else _err(held_out, measured),
    }


def error_summary(errors: pd.DataFrame) -> pd.DataFrame:
    """Median absolute error per phase and world size (the number the issue asks for)."""
    if errors.empty:
        return errors
    names = {"error_%": "median |error| %", "held_out_error_%": "held out %"}
    e = errors.assign(**{name: errors[col].abs() for col, name in names.items()})
    return e.groupby(["phase", "world_size"])[list(names.values())].median().reset_index()
