"""Benchmark rows to the papers' tables: ``results/<table>.{csv,md,png}``.

A table sweep (``python -m experiments.bench -m table=NAME``) ends in
:class:`TableCallback`, which collects the sweep's ``rows.json`` files, keeps
them as ``results/raw/NAME.csv`` and writes the table. The table alone can be
redrawn from saved rows without measuring again::

    python -m experiments.bench.tables second_order_update              # from results/raw
    python -m experiments.bench.tables paper                            # predicted, no rows
    python -m experiments.bench.tables scaling --rows multirun/benchmark/scaling/<stamp>

Each table is one line of :data:`experiments.config.TABLES` (what it holds) and a section
of docs/reproduction.md, "One command per table" (what each column means):
``second_order_update`` (the DP-KFAC paper's headline), ``time_breakdown`` (the SPD-KFAC
paper's stacked bars), ``scaling`` (with the cost model's predictions,
:mod:`experiments.bench.predict`), ``convergence`` (with the presets' smoke status from
``make smoke-report``), ``convergence_scale`` (:mod:`experiments.bench.convergence_scale`),
``ablation`` (measured at P=2, predicted at P=64) and ``paper`` (predicted only, from the
configs: :mod:`experiments.bench.paper`).

Ratios are only formed between rows of the same sweep (one machine, one
load), which is what makes them meaningful on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.experimental.callback import Callback
from matplotlib.figure import Figure
from omegaconf import DictConfig

from experiments.bench import plots, smoke, takeaways, workloads
from experiments.bench.aggregate import ITERATION_PARTS
from experiments.bench.pages import (
    JOB,
    MixedMachines,
    failures,
    first_order,
    footer,
    machine_line,
    median_runs,
    ok_rows,
    one_machine,
    overlap,
    page,
    ratio_text,
    to_markdown,
    write_page,
)
from experiments.bench.plots import COMPARED, REFERENCE
from experiments.config import TABLES

log = logging.getLogger(__name__)

MiB = 2**20


# ------------------------------------------------------------------ rows in
def _natural(path: Path) -> list[Any]:
    """Sort key that puts job folder 10 after 9 (Hydra numbers jobs 0, 1, ..., 10)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


def _json_rows(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    return data if isinstance(data, list) else [data]


def load_rows(sources: Iterable[str | Path]) -> pd.DataFrame:
    """Rows from sweep folders (every ``rows.json`` below, in job order), JSON or CSV files."""
    records: list[dict[str, Any]] = []
    frames = []
    for source in sources:
        path = Path(source)
        if path.is_dir():
            for p in sorted([*path.rglob("rows.json"), *path.rglob("row.json")], key=_natural):
                records += _json_rows(p)
        elif path.suffix == ".json":
            records += _json_rows(path)
        elif path.suffix == ".csv":
            frames.append(pd.read_csv(path, keep_default_na=False, na_values=[""]))
        else:
            raise FileNotFoundError(f"no benchmark rows at {path} (a folder, .json or .csv)")
    if records:
        frames.append(pd.DataFrame(records))
    if not frames:
        return pd.DataFrame()
    df = upgrade_rows(pd.concat(frames, ignore_index=True))
    if "error" not in df.columns:
        df["error"] = ""
    df["error"] = ["" if pd.isna(e) else str(e) for e in df["error"]]
    return df


#: Columns of rows written before the setting used the preconditioner's option names.
RENAMED_COLUMNS = {"factor_every": "factor_update_steps", "inv_every": "inv_update_steps"}


def upgrade_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Rows written by earlier versions of the benchmark, in the present one's terms.

    The update intervals are ``factor_update_steps`` and ``inv_update_steps``
    (:data:`RENAMED_COLUMNS`: older rows called them ``factor_every`` and
    ``inv_every``; same place, same values), and a row's ``model_batch`` names its
    batch class by the module it lives in now
    (:func:`experiments.bench.workloads.batch_target`). Values are otherwise
    untouched, so a table rewritten from old rows has the numbers it had.
    """
    renamed = {old: new for old, new in RENAMED_COLUMNS.items() if old in df.columns}
    if any(new in df.columns for new in renamed.values()):  # old and new rows together
        for old, new in renamed.items():
            df[new] = df[new].where(df[new].notna(), df[old]) if new in df else df[old]
        df = df.drop(columns=list(renamed))
    else:
        df = df.rename(columns=renamed)
    if "model_batch" in df.columns:
        df["model_batch"] = [
            v if isinstance(v, float) else workloads.upgrade_batch(v) for v in df["model_batch"]
        ]
    return df


def timing_runs(df: pd.DataFrame) -> pd.DataFrame:
    """Every successful timing row of every run, ``seed`` filled (-1: a row from before
    seeds were recorded) and ``first_order`` set: what ranges over runs are taken from."""
    rows = df[(df["error"] == "") & (df.get("task", "timing") == "timing")].copy()
    rows["seed"] = rows["seed"].fillna(-1) if "seed" in rows else -1
    rows["first_order"] = [first_order(r) for r in rows.to_dict("records")]
    return rows


def vs_sgd_spread(df: pd.DataFrame) -> pd.DataFrame:
    """Iteration time over SGD's, per job and strategy config, across the repeated runs.

    Each run's ratio is taken within that run (its K-FAC row over its own
    first-order row, both measured in turns under one load), so the spread is
    that of the ratio a table prints, not of absolute times. Returns one row
    per (``JOB``, ``strategy``) with ``vs_sgd_min``, ``vs_sgd_max``, ``runs``
    (the number of runs with both rows), ``first_order`` (SGD's own row) and
    ``iteration_ms_min``/``iteration_ms_max`` (the absolute times' range, which
    the figures draw as error bars); empty without first-order rows.
    """
    if df.empty:
        return pd.DataFrame()
    rows = timing_runs(df)
    if not rows["first_order"].any():
        return pd.DataFrame()
    rows["ratio"] = over_sgd(rows, [*JOB, "seed"], "iteration_s")
    rows["iteration_ms"] = 1e3 * rows["iteration_s"]
    out = rows.dropna(subset=["ratio"]).groupby([*JOB, "strategy"], dropna=False, sort=False)
    return out.agg(
        vs_sgd_min=("ratio", "min"),
        vs_sgd_max=("ratio", "max"),
        runs=("ratio", "count"),
        first_order=("first_order", "first"),
        iteration_ms_min=("iteration_ms", "min"),
        iteration_ms_max=("iteration_ms", "max"),
    ).reset_index()


def cheapest_per_run(
    df: pd.DataFrame, among: Sequence[str], reference: str | None, column: str, name: str
) -> pd.DataFrame:
    """The cheapest of ``among`` over ``reference`` in each run, and its range over runs.

    In every run (job and seed) the strategy config of ``among`` with the least
    ``column`` is divided by the reference's ``column`` of the same run
    (``reference`` names a config; None: the first-order row), so each ratio
    compares rows measured in turns under one load, and the cheapest baseline
    may differ from run to run (a range of the median run's cheapest config
    alone would miss runs where another was cheaper). Returns one row per job
    (:data:`JOB`) with ``name`` (the median run's ratio, :func:`median_runs`),
    ``<name>_min``, ``<name>_max``, ``<name>_runs`` and ``<name>_config`` (the
    median run's cheapest); empty where no run has both sides.
    """
    rows = timing_runs(df)
    columns = [*JOB, name, f"{name}_min", f"{name}_max", f"{name}_runs", f"{name}_config"]
    if rows.empty:
        return pd.DataFrame(columns=columns)
    median = median_runs(rows).drop_duplicates(JOB).set_index(JOB)["seed"]
    out = []
    for keys, run in rows.groupby([*JOB, "seed"], sort=False, dropna=False):
        ref = run[run["first_order"]] if reference is None else run[run["strategy"] == reference]
        candidates = run[run["strategy"].isin(list(among))]
        if ref.empty or candidates.empty or not ref[column].iloc[0]:
            continue
        best = candidates.loc[candidates[column].idxmin()]
        out.append((*keys, best["strategy"], best[column] / ref[column].iloc[0]))
    frame = pd.DataFrame(out, columns=[*JOB, "seed", "config", "ratio"])
    if frame.empty:
        return pd.DataFrame(columns=columns)
    result = []
    for keys, job in frame.groupby(JOB, sort=False, dropna=False):
        at = job[job["seed"] == median.get(keys, job["seed"].iloc[0])]
        at = at if len(at) else job.iloc[:1]
        ratio, config = at["ratio"].iloc[0], at["config"].iloc[0]
        result.append((*keys, ratio, job["ratio"].min(), job["ratio"].max(), len(job), config))
    return pd.DataFrame(result, columns=columns)


def verdict(ours: tuple[float, float], theirs: tuple[float, float]) -> str:
    """``faster``, ``slower`` or ``tie``: two ranges of iteration time over runs
    (ours against the cheapest baseline's, both × SGD); ranges that overlap are a tie."""
    if overlap(ours, theirs):
        return "tie"
    return "faster" if ours[1] < theirs[0] else "slower"


def _bounds(row: Mapping[str, Any], prefix: str) -> tuple[float, float]:
    """``(low, high)`` of a range ``<prefix>_min``/``_max``; the value itself where the job ran
    once (NaN bounds)."""
    low, high = row.get(f"{prefix}_min", float("nan")), row.get(f"{prefix}_max", float("nan"))
    return (row[prefix], row[prefix]) if low != low or high != high else (low, high)


def iteration_verdicts(
    raw: pd.DataFrame, frame: pd.DataFrame, baselines: Sequence[str], p_column: str
) -> pd.DataFrame:
    """Per job: dp_kfac, the fastest K-FAC config and the cheapest baseline, × SGD, with
    their ranges over runs, and whether dp_kfac is faster than the baselines or ties.

    ``frame`` is a table's per-strategy frame (``vs_sgd`` with its ``vs_sgd_min``/
    ``_max`` from :func:`with_spread`); the cheapest baseline is taken within each
    run (:func:`cheapest_per_run`), so ``verdict`` (:func:`verdict`) compares
    dp_kfac's range with the baselines' best range over the same runs.
    """
    if frame.empty or "vs_sgd" not in frame:
        return pd.DataFrame()
    best = cheapest_per_run(raw, baselines, None, "iteration_s", "baseline_vs_sgd")
    best = best.rename(columns={"world_size": p_column})
    out = []
    for (model, setting, p), group in frame.groupby(["model", "setting", p_column], sort=False):
        rows = group.set_index("strategy")
        kfac = group[~group["first_order"].astype(bool)]
        base = best[(best["model"] == model) & (best["setting"] == setting)]
        base = base[base[p_column] == p]
        if REFERENCE not in rows.index or kfac.empty or base.empty:
            continue
        dp, fast, b = rows.loc[REFERENCE], kfac.loc[kfac["vs_sgd"].idxmin()], base.iloc[0]
        out.append(
            {
                "model": model,
                "setting": setting,
                p_column: p,
                "dp_vs_sgd": dp["vs_sgd"],
                "dp_vs_sgd_min": _bounds(dp.to_dict(), "vs_sgd")[0],
                "dp_vs_sgd_max": _bounds(dp.to_dict(), "vs_sgd")[1],
                "fastest": fast["strategy"],
                "fastest_vs_sgd": fast["vs_sgd"],
                "fastest_vs_sgd_min": _bounds(fast.to_dict(), "vs_sgd")[0],
                "fastest_vs_sgd_max": _bounds(fast.to_dict(), "vs_sgd")[1],
                "baseline": b["baseline_vs_sgd_config"],
                "baseline_vs_sgd": b["baseline_vs_sgd"],
                "baseline_vs_sgd_min": b["baseline_vs_sgd_min"],
                "baseline_vs_sgd_max": b["baseline_vs_sgd_max"],
                "runs": int(b["baseline_vs_sgd_runs"]),
                "verdict": verdict(
                    _bounds(dp.to_dict(), "vs_sgd"),
                    (b["baseline_vs_sgd_min"], b["baseline_vs_sgd_max"]),
                ),
            }
        )
    return pd.DataFrame(out)


def with_spread(frame: pd.DataFrame, spread: pd.DataFrame, p_column: str) -> pd.DataFrame:
    """``frame`` with :func:`vs_sgd_spread`'s columns joined on its job and strategy.

    ``p_column`` names the frame's world-size column (tables call it ``P`` or
    ``world_size``). Rows without repeats get NaN bounds and ``runs`` 1.
    """
    if spread.empty or frame.empty:
        nan = float("nan")
        return frame.assign(
            vs_sgd_min=nan, vs_sgd_max=nan, runs=1, iteration_ms_min=nan, iteration_ms_max=nan
        )
    right = spread.drop(columns="first_order").rename(columns={"world_size": p_column})
    right[p_column] = right[p_column].astype(frame[p_column].dtype)
    joined = frame.merge(right, on=["model", "setting", p_column, "strategy"], how="left")
    joined["runs"] = joined["runs"].fillna(1).astype(int)
    return joined


def _write(
    out: Path,
    name: str,
    frame: pd.DataFrame,
    rows: pd.DataFrame,
    *,
    title: str,
    answer: list[str],
    body: list[str],
    method: list[str],
    figure: Callable[[], Figure] | None,
    extra: Mapping[str, pd.DataFrame] | None = None,
) -> dict[str, Path]:
    """A table's files: ``frame`` as ``<name>.csv`` (each ``extra`` frame as
    ``<name>_<key>.csv``), the page (:func:`experiments.bench.pages.page`: ``answer``,
    the figure, ``body``, ``method``, the rows' footer) as ``<name>.md``, and the
    ``figure`` (if any) as ``<name>.png``."""
    paths = {"csv": out / f"{name}.csv"}
    frame.to_csv(paths["csv"], index=False)
    for key, extra_frame in (extra or {}).items():
        paths[key] = out / f"{name}_{key}.csv"
        extra_frame.to_csv(paths[key], index=False)
    png = f"{name}.png" if figure is not None else None
    lines = page(title, answer, body, method, png)
    paths["md"] = write_page(out / f"{name}.md", [*lines, *footer(rows)])
    if figure is not None:
        paths["png"] = plots.save(figure(), out / f"{name}.png")
    return paths


def _timing_machine(df: pd.DataFrame, table: str) -> str:
    """The line naming the one machine a timing table's rows ran on (refuses a mix)."""
    rows = timing_runs(df) if not df.empty else df
    one_machine(rows, table)
    return machine_line(rows)


# ------------------------------------------------------- second_order_update
def second_order_frames(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per (model, P, setting, strategy) costs with ratios to dp_kfac, and the headline.

    Returns:
        ``long``: one row per strategy config with milliseconds of K-FAC
        computation (factor compute + decomposition + preconditioning on the
        busiest rank) and communication (factor, decomposition and
        preconditioned-gradient collectives), bytes and wire bytes of those
        collectives per rank, K-FAC memory of the busiest rank, iteration
        time and its ratio to SGD alone (the first-order row), and each
        cost's ratio to dp_kfac's.
        ``headline``: one row per model with ``<cost>_<strategy>/dp`` ratios
        and ``<cost>_best/dp`` against the cheapest baseline measured.
    """
    df = ok_rows(df)
    df = df.assign(pred_process_memory=predicted_process_memory(df.to_dict("records")))
    long_rows, head_rows = [], []
    for (model, p, setting), group in df.groupby(["model", "world_size", "setting"], sort=False):
        by = {r["strategy"]: r for r in group.to_dict("records")}
        costs = {strategy: _costs(r) for strategy, r in by.items()}
        sgd_s = next((r["iteration_s"] for r in by.values() if first_order(r)), float("nan"))
        dp = costs.get(REFERENCE)
        for strategy in plots.ordered(list(by)):
            r = by[strategy]
            entry = {"model": model, "label": r["label"], "P": p, "setting": setting}
            entry.update(strategy=strategy, **costs[strategy])
            entry["iteration_vs_sgd"] = r["iteration_s"] / sgd_s
            entry.update({f"{key}/dp": _over(costs[strategy], dp, key) for key in RATIOS})
            long_rows.append(entry)
        if dp is None:
            continue
        head = {"model": model, "P": p, "setting": setting}
        for key in RATIOS:
            ratios = {s: _over(costs[s], dp, key) for s in COMPARED if s in costs}
            if key in PER_STRATEGY:
                head.update({f"{key}_{s}/dp": ratio for s, ratio in ratios.items()})
            finite = [v for v in ratios.values() if v == v]  # NaN: a row that did not measure it
            head[f"{key}_best/dp"] = min(finite) if finite else float("nan")
        head_rows.append(head)
    return pd.DataFrame(long_rows), pd.DataFrame(head_rows)


def _over(costs: dict[str, float], base: dict[str, float] | None, key: str) -> float:
    """One cost over dp_kfac's (``base``); NaN without a base or where it is 0."""
    return costs[key] / base[key] if base is not None and base[key] else float("nan")


def cost_ratio_spread(df: pd.DataFrame, cost: str = "compute") -> pd.DataFrame:
    """Each strategy's ``cost`` (a key of :func:`_costs`) over dp_kfac's, per run, and its
    range over runs.

    Byte and memory ratios are exact; computation and communication are timed, so a
    job repeated over seeds gives one ratio per run (both rows of that run). Returns
    one row per (model, P, setting, strategy) with ``<cost>/dp_min``, ``<cost>/dp_max``
    and ``runs``; empty where no job was repeated.
    """
    rows = df[(df["error"] == "") & (df.get("task", "timing") == "timing")]
    if rows.empty or "seed" not in rows or rows["seed"].nunique(dropna=False) < 2:
        return pd.DataFrame()
    out = []
    keys = ["model", "world_size", "setting"]
    for (model, p, setting, _), run in rows.groupby([*keys, "seed"], sort=False, dropna=False):
        by = {r["strategy"]: _costs(r)[cost] for r in run.to_dict("records")}
        if base := by.get(REFERENCE):
            out += [(model, p, setting, strategy, value / base) for strategy, value in by.items()]
    frame = pd.DataFrame(out, columns=["model", "P", "setting", "strategy", "ratio"])
    grouped = frame.groupby(["model", "P", "setting", "strategy"], sort=False)["ratio"]
    return grouped.agg(
        **{f"{cost}/dp_min": "min", f"{cost}/dp_max": "max", "runs": "count"}
    ).reset_index()


#: Costs compared with dp_kfac's; the headline shows every baseline's ratio for
#: PER_STRATEGY and only the best baseline's for whole-process memory (measured,
#: and predicted), which sits beside the K-FAC memory's ``memory_best/dp``.
RATIOS = ("compute", "comm", "MB", "memory", "process_memory", "pred_process_memory")
PER_STRATEGY = ("compute", "comm", "MB", "memory")


def predicted_process_memory(records: Sequence[dict[str, Any]]) -> list[float]:
    """The cost model's whole-process MiB of each row's job (state and activation estimate).

    :func:`experiments.bench.predict.row_process_memory` with each model's
    shapes built once; NaN for a row that does not say which model it ran
    (no ``model_config``).
    """
    from experiments.bench import predict

    out = [float("nan")] * len(records)
    known = [i for i, r in enumerate(records) if isinstance(r.get("model_config"), str | dict)]
    rows = [records[i] for i in known]
    for i, r, (shapes, sharing) in zip(known, rows, predict.shapes_per_row(rows), strict=True):
        out[i] = predict.row_process_memory(r, shapes, sharing)["process_bytes"] / MiB
    return out


def _costs(r: dict[str, Any]) -> dict[str, float]:
    process = r.get("mem_process")  # rows measured before the tally have none
    return {
        "iteration_ms": 1e3 * r["iteration_s"],
        "compute": 1e3 * r["compute_s"],
        "comm": 1e3 * r["comm_s"],
        "MB": r["bytes_second_order"] / 1e6,
        "wire_MB": r["wire_second_order"] / 1e6,
        "memory": r["mem_kfac"] / MiB,
        "process_memory": float("nan") if process is None else float(process) / MiB,
        "pred_process_memory": float(r.get("pred_process_memory", float("nan"))),
        # Barrier wait for slower ranks before collectives (isolate_comm runs only).
        "imbalance_ms": 1e3 * float(r.get("comm_sync_s", 0.0) or 0.0),
    }


#: Timed costs of one second-order update: the row column each is taken from.
TIMED_COSTS = {"compute": "compute_s", "comm": "comm_s"}
#: The main table of ``second_order_update.md``: a headline column and its header.
_SECOND_ORDER_MAIN = {
    "compute_best/dp": "computation",
    "comm_best/dp": "comm time",
    "MB_best/dp": "bytes",
    "memory_best/dp": "K-FAC memory",
    "process_memory_best/dp": "process memory",
    "pred_process_memory_best/dp": "process memory (predicted)",
}
#: Its absolute values: a column of the long frame and its header.
_SECOND_ORDER_ABSOLUTE = {
    "strategy": "strategy",
    "iteration_ms": "iteration ms",
    "iteration_vs_sgd": "× SGD",
    "compute_ms": "compute ms",
    "comm_ms": "comm ms",
    "MB": "MB",
    "memory_MiB": "K-FAC MiB",
}


def second_order_best(df: pd.DataFrame, head: pd.DataFrame) -> pd.DataFrame:
    """``head`` with the timed ``<cost>_best/dp`` taken within each run: the cheapest
    baseline of that run over dp_kfac (:func:`cheapest_per_run`), its range over runs
    (``_min``, ``_max``), ``runs`` and the median run's cheapest config (``_config``)."""
    job = ["model", "P", "setting"]
    for cost, column in TIMED_COSTS.items():
        name = f"{cost}_best/dp"
        best = cheapest_per_run(df, COMPARED, REFERENCE, column, name)
        best = best.rename(columns={"world_size": "P", f"{name}_runs": "runs"})
        if best.empty:
            continue
        head = head.drop(columns=[name, "runs"], errors="ignore").merge(
            best.astype({"P": head["P"].dtype}), on=job, how="left"
        )
    return head


def second_order_tables(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """:func:`second_order_frames` with their ranges over runs, as the files hold them.

    ``long`` (columns in units: ``compute_ms``, ``memory_MiB``, ...) gains each
    strategy's ``<cost>/dp_min``/``_max`` for the timed costs (the figure's error
    bars); ``head`` gains the cheapest baseline of each run (:func:`second_order_best`).
    The page, the CSVs and the notebook all take them from here.
    """
    long, head = second_order_frames(df)
    head = second_order_best(df, head)
    job = ["model", "P", "setting"]
    for cost in TIMED_COSTS:
        spread = cost_ratio_spread(df, cost)
        if not spread.empty:
            long = long.merge(spread.drop(columns="runs"), on=[*job, "strategy"], how="left")
    memory = ("memory", "process_memory", "pred_process_memory")
    renamed = {"compute": "compute_ms", "comm": "comm_ms", **{c: f"{c}_MiB" for c in memory}}
    return long.rename(columns=renamed), head


def write_second_order_update(df: pd.DataFrame, out: Path) -> dict[str, Path]:
    """``results/second_order_update.*``: the headline ratios and the absolute costs."""
    where = _timing_machine(df, "second_order_update")
    long, head = second_order_tables(df)
    main = head[["model"]].copy()
    for column, header in _SECOND_ORDER_MAIN.items():
        if column not in head:
            continue
        if column.removesuffix("_best/dp") in TIMED_COSTS and f"{column}_min" in head:
            main[header] = [
                ratio_text(r[column], r[f"{column}_min"], r[f"{column}_max"], int(r["runs"]))
                for r in head.to_dict("records")
            ]
        else:
            main[header] = head[column]
    if "runs" in head:
        main["runs"] = head["runs"].fillna(1).astype(int)
    absolute = long[["model", *_SECOND_ORDER_ABSOLUTE]].rename(columns=_SECOND_ORDER_ABSOLUTE)
    compared = ", ".join(s for s in COMPARED if f"compute_{s}/dp" in head.columns)
    body = [
        f"## {REFERENCE} against the cheapest baseline ({compared}), per model",
        "",
        f"How many times less {REFERENCE} costs (> 1: it is cheaper). Computation and",
        "communication time are timed: each run's cheapest baseline over that run's "
        f"{REFERENCE}, the median run's ratio and in brackets its range over the runs. Bytes",
        "and memory are exact (the same in every run).",
        "",
        to_markdown(main, {"runs": 0}),
        "",
        "## Absolute values (median run, medians over measured steps, busiest rank)",
        "",
        to_markdown(absolute, {"× SGD": 2}),
        "",
        "Every strategy's ratio, the whole-process memory and the imbalance per row: "
        "`second_order_update.csv` (per strategy) and `second_order_update_best.csv` (per model).",
    ]
    method = [
        "computation = factor compute + decomposition + preconditioning (busiest rank);",
        "communication = factor, decomposition and preconditioned-gradient collectives",
        "(seconds and MB per rank; with `isolate_comm` the ranks meet at a barrier first, so",
        "the seconds are transfers and the wait for slower ranks is `imbalance_ms`);",
        "memory = K-FAC state of the busiest rank; process memory = that rank's whole process",
        "as measured between steps (parameters, gradients, SGD momentum, module buffers and",
        "K-FAC state: `dpkfac.process_memory`; – where the rows predate it); predicted = the",
        "cost model's prediction of that tally plus its activation estimate (the inputs and",
        "outputs of the K-FAC layers, a lower bound: `dpkfac.costmodel.memory`). Each job ran",
        "several times (seeds, interleaving every strategy config step by step); the median",
        "run (`experiments.bench.pages.median_runs`) is shown, and every ratio is taken within",
        "one run. A range that reaches 1 is a tie.",
    ]
    return _write(
        out,
        "second_order_update",
        long,
        df,
        title="Cost of one second-order update (factors and decompositions every step)",
        answer=[*takeaways.second_order_update(head), where],
        body=body,
        method=method,
        figure=None if head.empty else lambda: plots.ratio_bars(head, long),
        extra={"best": head},
    )


# ------------------------------------------------------------ time_breakdown
def breakdown_frame(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, setting, P, strategy): milliseconds of every iteration part."""
    rows = []
    for r in ok_rows(df).to_dict("records"):
        entry = {k: r[k] for k in ("model", "label", "setting", "world_size", "strategy")}
        parts = {f"{p}_ms": 1e3 * float(r.get(f"{p}_s", 0.0) or 0.0) for p in ITERATION_PARTS}
        entry.update(parts, sum_ms=sum(parts.values()), iteration_ms=1e3 * r["iteration_s"])
        rows.append({**entry, "first_order": first_order(r)})
    wide = pd.DataFrame(rows)
    if wide.empty:
        return wide
    wide["vs_sgd"] = over_sgd(wide, ["model", "setting", "world_size"], "iteration_ms")
    wide = with_spread(wide, vs_sgd_spread(df), "world_size")
    return plots.in_order(wide, ["setting", "model", "world_size", "strategy"])


def over_sgd(frame: pd.DataFrame, group: list[str], column: str) -> pd.Series:
    """``column`` over that of the group's (first) first-order row; NaN where it has none."""
    sgd = frame[frame["first_order"]].drop_duplicates(group).set_index(group)[column]
    keys = zip(*(frame[c] for c in group), strict=True)
    return frame[column] / pd.Series([sgd.get(k, float("nan")) for k in keys], index=frame.index)


#: The time breakdown's page columns: one per group of phases (the CSV keeps every phase).
BREAKDOWN_GROUPS = {
    "forward/backward": ("fwd_bwd",),
    "gradient comm": ("grad_comm",),
    "K-FAC compute": ("factor_compute", "decomposition", "precondition"),
    "K-FAC comm": ("factor_comm", "decomposition_comm", "precond_comm"),
    "other": ("comm_sync", "step_other", "optimizer"),
}


def write_time_breakdown(df: pd.DataFrame, out: Path) -> dict[str, Path]:
    """``results/time_breakdown.*``: per-phase milliseconds and the stacked bars."""
    where = _timing_machine(df, "time_breakdown")
    wide = breakdown_frame(df)
    verdicts = iteration_verdicts(df, wide, COMPARED, "world_size")
    # Barriers before collectives exist only in isolated runs (``isolate_comm``).
    isolated = "comm_sync_ms" in wide and bool(wide["comm_sync_ms"].any())
    parts = [p for p in ITERATION_PARTS if p != "comm_sync" or isolated]
    body = []
    for (setting, _), frame in wide.groupby(["setting", "model"], sort=False):
        show = frame[["strategy"]].copy()
        for header, phases in BREAKDOWN_GROUPS.items():
            columns = [f"{p}_ms" for p in phases if f"{p}_ms" in frame]
            show[header] = frame[columns].fillna(0.0).sum(axis=1)
        show["iteration"] = frame["iteration_ms"]
        show["vs SGD"] = _spread_texts(frame)
        p = int(frame["world_size"].iloc[0])
        body += [f"## {frame['label'].iloc[0]}, {setting} setting, P={p}", ""]
        body += [to_markdown(show, 1), ""]
    body.append(
        "Every phase of every row: `time_breakdown.csv`; the verdicts: "
        "`time_breakdown_verdicts.csv`."
    )
    method = [
        "Milliseconds per iteration, medians over steps, the busiest rank per phase.",
        "forward/backward excludes what is timed inside the hooks (factor computation, and",
        "with `dp_kfac_overlap` the reductions, decompositions, preconditioning and broadcasts",
        "it runs in the backward pass), so the parts add up to the iteration; K-FAC compute =",
        "factor compute + decomposition + preconditioning, K-FAC comm = their collectives,",
        "other = `step()`'s other work, the optimizer step and barriers before collectives.",
        "`practical` is amortised per step at factors every 10 and decompositions every 100 steps.",
        "Each job ran several times (seeds): the median run is shown, and `vs SGD` carries in",
        "brackets the lowest and highest ratio over the runs, each taken within its run; the",
        "figure's error bars are the iteration's range over the runs. dp_kfac is called faster",
        "than the baselines only where its range lies below that of the cheapest baseline of",
        "each run; where the ranges overlap it is a tie.",
    ]
    return _write(
        out,
        "time_breakdown",
        wide,
        df,
        title="Time breakdown of one iteration",
        answer=[*takeaways.time_breakdown(verdicts), where],
        body=body,
        method=method,
        figure=None if wide.empty else lambda: plots.stacked_breakdown(wide, parts),
        extra={"verdicts": verdicts} if not verdicts.empty else None,
    )


# ------------------------------------------------------------------- scaling
#: World sizes of the scaling page's prediction table (the CSV keeps every P).
SCALING_PREDICTED_P = (1, 4, 16, 64, 256)


def _measured_with_range(frame: pd.DataFrame, raw: pd.DataFrame) -> pd.DataFrame:
    """The measured rows of a scaling frame with their iteration time's range over runs
    (``iteration_ms_min``/``_max``), which the page prints and the figure draws."""
    spread = vs_sgd_spread(raw)
    if spread.empty:
        return frame.assign(iteration_ms_min=float("nan"), iteration_ms_max=float("nan"))
    spread = spread[spread["setting"] == "paper"][
        ["model", "world_size", "strategy", "iteration_ms_min", "iteration_ms_max", "runs"]
    ]
    return frame.merge(
        spread.astype({"world_size": int}), on=["model", "world_size", "strategy"], how="left"
    )


def write_scaling(df: pd.DataFrame, out: Path) -> dict[str, Path]:
    """``results/scaling.*``: measured and predicted times against P, and the model's error."""
    from experiments.bench import predict

    where = _timing_machine(df, "scaling")
    frame, errors, notes = predict.scaling_frames(ok_rows(df))
    body: list[str] = []
    if not frame.empty:
        frame = _measured_with_range(frame, df)
        measured = plots.in_order(frame[frame["source"] == "measured"], ["model", "strategy"])
        measured = measured.assign(
            text=[
                ratio_text(
                    r["iteration_ms"],
                    r["iteration_ms_min"],
                    r["iteration_ms_max"],
                    int(r["runs"]) if r["runs"] == r["runs"] else 1,
                )
                for r in measured.to_dict("records")
            ]
        )
        table = measured.pivot_table(
            index=["model", "strategy"],
            columns="world_size",
            values="text",
            aggfunc="first",
            sort=False,
        ).reset_index()
        table.columns = [c if isinstance(c, str) else f"P={c}" for c in table.columns]
        body += ["## Measured iteration time (ms: the median run, its range over runs)", ""]
        body += [to_markdown(table, 1), ""]
        predicted = frame[frame["source"] != "measured"]
        pivot = predicted.pivot_table(
            index=["model", "strategy", "source"], columns="world_size", values="iteration_ms"
        )
        pivot = pivot[[p for p in SCALING_PREDICTED_P if p in pivot.columns]].reset_index()
        pivot.columns = [c if isinstance(c, str) else f"P={c}" for c in pivot.columns]
        body += ["## Predicted iteration time (ms)", "", to_markdown(pivot, 1), ""]
        body.append("Every P from 1 to 256 and every phase: `scaling.csv`.")
    if not errors.empty:
        body += ["", "## Cost model: measured vs predicted per phase (calibrated model)", ""]
        body += ["Median absolute error over models and strategies:", ""]
        body.append(to_markdown(predict.error_summary(errors), {"world_size": 0, "P": 0}))
        body += ["", "Every measured row against its prediction: `scaling_errors.csv`."]
    figure = None if frame.empty else lambda: plots.scaling_lines(frame)
    extra = {} if errors.empty else {"errors": errors}
    method = [
        *notes,
        "",
        "Every job ran three times (seeds); the median job is kept whole, and the measured",
        "table and the figure's error bars give each time's range over the runs.",
    ]
    return _write(
        out,
        "scaling",
        frame,
        df,
        title="Scaling with the number of ranks",
        answer=[*takeaways.scaling(errors), where],
        body=body,
        method=method,
        figure=figure,
        extra=extra,
    )


# ------------------------------------------------------------------ ablation
#: World size of the ablation's predictions (the papers' 64-GPU cluster).
ABLATION_P = 64
#: Measured columns of the ablation's markdown, and their headers.
_ABLATION_MEASURED = {
    "iteration_ms": "iteration",
    "vs_sgd": "vs SGD",
    "compute_ms": "compute",
    "comm_ms": "comm",
    "grad_comm_ms": "grad comm",
    "total_wire_MB": "wire MB",
    "memory_MiB": "memory",
}
#: Predicted columns of the ablation's markdown (a table of their own, headers without P).
_ABLATION_PREDICTED = {f"pred_{k}": h for k, h in _ABLATION_MEASURED.items() if k != "grad_comm_ms"}


def _options_text(options: dict[str, Any]) -> str:
    """``key=value, ...`` of a strategy's own options (booleans as in the configs)."""
    return ", ".join(
        f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items()
    )


def ablation_frame(df: pd.DataFrame, predict_at: int | None = ABLATION_P) -> pd.DataFrame:
    """One row per (model, setting, P, strategy config): measured costs beside predicted ones.

    Rows keep the sweep's order (the table preset lists the strategy configs
    in the ablation's order; groups in order of first appearance), and each
    says which library strategy ran with which of its own options, read from
    the row's ``kfac_options``, so the table never depends on a config's name
    or on a strategy's defaults.

    Measured columns are ``second_order_update``'s plus the gradient
    communication and the wire bytes of every category (where owner reduction
    shows), and iteration relative to SGD alone. ``pred_*`` columns hold the
    cost model's prediction at ``predict_at`` ranks
    (:func:`experiments.bench.predict.paper_predictions`); ``None`` skips them.
    """
    from experiments.bench import predict

    everything, df = df, ok_rows(df)
    if df.empty:
        return pd.DataFrame()
    records = df.to_dict("records")
    predicted = predict.paper_predictions(records, predict_at) if predict_at else None
    rows = []
    for i, r in enumerate(records):
        algorithm, options = predict.row_strategy(r)
        costs = _costs(r)
        entry = {
            "model": r["model"],
            "label": r["label"],
            "setting": r["setting"],
            "P": int(r["world_size"]),
            "strategy": r["strategy"],
            # Rows read back from a CSV hold NaN where rows.json held nothing.
            "chosen": "" if pd.isna(r.get("configuration")) else str(r["configuration"] or ""),
            "algorithm": algorithm or "",
            "options": _options_text(options),
            "first_order": first_order(r),
            "iteration_ms": costs["iteration_ms"],
            "compute_ms": costs["compute"],
            "comm_ms": costs["comm"],
            "imbalance_ms": costs["imbalance_ms"],
            "grad_comm_ms": 1e3 * float(r.get("grad_comm_s", 0.0) or 0.0),
            "MB": costs["MB"],
            "grad_MB": float(r.get("bytes_grad_allreduce", 0) or 0) / 1e6,
            "total_wire_MB": sum(float(r.get(f"wire_{c}", 0) or 0) for c in predict.CATEGORIES)
            / 1e6,
            "memory_MiB": costs["memory"],
        }
        if predicted is not None:
            got = predicted[i]
            entry.update(
                pred_P=int(predict_at or 0),
                pred_iteration_ms=1e3 * got["iteration_s"],
                pred_compute_ms=1e3 * got["compute_s"],
                pred_comm_ms=1e3 * got["comm_s"],
                pred_grad_comm_ms=1e3 * got["grad_comm_s"],
                pred_MB=got["bytes_second_order"] / 1e6,
                pred_total_wire_MB=got["wire_bytes"] / 1e6,
                pred_memory_MiB=got["memory_bytes"] / MiB,
                pred_chosen=got["configuration"],
            )
        rows.append(entry)
    frame = pd.DataFrame(rows)
    group = ["model", "setting", "P"]
    for column in ("iteration_ms", "pred_iteration_ms"):
        if column in frame:
            ratio = over_sgd(frame, group, column)
            at = frame.columns.get_loc(column) + 1
            frame.insert(at, column.removesuffix("iteration_ms") + "vs_sgd", ratio)
    # Groups in order of first appearance, rows in the sweep's order within each.
    frame = frame.iloc[frame.groupby(group, sort=False).ngroup().argsort(kind="stable")]
    return with_spread(frame.reset_index(drop=True), vs_sgd_spread(everything), "P")


def _spread_texts(frame: pd.DataFrame) -> list[str]:
    """The ``vs SGD`` cells of a table: the median run's ratio and its range over runs."""
    return [
        ratio_text(r.vs_sgd, r.vs_sgd_min, r.vs_sgd_max, int(r.runs)) for r in frame.itertuples()
    ]


def write_ablation(df: pd.DataFrame, out: Path) -> dict[str, Path]:
    """``results/ablation.*``: each step from d_kfac to dp_kfac, measured and predicted."""
    where = _timing_machine(df, "ablation")
    frame = ablation_frame(df)
    predicted_p = int(frame["pred_P"].iloc[0]) if "pred_P" in frame and len(frame) else None
    baselines = []
    if not frame.empty:
        baselines = list(
            frame[frame["algorithm"].isin(takeaways.BASELINE_ALGORITHMS)]["strategy"].unique()
        )
    verdicts = iteration_verdicts(df, frame, baselines, "P")
    body: list[str] = []
    if not frame.empty:
        for (_, setting, p), g in frame.groupby(["model", "setting", "P"], sort=False):
            label = g["label"].iloc[0]
            show = g[["strategy", *[c for c in _ABLATION_MEASURED if c in g]]]
            show = show.rename(columns=_ABLATION_MEASURED).assign(**{"vs SGD": _spread_texts(g)})
            body += [f"## {label}, {setting} setting, measured at P={p}", ""]
            body += [to_markdown(show), ""]
            if predicted_p is None:
                continue
            # What a config chose for itself (grouped's "auto"), where any did.
            chose = g["pred_chosen"].astype(bool).any()
            head = ["strategy", "pred_chosen"] if chose else ["strategy"]
            show = g[[*head, *_ABLATION_PREDICTED]].rename(
                columns={**_ABLATION_PREDICTED, "pred_chosen": "chosen"}
            )
            body += [f"### Predicted at P={predicted_p} (`v100_ib100`, paper-size model)", ""]
            body += [to_markdown(show, {"vs SGD": 2}), ""]
        body += ["## Strategy configs", ""]
        for r in frame.drop_duplicates("strategy").itertuples():
            what = ", ".join(x for x in (r.algorithm, r.options) if x) or "no preconditioner (SGD)"
            body.append(f"- `{r.strategy}`: {what}")
        body += [
            "",
            "Every column (the (k, f) chosen at P=2, bytes, the gradient's MB, the "
            "imbalance): `ablation.csv`; the verdicts: `ablation_verdicts.csv`.",
        ]
    method = [
        "Measured here (medians over steps, busiest rank): iteration time (ms) and its ratio",
        "to SGD alone; compute = factor compute + decomposition + preconditioning;",
        "comm = factor, decomposition and preconditioned-gradient collectives (seconds, with",
        "a barrier before each phase's collectives when `isolate_comm` is on);",
        "grad comm = the gradient reduction; wire MB = what every collective, gradients",
        "included, puts on the wire per rank; memory = K-FAC state of the busiest rank (MiB);",
        "chosen = the (k, f) a `grouped` config chose for itself (`auto`) where one did.",
        "Every job ran several times (seeds): the median run is shown, and `vs SGD` carries",
        "in brackets the lowest and highest ratio over the runs, each run's ratio taken within",
        "that run. dp_kfac beats the baselines only where its range lies below the range of",
        "each run's cheapest baseline; where they overlap it is a tie.",
    ]
    if predicted_p is not None:
        method += [
            "Predicted tables: dpkfac.costmodel's prediction of the same strategy config at",
            f"P={predicted_p} on the `v100_ib100` preset (the papers' V100/InfiniBand cluster)",
            "with the paper-size model (`workload.paper` in conf/workload), amortised over the",
            "row's update intervals like the measurement; computed from shapes, so without a",
            "range. Options keep their meaning at that P (a `grad_worker_fraction` of `mem_opt`",
            "is 1/P there). The figure hatches predicted bars.",
        ]
    return _write(
        out,
        "ablation",
        frame,
        df,
        title="Ablation: from the published D-KFAC to DP-KFAC, one switch at a time",
        answer=[*takeaways.ablation(verdicts), where],
        body=body,
        method=method,
        figure=None if frame.empty else lambda: plots.ablation_bars(frame),
        extra={"verdicts": verdicts} if not verdicts.empty else None,
    )


# --------------------------------------------------------------- convergence
def convergence_frames(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per-epoch accuracy (long; the mean over seeds) and one row per run.

    Runs repeated over seeds differ by a few test images (on 360 digits one
    image is 0.28%), so accuracies are read as a mean over seeds with its
    standard deviation (:func:`convergence_summary`), never from one seed.
    """
    df = ok_rows(df, "convergence")
    df = df.assign(seed=df["seed"].fillna(0).astype(int) if "seed" in df else 0)
    run = ["strategy", "world_size", "seed"]
    points = [
        {**{k: r[k] for k in run}, **point}
        for r in df.to_dict("records")
        for point in json.loads(r["curve"])
    ]
    curves_df = pd.DataFrame(points)
    if points:
        curves_df = (
            curves_df.groupby(["strategy", "world_size", "epoch"], sort=False)
            .agg(
                test_acc=("test_acc", "mean"),
                test_acc_std=("test_acc", "std"),
                train_loss=("train_loss", "mean"),
                seconds=("seconds", "mean"),
                seeds=("seed", "nunique"),
            )
            .reset_index()
        )
    if df.empty:
        return curves_df, pd.DataFrame()
    outcome = [
        "epochs",
        "steps_per_epoch",
        "final_acc",
        "best_acc",
        "seconds",
        "replicas_identical",
    ]
    return curves_df, plots.in_order(df[[*run, *outcome]], run)


def convergence_summary(final: pd.DataFrame) -> pd.DataFrame:
    """Final accuracy per strategy and P over seeds: ``mean``, ``std`` (NaN for one), ``seeds``."""
    grouped = final.groupby(["strategy", "world_size"], sort=False)["final_acc"]
    return grouped.agg(mean="mean", std="std", seeds="count").reset_index()


def write_convergence(df: pd.DataFrame, out: Path) -> dict[str, Path]:
    """``results/convergence.*``: accuracy per epoch, final accuracy and smoke status.

    Accuracies of several machines may share the page (they differ by CPU kernels only
    in rounding), which its answer then says (:func:`experiments.bench.pages.machine_line`).
    """
    curves, final = convergence_frames(df)
    body: list[str] = []
    summary = pd.DataFrame()
    if not final.empty:
        summary = convergence_summary(final)
        summary.to_csv(out / "convergence_final.csv", index=False)
        texts = [takeaways.accuracy(r.mean, r.std, 4) for r in summary.itertuples()]
        pivot = summary.assign(text=texts).pivot(
            index="strategy", columns="world_size", values="text"
        )
        pivot = pivot.loc[plots.ordered(final["strategy"])]
        pivot.columns = [f"P={c}" for c in pivot.columns]
        seeds = int(summary["seeds"].max())
        body += [
            "## Final test accuracy",
            "",
            f"Mean ± standard deviation over {seeds} seeds (360 test images: one image is 0.0028)."
            if seeds > 1
            else "One seed per run (360 test images: one image is 0.0028).",
            "",
            to_markdown(pivot.reset_index()),
            "",
        ]
        runs = final.drop(columns=["epochs"]).rename(columns={"world_size": "P"})
        body += ["## Runs", "", to_markdown(runs, {"final_acc": 4, "best_acc": 4, "seconds": 1})]
    cases = smoke.smoke_cases(out / smoke.JUNIT)
    body += ["", "## Training presets: smoke status (2 steps on fake data)", ""]
    if cases.empty:
        body.append(
            f"No smoke report ({smoke.JUNIT} under the results folder): `make smoke-report` "
            "runs the training smoke tests, writes it and rewrites this table."
        )
    else:
        cases.to_csv(out / "convergence_smoke.csv", index=False)
        matrix = smoke.smoke_matrix(cases)
        body.append(to_markdown(smoke.smoke_summary(matrix) if not matrix.empty else cases, 1))
        counts = cases["status"].value_counts().to_dict()
        body += ["", "Cases: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))]
        body.append("Every case, per preset and strategy config: `convergence_smoke.csv`.")
    method = [
        "The default experiment (`experiment=digits_cnn`) trained by `experiments.train.run` on",
        "every rank with the preset's values: per-rank batch 32 (the global batch grows with P),",
        "lr 0.02 with one warm-up epoch, ×0.1 at epochs 6 and 9 of 10, damping 0.1. The",
        "learning rate is not scaled with the batch (`scale_lr: false`) and was tuned for no",
        "method, SGD (`none`) included: at P=4 SGD trains at a quarter of the steps with the",
        "P=1 learning rate. Tuned per configuration and P: `convergence_scale.md`. The figure's",
        "bands are ± one standard deviation over the seeds.",
    ]
    figure = None if curves.empty else lambda: plots.accuracy_curves(curves)
    return _write(
        out,
        "convergence",
        curves,
        df,
        title="Convergence on scikit-learn digits (DigitsCNN, test accuracy)",
        answer=[
            *takeaways.convergence(summary, final),
            machine_line(ok_rows(df, "convergence")),
        ],
        body=body,
        method=method,
        figure=figure,
    )


# -------------------------------------------------------------------- common
def write_table(name: str, rows: pd.DataFrame, results_dir: str | Path = "results") -> dict:
    """Keep ``rows`` as ``results/raw/<name>.csv`` and write the table's files."""
    measured = [n for n, t in TABLES.items() if t.kind == "measured"]
    if name not in measured:
        raise ValueError(f"unknown table {name!r}; expected one of {sorted(measured)}")
    out = Path(results_dir)
    (out / "raw").mkdir(parents=True, exist_ok=True)
    raw = out / "raw" / f"{name}.csv"
    rows.to_csv(raw, index=False)
    return {**TABLES[name].write(rows, out), "raw": raw}


class TableCallback(Callback):
    """Hydra callback of a table sweep: the finished sweep's rows become the table.

    Args:
        table: which table to write.
    """

    def __init__(self, table: str) -> None:
        self.table = table

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Collect ``rows.json`` from the sweep folder and write ``results/<table>.*``."""
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = load_rows([sweep_dir])
        if rows.empty:
            log.error("no rows under %s; table %s not written", sweep_dir, self.table)
            return
        try:
            paths = write_table(self.table, rows, config.get("results_dir", "results"))
        except MixedMachines as error:  # the rows are kept in raw/; the table is refused
            log.error("table %s not written: %s", self.table, error)
            return
        log.info("table %s: %s", self.table, ", ".join(str(p) for p in paths.values()))
        for line in failures(rows):
            log.warning("failed job: %s", line)


def main(argv: Sequence[str] | None = None) -> None:
    """Rewrite one table from saved rows (default: ``results/raw/<table>.csv``)."""
    parser = argparse.ArgumentParser(description="Write a table from benchmark rows.")
    parser.add_argument("table", choices=sorted(n for n, t in TABLES.items() if t.kind != "task"))
    parser.add_argument("--rows", nargs="*", help="sweep folders, rows.json or CSV files")
    parser.add_argument("--results", default="results", help="output folder")
    args = parser.parse_args(argv)
    if TABLES[args.table].kind == "predicted":  # from the configs alone: no rows to read
        paths = TABLES[args.table].write(Path(args.results))
    else:
        sources = args.rows or [Path(args.results) / "raw" / f"{args.table}.csv"]
        paths = write_table(args.table, load_rows(sources), args.results)
    print("\n".join(str(p) for p in paths.values()))


if __name__ == "__main__":
    main()
