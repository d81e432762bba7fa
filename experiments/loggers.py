"""Experiment trackers: W&B (default, offline unless asked) and a no-op.

Only rank 0 gets a real logger; the trainer hands the others a
:class:`NullLogger`, so no code path needs to ask which rank it is on.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class NullLogger:
    """Discards everything (``logger=none``, and every rank but 0)."""

    def __init__(self, **_: Any) -> None:
        pass

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record ``metrics`` at ``step`` (here: do nothing)."""

    def finish(self) -> None:
        """Close the run."""


class WandbLogger(NullLogger):
    """Weights & Biases run; offline by default so runs never need the network.

    Offline runs are written under ``<dir>/wandb`` and can be uploaded later with
    ``wandb sync``.

    Args:
        project: W&B project.
        mode: ``offline``, ``online`` or ``disabled``.
        entity: W&B entity (team or user); None for the default.
        group: Run group, e.g. to gather the ranks of a sweep.
        tags: Run tags.
        name: Run name.
        dir: Folder for W&B's files (the run's output folder).
        run_config: The resolved configuration, stored with the run.
    """

    def __init__(
        self,
        project: str,
        mode: str = "offline",
        entity: str | None = None,
        group: str | None = None,
        tags: Sequence[str] = (),
        name: str | None = None,
        dir: str | Path | None = None,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        import wandb

        if dir is not None:
            Path(dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project,
            mode=mode,
            entity=entity,
            group=group,
            tags=list(tags),
            name=name,
            dir=str(dir) if dir is not None else None,
            config=dict(run_config) if run_config is not None else None,
            reinit="finish_previous",
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Send ``metrics`` at ``step`` to the W&B run."""
        self._run.log(dict(metrics), step=step)

    def finish(self) -> None:
        """Flush and close the W&B run."""
        self._run.finish()


def flatten_stats(prefix: str, stats: Mapping[str, Any]) -> dict[str, float]:
    """Turn nested statistics (``comm_stats()`` and friends) into flat metric names.

    ``{"grad_allreduce": {"bytes": 8}}`` with prefix ``kfac/comm`` becomes
    ``{"kfac/comm/grad_allreduce/bytes": 8.0}``.
    """
    flat: dict[str, float] = {}
    for key, value in stats.items():
        name = f"{prefix}/{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_stats(name, value))
        else:
            flat[name] = float(value)
    return flat


def fidelity_metrics(values: Mapping[str, Mapping[str, Any]], step: int) -> dict[str, float]:
    """Metric names of the curvature-fidelity probe's values of one probe step.

    ``pre.fidelity()`` (``{layer: {"cosine", "rel_error", "step"}}``) becomes
    ``{"fidelity/<layer>/cosine": c, "fidelity/<layer>/rel_error": e}`` for the
    layers probed at ``step``; layers last probed earlier are left out.
    """
    return {
        f"fidelity/{layer}/{key}": float(entry[key])
        for layer, entry in values.items()
        if entry.get("step") == step
        for key in ("cosine", "rel_error")
    }


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` as JSON through a temporary file, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
