"""A Hydra callback that tabulates a finished sweep: ``summary.csv`` and ``summary.md``.

A sweep (``python -m experiments.train -m strategy=dp_kfac,d_kfac ...``) leaves
one folder per job, each with its ``metrics.json`` and ``.hydra/overrides.yaml``.
At the end of the sweep this callback writes one row per job into the sweep
folder: the job's overrides, its final metrics, wall time, and the K-FAC figures
(bytes handed to collectives per step, K-FAC memory). Under torchrun every rank
runs the callback; rank 0 alone writes.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

#: Columns shown first, in this order (the rest follow alphabetically).
FIRST = (
    "job",
    "overrides",
    "strategy",
    "world_size",
    "primary_metric",
    "metric",
    "steps",
    "wall_time_s",
    "kfac_bytes_per_step",
    "kfac_memory_mib",
)


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job folder of ``sweep_dir`` that wrote ``metrics.json`` (job order)."""
    rows = []
    for metrics in sweep_dir.glob("*/metrics.json"):
        job_dir = metrics.parent
        final = json.loads(metrics.read_text())["final"]
        overrides_file = job_dir / ".hydra" / "overrides.yaml"
        overrides = OmegaConf.load(overrides_file) if overrides_file.exists() else []
        number = job_dir.name.split("_", 1)[0]
        row = {
            "job": int(number) if number.isdigit() else job_dir.name,
            "overrides": " ".join(str(o) for o in overrides),
            **final,
        }
        row["metric"] = final.get(final.get("primary_metric", ""), None)
        rows.append(row)
    return sorted(rows, key=lambda r: (not isinstance(r["job"], int), r["job"]))


def write_summary(sweep_dir: Path) -> list[dict[str, Any]]:
    """Write ``summary.csv`` and ``summary.md`` into ``sweep_dir``; returns the rows."""
    import pandas as pd

    from experiments.bench.tables import to_markdown

    rows = collect(sweep_dir)
    if not rows:
        return rows
    frame = pd.DataFrame(rows)
    columns = [c for c in FIRST if c in frame] + sorted(c for c in frame if c not in FIRST)
    frame = frame[columns]
    frame.to_csv(sweep_dir / "summary.csv", index=False)
    shown = frame[[c for c in FIRST if c in frame]]
    best = max(rows, key=lambda r: r["metric"] if isinstance(r["metric"], float) else -1e30)
    lines = [
        f"# Sweep {sweep_dir.name}",
        "",
        f"{len(rows)} job(s). Best {best.get('primary_metric')}: {best['metric']} "
        f"(job {best['job']}: {best['overrides']}).",
        "",
        to_markdown(shown, 4),
        "",
    ]
    (sweep_dir / "summary.md").write_text("\n".join(lines))
    return rows


class SweepSummary(Callback):
    """Hydra callback: ``on_multirun_end`` writes the sweep's summary (rank 0 only)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if os.environ.get("RANK", "0") != "0":
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        rows = write_summary(sweep_dir)
        if rows:
            log.info("sweep summary: %s (%d jobs)", sweep_dir / "summary.md", len(rows))
