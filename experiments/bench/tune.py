"""The convergence study's driver: it trains what the tuning protocol asks for, until all is done.

    python -m experiments.bench.tune                       # the whole study (many hours)
    python -m experiments.bench.tune --dry-run             # what would run next, and why
    python -m experiments.bench.tune convergence_scale.study.experiments=[mnist1d_mlp]

Every finished run is appended to ``--rows`` (results/raw/convergence_scale.csv) at once,
so the study survives a crash or a stop and continues where it was: the protocol
(:mod:`experiments.bench.tuning`) is a function of the rows alone. Several drivers may
share one rows file (one per core): a run is claimed by creating its folder under
``--workdir``, and a claim whose process is gone is taken over. The table is then
written from the rows by ``python -m experiments.bench.tables convergence_scale --rows
...``.

Long sweeps belong in a worktree of their own at a fixed commit, so that work on the
main checkout cannot change a running sweep's code or conf/ (docs/reproduction.md).
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.bench.tuning import CellPlan, Point, pending, plan_study

log = logging.getLogger(__name__)


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
        if _alive(owner):
            return None  # another live driver's run; a dead driver's is taken over
    owner.write_text(str(os.getpid()))
    return folder


def _alive(owner: Path) -> bool:
    """Whether the process named in a claim file still runs (False: unreadable or gone)."""
    try:
        os.kill(int(owner.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


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
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=4 * 3600.0,
        help="collective timeout of every run (default 4 h): a run paused (SIGSTOP) while "
        "something else is timed would otherwise fail when it resumes; a deadlock of the "
        "in-process ranks is still reported at once",
    )
    parser.add_argument("overrides", nargs="*", help="benchmark overrides for every run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.overrides = [f"timeout_s={args.timeout_s!r}", *args.overrides]
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
