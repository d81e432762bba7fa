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
    failures,
    first_order,
    footer,
    ok_rows,
    ratio_text,
    to_markdown,
    with_takeaway,
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


def vs_sgd_spread(df: pd.DataFrame) -> pd.DataFrame:
    """Iteration time over SGD's, per job and strategy config, across the repeated runs.

    Each run's ratio is taken within that run (its K-FAC row over its own
    first-order row, both measured in turns under one load), so the spread is
    that of the ratio a table prints, not of absolute times. Returns one row
    per (``JOB``, ``strategy``) with ``vs_sgd_min``, ``vs_sgd_max``, ``runs``
    (the number of runs with both rows) and ``first_order`` (SGD's own row);
    empty without first-order rows.
    """
    if df.empty:
        return pd.DataFrame()
    rows = df[(df["error"] == "") & (df.get("task", "timing") == "timing")].copy()
    rows["seed"] = rows["seed"].fillna(-1) if "seed" in rows else -1
    rows["first_order"] = [first_order(r) for r in rows.to_dict("records")]
    if not rows["first_order"].any():
        return pd.DataFrame()
    rows["ratio"] = over_sgd(rows, [*JOB, "seed"], "iteration_s")
    out = rows.dropna(subset=["ratio"]).groupby([*JOB, "strategy"], dropna=False, sort=False)
    return out.agg(
        vs_sgd_min=("ratio", "min"),
        vs_sgd_max=("ratio", "max"),
        runs=("ratio", "count"),
        first_order=("first_order", "first"),
    ).reset_index()


def with_spread(frame: pd.DataFrame, spread: pd.DataFrame, p_column: str) -> pd.DataFrame:
    """``frame`` with :func:`vs_sgd_spread`'s columns joined on its job and strategy.

    ``p_column`` names the frame's world-size column (tables call it ``P`` or
    ``world_size``). Rows without repeats get NaN bounds and ``runs`` 1.
    """
    if spread.empty or frame.empty:
        return frame.assign(vs_sgd_min=float("nan"), vs_sgd_max=float("nan"), runs=1)
    right = spread.drop(columns="first_order").rename(columns={"world_size": p_column})
    right[p_column] = right[p_column].astype(frame[p_column].dtype)
    joined = frame.merge(right, on=["model", "setting", p_column, "strategy"], how="left")
    joined["runs"] = joined["runs"].fillna(1).astype(int)
    return joined


def _write(
    out: Path,
    name: str,
    frame: pd.DataFrame,
    md: list[str],
    rows: pd.DataFrame,
    takeaway: list[str],
    figure: Callable[[], Figure] | None,
    extra: Mapping[str, pd.DataFrame] | None = None,
) -> dict[str, Path]:
    """A table's files: ``frame`` as ``<name>.csv`` (each ``extra`` frame as
    ``<name>_<key>.csv``), ``md`` with its takeaway and the rows' footer as
    ``<name>.md``, and the ``figure`` (if any) as ``<name>.png``."""
    paths = {"csv": out / f"{name}.csv"}
    frame.to_csv(paths["csv"], index=False)
    for key, extra_frame in (extra or {}).items():
        paths[key] = out / f"{name}_{key}.csv"
        extra_frame.to_csv(paths[key], index=False)
    paths["md"] = write_page(out / f"{name}.md", with_takeaway([*md, *footer(rows)], takeaway))
    if figure is not None:
        paths["png"] = plots.save(figure(), out / f"{name}.png")
    return paths


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


def compute_ratio_spread(df: pd.DataFrame) -> pd.DataFrame:
    """Each strategy's K-FAC computation over dp_kfac's, per run, and its range over runs.

    Byte and memory ratios are exact; the computation is timed, so a job repeated
    over seeds gives one ratio per run (both rows of that run). Returns one row per
    (model, P, setting, strategy) with ``compute/dp_min``, ``compute/dp_max`` and
    ``runs``; empty where no job was repeated.
    """
    rows = df[(df["error"] == "") & (df.get("task", "timing") == "timing")]
    if rows.empty or "seed" not in rows or rows["seed"].nunique(dropna=False) < 2:
        return pd.DataFrame()
    out = []
    keys = ["model", "world_size", "setting"]
    for (model, p, setting, _), run in rows.groupby([*keys, "seed"], sort=False, dropna=False):
        by = {r["strategy"]: _costs(r)["compute"] for r in run.to_dict("records")}
        if base := by.get(REFERENCE):
            out += [(model, p, setting, strategy, cost / base) for strategy, cost in by.items()]
    frame = pd.DataFrame(out, columns=["model", "P", "setting", "strategy", "ratio"])
    grouped = frame.groupby(["model", "P", "setting", "strategy"], sort=False)["ratio"]
    return grouped.agg(
        **{"compute/dp_min": "min", "compute/dp_max": "max", "runs": "count"}
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


def write_second_order_update(df: pd.DataFrame, out: Path) -> dict[str, Path]:
    """``results/second_order_update.*``: the headline ratios and the absolute costs."""
    long, head = second_order_frames(df)
    spread = compute_ratio_spread(df)
    if not spread.empty:
        job = ["model", "P", "setting"]
        long = long.merge(spread, on=[*job, "strategy"], how="left")
        best = long[long["strategy"].isin(COMPARED)].sort_values("compute/dp")
        best = best.drop_duplicates(job)[[*job, "compute/dp_min", "compute/dp_max", "runs"]]
        best = best.rename(columns=lambda c: c.replace("compute/", "compute_best/"))
        head = head.merge(best, on=job, how="left")
    memory = ("memory", "process_memory", "pred_process_memory")
    renamed = {"compute": "compute_ms", "comm": "comm_ms", **{c: f"{c}_MiB" for c in memory}}
    long = long.rename(columns=renamed)
    md = [
        "# Cost of one second-order update (factors and decompositions every step)",
        "",
        f"Ratios > 1 mean {REFERENCE} is cheaper. `best` is the cheapest of the baselines "
        f"measured ({', '.join(s for s in COMPARED if f'compute_{s}/dp' in head.columns)}).",
        "computation = factor compute + decomposition + preconditioning (busiest rank);",
        "communication = factor, decomposition and preconditioned-gradient collectives",
        "(seconds and MB per rank; with `isolate_comm` the ranks meet at a barrier first, so",
        "the seconds are transfers and the wait for slower ranks is `imbalance_ms`);",
        "memory = K-FAC state of the busiest rank; process_memory = that rank's whole process",
        "as measured between steps (parameters, gradients, SGD momentum, module buffers and",
        "K-FAC state: `dpkfac.process_memory`; – where the rows predate it);",
        "pred_process_memory = the cost model's prediction of that tally plus its activation",
        "estimate (the inputs and outputs of the K-FAC layers, a lower bound:",
        "`dpkfac.costmodel.memory`).",
        "",
        to_markdown(head),
        "",
        "## Absolute values (medians over measured steps, busiest rank)",
        "",
        to_markdown(long.drop(columns=["label"]), {"P": 0}),
    ]
    figure = None if head.empty else lambda: plots.ratio_bars(head)
    takeaway = takeaways.second_order_update(head)
    return _write(out, "second_order_update", long, md, df, takeaway, figure)


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


def write_time_breakdown(df: pd.DataFrame, out: Path) -> dict[str, Path]:
    """``results/time_breakdown.*``: per-phase milliseconds and the stacked bars."""
    wide = breakdown_frame(df)
    md = [
        "# Time breakdown of one iteration (ms, medians over steps, busiest rank per phase)",
        "",
        "forward/backward excludes what is timed inside the hooks (factor computation, and",
        "with `dp_kfac_overlap` the reductions, decompositions, preconditioning and broadcasts",
        "it runs in the backward pass), so the parts add up to the iteration;",
        "`practical` is amortised per step at factors every 10 and decompositions every 100 steps.",
        "`sum` adds the parts; `iteration` is the measured wall time per step.",
        "Each job ran several times (seeds): the median run is shown, and `vs SGD` carries in",
        "brackets the lowest and highest ratio over the runs, each taken within its run.",
    ]
    # Barriers before collectives exist only in isolated runs (``isolate_comm``).
    isolated = "comm_sync_ms" in wide and bool(wide["comm_sync_ms"].any())
    parts = [p for p in ITERATION_PARTS if p != "comm_sync" or isolated]
    for (setting, _), frame in wide.groupby(["setting", "model"], sort=False):
        cols = ["strategy", *[f"{p}_ms" for p in parts], "sum_ms", "iteration_ms"]
        show = frame[cols].rename(columns={f"{p}_ms": p for p in (*parts, "sum", "iteration")})
        show["vs SGD"] = _spread_texts(frame)
        p = int(frame["world_size"].iloc[0])
        md += ["", f"## {frame['label'].iloc[0]}, {setting} setting, P={p}", ""]
        md.append(to_markdown(show, 1))
    figure = None if wide.empty else lambda: plots.stacked_breakdown(wide, parts)
    return _write(out, "time_breakdown", wide, md, df, takeaways.time_breakdown(wide), figure)


# ------------------------------------------------------------------- scaling
def write_scaling(df: pd.DataFrame, out: Path) -> dict[str, Path]:
    """``results/scaling.*``: measured and predicted times against P, and the model's error."""
    from experiments.bench import predict

    frame, errors, notes = predict.scaling_frames(ok_rows(df))
    md = ["# Scaling with the number of ranks", "", *notes, ""]
    if not frame.empty:
        pivot = frame.pivot_table(
            index=["model", "strategy", "source"], columns="world_size", values="iteration_ms"
        ).reset_index()
        pivot.columns = [c if isinstance(c, str) else f"P={c}" for c in pivot.columns]
        md += ["## Iteration time (ms)", "", to_markdown(pivot, 1)]
    if not errors.empty:
        md += ["", "## Cost model: measured vs predicted per phase (calibrated model)", ""]
        md += ["Median absolute error over models and strategies:", ""]
        md.append(to_markdown(predict.error_summary(errors), {"world_size": 0, "P": 0}))
        md += ["", "<details><summary>Every measured row</summary>", ""]
        md += [to_markdown(errors, {"world_size": 0}), "", "</details>"]
    figure = None if frame.empty else lambda: plots.scaling_lines(frame)
    extra = {} if errors.empty else {"errors": errors}
    return _write(out, "scaling", frame, md, df, takeaways.scaling(errors), figure, extra)


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
    "MB": "MB",
    "total_wire_MB": "wire MB",
    "memory_MiB": "memory",
}
#: Predicted columns of the ablation's markdown: the measured ones but the gradient
#: communication (headers get the predicted P).
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
    frame = ablation_frame(df)
    predicted_p = int(frame["pred_P"].iloc[0]) if "pred_P" in frame and len(frame) else None
    md = [
        "# Ablation: from the published D-KFAC to DP-KFAC, one switch at a time",
        "",
        "Measured here (medians over steps, busiest rank): iteration time and its ratio to",
        "SGD alone; computation = factor compute + decomposition + preconditioning;",
        "comm = factor, decomposition and preconditioned-gradient collectives (seconds, with",
        "a barrier before each phase's collectives when `isolate_comm` is on, and MB per rank);",
        "grad comm = the gradient reduction; wire MB = what every collective, gradients",
        "included, puts on the wire per rank; memory = K-FAC state of the busiest rank (MiB);",
        "chosen = the (k, f) a `grouped` config chose for itself (`auto`) where one did.",
        "Where the job was run several times (seeds), the median run is shown and `vs SGD`",
        "carries in brackets the lowest and highest ratio over the runs, each run's ratio",
        "taken within that run.",
    ]
    if predicted_p is not None:
        md += [
            f"`P={predicted_p}` columns: dpkfac.costmodel's prediction of the same strategy",
            f"config at P={predicted_p} on the `v100_ib100` preset (the papers' V100/InfiniBand",
            "cluster) with the paper-size model (`workload.paper` in conf/workload), amortised",
            "over the row's update intervals like the measurement. Options keep their meaning",
            "at that P (a `grad_worker_fraction` of `mem_opt` is 1/P there).",
        ]
    if not frame.empty:
        for (_, setting, p), g in frame.groupby(["model", "setting", "P"], sort=False):
            # What a config chose for itself (grouped's "auto"), where any did.
            predicted_choice = g.get("pred_chosen", g["chosen"])
            chose = g["chosen"].astype(bool).any() or predicted_choice.astype(bool).any()
            head = ["strategy", "chosen"] if chose else ["strategy"]
            measured = [c for c in _ABLATION_MEASURED if c in g]
            show = g[[*head, *measured]].rename(columns=_ABLATION_MEASURED)
            show["vs SGD"] = _spread_texts(g)
            if predicted_p is not None:
                for column, header in _ABLATION_PREDICTED.items():
                    show[f"P={predicted_p} {header}"] = g[column].to_numpy()
                if chose:
                    show[f"P={predicted_p} chosen"] = g["pred_chosen"].to_numpy()
            md += ["", f"## {g['label'].iloc[0]}, {setting} setting, measured at P={p}", ""]
            md.append(to_markdown(show, {"vs SGD": 2, f"P={predicted_p} vs SGD": 2}))
        md += ["", "## Strategy configs", ""]
        for r in frame.drop_duplicates("strategy").itertuples():
            what = ", ".join(x for x in (r.algorithm, r.options) if x) or "no preconditioner (SGD)"
            md.append(f"- `{r.strategy}`: {what}")
    figure = None if frame.empty else lambda: plots.ablation_bars(frame)
    return _write(out, "ablation", frame, md, df, takeaways.ablation(frame), figure)


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
    """``results/convergence.*``: accuracy per epoch, final accuracy and smoke status."""
    curves, final = convergence_frames(df)
    md = ["# Convergence on scikit-learn digits (DigitsCNN, test accuracy)", ""]
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
        md += [
            "## Final test accuracy",
            "",
            f"Mean ± standard deviation over {seeds} seeds (360 test images: one image is 0.0028)."
            if seeds > 1
            else "One seed per run (360 test images: one image is 0.0028).",
            "",
            to_markdown(pivot.reset_index()),
            "",
        ]
        md += ["## Runs", "", to_markdown(final, {"final_acc": 4, "best_acc": 4, "seconds": 1})]
    cases = smoke.smoke_cases(out / smoke.JUNIT)
    md += ["", "## Training presets: smoke status (2 steps on fake data)", ""]
    if cases.empty:
        md.append(
            f"No smoke report ({smoke.JUNIT} under the results folder): `make smoke-report` "
            "runs the training smoke tests, writes it and rewrites this table."
        )
    else:
        cases.to_csv(out / "convergence_smoke.csv", index=False)
        matrix = smoke.smoke_matrix(cases)
        md.append(to_markdown(matrix if not matrix.empty else cases, 1))
        counts = cases["status"].value_counts().to_dict()
        md += ["", "Cases: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))]
    figure = None if curves.empty else lambda: plots.accuracy_curves(curves)
    return _write(out, "convergence", curves, md, df, takeaways.convergence(summary, final), figure)


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
        paths = write_table(self.table, rows, config.get("results_dir", "results"))
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
