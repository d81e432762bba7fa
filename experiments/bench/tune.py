"""The convergence study's driver: it trains what the tuning protocol asks for, until nothing is left.

    python -m experiments.bench.tune                       # the whole study (many hours)
    python -m experiments.bench.tune --dry-run             # what would run next, and why
    python -m experiments.bench.tune convergence_scale.study.experiments=[mnist1d_mlp]

Every finished run is appended to ``--rows`` (results/raw/convergence_scale.csv) at once,
so the study survives a crash or a stop and continues where it was: the protocol
(:mod:`experiments.bench.tuning`) is a function of the rows alone. Several drivers may
share one rows file (one per core): a run is claimed by creating its folder under
``--workdir``, and a claim whose process is gone is taken over. The table is then
written from the rows by ``python -m experiments.bench.tables convergence_scale --rows
...`` (or ``--write`` here at the end).

Long sweeps belong in a worktree of their own at a fixed commit, so that work on the
main checkout cannot change a running sweep's code or conf/ (docs/reproduction.md).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.bench.tuning import (
    SGD,
    CellPlan,
    Outcome,
    Planner,
    Point,
    Protocol,
    pending,
    point_key,
)

log = logging.getLogger(__name__)

#: Columns that decide whether two runs are the same run, bitwise (the same-step check).
FINGERPRINT = ("curve", "final_acc", "final_val_acc")


def study_cells(node: Mapping[str, Any]) -> list[tuple[str, str, int]]:
    """The study's cells (model, configuration, P) in the order their runs are taken:
    experiments, then world sizes in the order listed (the damping-tuning sizes first, so
    the others can start), then configurations; ``max_world_size`` caps an experiment."""
    study = node["study"]
    limits = node.get("max_world_size") or {}
    return [
        (str(m), str(s), int(p))
        for m in study["experiments"]
        for p in study["world_sizes"]
        if int(p) <= int(limits.get(m, p))
        for s in study["strategies"]
    ]


def outcome(row: Mapping[str, Any], protocol: Protocol) -> Outcome:
    """What the protocol reads of a row: a failed or diverged run scores nothing.

    Diverged: the run's last training loss is not finite, or its final validation
    accuracy is within ``chance_margin`` of chance.
    """
    error = str(row.get("error") or "")
    if error and error != "nan":
        return Outcome(math.nan, True, f"failed: {error[:120]}")
    val = float(row.get("final_val_acc", math.nan))
    curve = json.loads(row["curve"]) if isinstance(row.get("curve"), str) else []
    loss = float(curve[-1].get("train_loss", math.nan)) if curve else math.nan
    fingerprint = json.dumps([str(row.get(k)) for k in FINGERPRINT])
    if not math.isfinite(loss) and curve:
        return Outcome(val, True, "non-finite training loss", fingerprint)
    if not math.isfinite(val) or val <= protocol.chance + protocol.chance_margin:
        return Outcome(val, True, f"validation accuracy {val:.3f} at chance", fingerprint)
    return Outcome(val, False, "", fingerprint)


def read_results(rows: Iterable[Mapping[str, Any]], protocol: Protocol) -> dict[tuple, Outcome]:
    """Outcomes by run (the latest row of a run wins: rows are appended in time order)."""
    out: dict[tuple, Outcome] = {}
    for row in rows:
        if row.get("task") != "convergence_scale" or "damping" not in row:
            continue
        damping = float(row["damping"]) if row["damping"] == row["damping"] else math.nan
        key = point_key(
            row["model"],
            row["strategy"],
            int(row["world_size"]),
            float(row["lr_multiplier"]),
            math.nan if str(row["strategy"]) == SGD else damping,
            int(row["seed"]),
        )
        out[key] = outcome(row, protocol)
    return out


def load_rows(path: Path) -> list[dict[str, Any]]:
    import pandas as pd

    if not path.exists() or path.stat().st_size == 0:
        return []
    return pd.read_csv(path).to_dict("records")


def append_rows(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """Append rows to the CSV under a lock, keeping one header (new columns: rewritten)."""
    import pandas as pd

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = pd.read_csv(path) if path.exists() and path.stat().st_size else pd.DataFrame()
        new = pd.DataFrame(list(rows))
        frame = pd.concat([old, new], ignore_index=True) if len(old) else new
        tmp = path.with_suffix(".tmp")
        frame.to_csv(tmp, index=False)
        os.replace(tmp, path)  # atomic: a crash mid-write loses nothing


def _claim(workdir: Path, point: Point) -> Path | None:
    """The run's folder, created by this process (None: another live driver has it)."""
    name = "_".join(str(v) for v in point.key()).replace("/", "-")
    folder = workdir / name
    owner = folder / "claimed_by"
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        try:
            pid = int(owner.read_text())
            os.kill(pid, 0)
            return None  # alive: its run
        except (OSError, ValueError):
            pass  # its driver is gone: take it over
    owner.write_text(str(os.getpid()))
    return folder


def job_overrides(point: Point) -> list[str]:
    """The benchmark overrides of one run of the study."""
    overrides = [
        "table=convergence_scale",
        f"convergence_scale.experiment={point.model}",
        f"strategy={point.strategy}",
        f"world_size={point.world_size}",
        f"seed={point.seed}",
        f"convergence_scale.lr_multiplier={point.lr_multiplier!r}",
    ]
    if point.damping == point.damping:
        overrides.append(f"convergence_scale.damping={point.damping!r}")
    return overrides


def run_point(point: Point, overrides: Sequence[str], folder: Path) -> list[dict[str, Any]]:
    """Train one point (every rank a thread of this process); its row, or an error row."""
    from experiments.bench import run
    from experiments.config import compose_config, first_line

    cfg = compose_config("benchmark", [*job_overrides(point), *overrides])
    try:
        rows = run.run(cfg, output_dir=folder)
    except Exception as err:  # recorded, so the protocol sees the point as failed
        log.exception("tune: %s failed", point)
        rows = [
            {
                "task": "convergence_scale",
                "model": point.model,
                "strategy": point.strategy,
                "world_size": point.world_size,
                "lr_multiplier": point.lr_multiplier,
                "damping": point.damping,
                "seed": point.seed,
                "error": f"{type(err).__name__}: {first_line(err, '')[:300]}",
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
        ]
    for row in rows:
        row["stage"] = point.stage
    return rows


def plan_study(
    node: Mapping[str, Any], rows: Iterable[Mapping[str, Any]]
) -> tuple[Protocol, list[CellPlan]]:
    """The protocol and every cell's plan, given the rows so far."""
    protocol = Protocol.from_config(node["tuning"])
    planner = Planner(
        protocol,
        read_results(rows, protocol),
        same_step=node.get("same_step") or {},
        one_rank_kfac=node.get("one_rank_kfac"),
    )
    return protocol, planner.plan(study_cells(node))


def describe(plans: Sequence[CellPlan]) -> list[str]:
    """One line per cell: chosen, waiting, or what it runs next."""
    lines = []
    for c in plans:
        head = f"{c.model} {c.strategy} P={c.world_size}:"
        if c.done:
            state = f"failed ({c.failed})" if c.failed else f"chosen {c.chosen}"
            state += f" = {c.stand_in_for}'s" if c.stand_in_for else ""
        elif c.waiting_for:
            state = f"waiting for {c.waiting_for}"
        else:
            state = "next " + ", ".join(
                f"x{p.lr_multiplier:g} d={p.damping:g} s{p.seed} ({p.stage})" for p in c.pending
            )
        lines.append(f"{head} {state}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    from omegaconf import OmegaConf

    from experiments.config import compose_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=Path, default=Path("results/raw/convergence_scale.csv"))
    parser.add_argument("--workdir", type=Path, default=Path("outputs/tune"))
    parser.add_argument("--max-runs", type=int, default=None, help="stop after this many runs")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and stop")
    parser.add_argument("--write", type=Path, default=None, help="write the table here at the end")
    parser.add_argument("overrides", nargs="*", help="benchmark overrides for every run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = compose_config("benchmark", ["table=convergence_scale", *args.overrides])
    node = OmegaConf.to_container(cfg.convergence_scale, resolve=True)
    assert isinstance(node, dict)
    done = 0
    while args.max_runs is None or done < args.max_runs:
        _, plans = plan_study(node, load_rows(args.rows))
        todo = pending(plans)
        if args.dry_run:
            print("\n".join(describe(plans)))
            print(f"{len(todo)} run(s) can start now")
            return 0
        if not todo:
            if all(c.done for c in plans):
                log.info("tune: every cell is done")
                break
            log.info("tune: waiting for other drivers' runs")
            time.sleep(60)
            continue
        for point in todo:
            folder = _claim(args.workdir, point)
            if folder is not None:
                break
        else:
            time.sleep(60)  # every runnable point is another driver's
            continue
        log.info("tune: %s", point)
        append_rows(args.rows, run_point(point, args.overrides, folder))
        done += 1
    if args.write is not None:
        import pandas as pd

        from experiments.bench.convergence_scale import write_convergence_scale

        write_convergence_scale(pd.DataFrame(load_rows(args.rows)), args.write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
