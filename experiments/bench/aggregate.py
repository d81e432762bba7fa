"""Per-rank step records to one benchmark row.

Conventions (also in docs/reproduction.md, "How numbers are measured"):

* **Busiest rank.** For every measured step each quantity is the maximum
  over ranks (the step waits for the slowest rank); the row then holds the
  median of those maxima over the measured steps. Memory is the K-FAC state
  of the rank that holds the most (``mem_kfac``), and that rank's whole-process
  tally (``mem_process``: parameters, gradients, optimizer state, module
  buffers and K-FAC state, :func:`dpkfac.process_memory`); on CUDA
  ``mem_process_peak_cuda`` is the allocator's peak, the most any rank
  reached in a measured step.
* **Forward/backward** excludes the phases timed inside the forward and
  backward hooks: ``factor_compute`` (factors are built there), and with
  dp_kfac's ``overlap`` also the gradient reduction, decompositions,
  preconditioning and broadcasts. The wall time of ``loss.backward()``
  contains them; reporting them apart keeps the stacked bars additive.
* **Other work in the step** (``step_other_s``) is ``pre.step()``'s wall time
  minus the phases timed inside it: folding factors into running averages,
  packing and unpacking fused buffers, the KL clip and writing gradients
  back (for SGD: packing its fused gradient buffers).
* **Amortisation.** A row is a per-step average at the setting's update
  intervals F (factors) and I (decompositions): each quantity is
  ``(1 - 1/F)·plain + (1/F - 1/I)·factor + (1/I)·decomp``, from the medians
  of the step kinds measured. The paper setting (F = I = 1) is just the
  decomposition-step median. Per-kind iteration times are kept as
  ``iteration_<kind>_s``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from dpkfac.costmodel.timing import COMM_PHASES, COMPUTE_PHASES
from dpkfac.stats import COMM_CATEGORIES, PHASES

#: Phases timed by the preconditioner, in the order of an iteration.
KFAC_PHASES = tuple(p for p in PHASES if p != "grad_comm")
#: Stacked-bar order of a whole iteration (they sum to ``iteration_s`` up to noise).
ITERATION_PARTS = ("fwd_bwd", "grad_comm", *KFAC_PHASES, "step_other", "optimizer")
#: Second-order communication: the cost model's communication phases less the
#: gradient reduction, which first-order training pays too (a row's ``comm_s``).
SECOND_ORDER_COMM = tuple(p for p in COMM_PHASES if p != "grad_comm")
SECOND_ORDER_CATEGORIES = ("factor_allreduce", "decomposition_broadcast", "precond_broadcast")
#: What a process holds besides K-FAC state (:class:`dpkfac.ProcessMemory`'s fields),
#: kept as ``mem_process_<part>`` columns beside the total ``mem_process``.
PROCESS_PARTS = ("parameters", "gradients", "optimizer", "module_buffers")


def kind_weights(factor_update_steps: int, inv_update_steps: int) -> dict[str, float]:
    """How often each step kind occurs at update intervals F and I."""
    f, i = 1.0 / factor_update_steps, 1.0 / inv_update_steps
    weights = {"decomp": i, "factor": max(f - i, 0.0), "plain": 1.0 - f}
    return {k: w for k, w in weights.items() if w > 0}


def in_step(phases: dict[str, float], in_hooks: dict[str, float]) -> float:
    """Seconds of ``phases`` (the preconditioner's timings after ``step()``) timed inside
    ``step()``: less what its timings held after the backward pass (``in_hooks``, the phases
    of the forward and backward hooks). ``step()``'s wall time less this is its other work."""
    return sum(max(t - in_hooks.get(p, 0.0), 0.0) for p, t in phases.items())


def _flatten(record: dict[str, Any]) -> dict[str, float]:
    """One rank's step record as flat scalars."""
    phases = record["phases"]
    # Rows written before the hooks' phases were recorded: factors only.
    in_hooks = record.get("phases_in_fwd_bwd") or {
        "factor_compute": phases.get("factor_compute", 0.0)
    }
    flat = {
        "iteration": record["iteration"],
        "fwd_bwd": max(record["fwd_bwd_wall"] - sum(in_hooks.values()), 0.0),
        "optimizer": record["optimizer"],
        "step_other": max(record["step_wall"] - in_step(phases, in_hooks), 0.0),
        **{phase: phases.get(phase, 0.0) for phase in ("grad_comm", *KFAC_PHASES)},
    }
    if "fwd_bwd_local" in record:  # DDP SGD's forward/backward without its reductions
        flat["fwd_bwd_local"] = record["fwd_bwd_local"]
    for cat in COMM_CATEGORIES:
        stats = record["comm"].get(cat, {})
        for column, key in (("bytes", "bytes"), ("calls", "calls"), ("wire", "wire_bytes")):
            flat[f"{column}_{cat}"] = stats.get(key, 0)
    flat.update({f"mem_{key}": value for key, value in record["memory"].items()})
    flat["mem_kfac"] = sum(record["memory"].values())
    # The whole process's tally (records written before it was measured have none).
    process = record.get("process_memory")
    if process:
        flat["mem_process"] = process["total"]
        flat.update({f"mem_process_{key}": process[key] for key in PROCESS_PARTS})
        if "peak_cuda" in process:
            flat["mem_process_peak_cuda"] = process["peak_cuda"]
    return flat


def aggregate(
    results: Sequence[dict[str, Any]], factor_update_steps: int, inv_update_steps: int
) -> dict[str, Any]:
    """Combine every rank's records into the row's measured columns.

    Args:
        results: one :func:`experiments.bench.measure.run_rank` result per rank.
        factor_update_steps: factor update interval F of the setting.
        inv_update_steps: decomposition interval I of the setting.

    Returns:
        Flat columns: ``<part>_s`` seconds (amortised per step), bytes, calls
        and wire bytes per category, busiest-rank memory and derived sums.
    """
    steps = len(results[0]["records"])
    if any(len(r["records"]) != steps for r in results):
        raise ValueError("ranks measured different numbers of steps")
    if steps == 0:
        raise ValueError("no measured steps")
    per_step: dict[str, list[dict[str, float]]] = {}
    memory_peak = {"mem_kfac": -1.0}
    for j in range(steps):
        flats = [_flatten(r["records"][j]) for r in results]
        kind = results[0]["records"][j]["kind"]
        per_step.setdefault(kind, []).append({key: max(f[key] for f in flats) for key in flats[0]})
        for rank, flat in enumerate(flats):
            if flat["mem_kfac"] > memory_peak["mem_kfac"]:
                memory_peak = {k: v for k, v in flat.items() if k.startswith("mem_")}
                memory_peak["mem_rank"] = results[rank]["rank"]

    weights = kind_weights(factor_update_steps, inv_update_steps)
    if set(per_step) == {"decomp"}:  # SGD, or the paper setting: every step is alike
        weights = {"decomp": 1.0}
    elif missing := sorted(set(weights) - set(per_step)):
        raise ValueError(f"step kinds {missing} were not measured; use more steps")
    medians = {
        kind: {key: statistics.median(s[key] for s in samples) for key in samples[0]}
        for kind, samples in per_step.items()
    }
    row: dict[str, Any] = {}
    for key in medians["decomp"]:
        if key.startswith("mem_"):
            continue
        value = sum(w * medians[kind][key] for kind, w in weights.items())
        row[key if key.startswith(("bytes_", "calls_", "wire_")) else f"{key}_s"] = value
    row.update({f"iteration_{kind}_s": m["iteration"] for kind, m in medians.items()})
    row.update(memory_peak)
    peaks = [
        rec["process_memory"]["peak_cuda"]
        for r in results
        for rec in r["records"]
        if "peak_cuda" in (rec.get("process_memory") or {})
    ]
    if peaks:  # the CUDA allocator's peak: the most any rank reached in any measured step
        row["mem_process_peak_cuda"] = max(peaks)
    row["compute_s"] = sum(row[f"{p}_s"] for p in COMPUTE_PHASES)
    row["comm_s"] = sum(row[f"{p}_s"] for p in SECOND_ORDER_COMM)
    row["second_order_s"] = row["compute_s"] + row["comm_s"] + row["step_other_s"]
    row["bytes_second_order"] = sum(row[f"bytes_{c}"] for c in SECOND_ORDER_CATEGORIES)
    row["wire_second_order"] = sum(row[f"wire_{c}"] for c in SECOND_ORDER_CATEGORIES)
    row["measured_steps"] = steps
    # Phase timings of the update (decomposition) steps, for the cost model's fits.
    updates = [j for j, rec in enumerate(results[0]["records"]) if rec["kind"] == "decomp"]
    row["rank_timings"] = [
        {
            name: statistics.median(r["records"][j]["phases"].get(name, 0.0) for j in updates)
            for name in (*KFAC_PHASES, "grad_comm")
        }
        for r in results
    ]
    # Waiting on a collective includes waiting for ranks still computing; the last rank to
    # arrive waits only for the transfer. Which rank is last changes from step to step, so
    # the least wait over ranks is taken per step, before the median: a median per rank
    # first would keep other ranks' lateness in every rank's figure.
    row["least_wait"] = {
        name: statistics.median(
            min(r["records"][j]["phases"].get(name, 0.0) for r in results) for j in updates
        )
        for name in COMM_PHASES
    }
    row["loss_last"] = results[0]["records"][-1]["loss"]
    return row
