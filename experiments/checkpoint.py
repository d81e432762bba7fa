"""Checkpoints that resume a run bitwise: writing, reading, and RNG state capture.

A checkpoint holds everything the next step depends on: model, optimizer,
preconditioner, LR-scheduler and (fp16) loss-scaler state, the step, every
rank's RNG states (python, numpy, torch, CUDA) and the world size. The data
order needs no state of its own: it is a function of (seed, epoch, step) (see
experiments.data.loading). Files are written to a temporary name and moved
into place with ``os.replace``, so a crash mid-write never leaves a truncated
checkpoint under the real name.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from experiments.config import ExperimentError, first_line

FORMAT_VERSION = 1
REQUIRED_KEYS = (
    "format",
    "step",
    "world_size",
    "strategy",
    "model",
    "optimizer",
    "scheduler",
    "preconditioner",
    "rng",
)


def capture_rng_state() -> dict[str, Any]:
    """This process's RNG states, as plain tensors, lists and numbers.

    numpy's state is stored as a tensor so that the checkpoint loads with
    ``torch.load(weights_only=True)``, which refuses arbitrary pickled objects.
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_save(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file in the same folder, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


#: ``trainer.resume`` value that continues the run folder's own last checkpoint, if any.
AUTO = "auto"
#: ``trainer.resume`` values (as written on a command line) that never resume.
_NEVER = frozenset({"null", "none", ""})


def resume_path(setting: str | None, output_dir: Path) -> Path | None:
    """The checkpoint ``trainer.resume`` asks for, or None to start fresh.

    ``auto`` is ``<output_dir>/checkpoints/last.pt`` when that exists (a run
    restarted in its own folder, e.g. by torchrun after a failure) and None
    otherwise; ``null`` is None; anything else is a path, which must exist
    (:func:`load_checkpoint` says so otherwise).
    """
    if setting is None or str(setting).lower() in _NEVER:
        return None
    if setting == AUTO:
        last = output_dir / "checkpoints" / "last.pt"
        # A dangling last.pt is not "no checkpoint": load_checkpoint names it.
        return last if last.exists() or last.is_symlink() else None
    return Path(setting)


def load_checkpoint(path: str | Path, world_size: int, strategy: str) -> dict[str, Any]:
    """Read a checkpoint and check that this run can continue from it.

    Args:
        path: The checkpoint file.
        world_size: This run's number of ranks. Another world size is accepted
            (an elastic restart with fewer or more workers): the caller then
            continues without a bitwise guarantee, since the data shards, the
            per-rank RNG streams and the layer ownership all depend on it.
        strategy: This run's strategy name (``none`` for first order), which must
            match: the preconditioner state of one does not fit another.

    Returns:
        The checkpoint dictionary (tensors on the CPU).

    Raises:
        ExperimentError: The file is missing, unreadable or incompatible; the
            message names the file.
    """
    path = Path(path)
    if not path.is_file():
        raise ExperimentError(f"cannot resume: checkpoint file {path} does not exist")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for damaged files
        raise ExperimentError(
            f"cannot resume: checkpoint file {path} is corrupt or not a checkpoint "
            f"({type(exc).__name__}: {first_line(exc, '')})"
        ) from None
    missing = [k for k in REQUIRED_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise ExperimentError(
            f"cannot resume: checkpoint file {path} is corrupt or not a checkpoint "
            f"(missing {', '.join(missing)})"
        )
    if ckpt["format"] != FORMAT_VERSION:
        raise ExperimentError(
            f"cannot resume: checkpoint file {path} has format {ckpt['format']}, "
            f"this code reads format {FORMAT_VERSION}"
        )
    del world_size  # see the docstring: the caller handles another world size
    if ckpt["strategy"] != strategy:
        raise ExperimentError(
            f"cannot resume: checkpoint file {path} was written with strategy "
            f"{ckpt['strategy']!r}, this run uses {strategy!r}"
        )
    return ckpt


class CheckpointDir:
    """The run's checkpoint folder: numbered files, a ``last.pt`` link, pruning.

    Args:
        root: Folder to write into (created on first save).
        keep: How many numbered checkpoints to keep; older ones are deleted.
    """

    def __init__(self, root: Path, keep: int) -> None:
        self.root = root
        self.keep = keep

    def path_for(self, step: int) -> Path:
        """Where the checkpoint of ``step`` goes."""
        return self.root / f"step_{step:09d}.pt"

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write ``state`` as the checkpoint of ``step``; point ``last.pt`` at it."""
        path = self.path_for(step)
        atomic_save(state, path)
        link = self.root / "last.pt"
        tmp_link = self.root / ".last.pt.tmp"
        tmp_link.unlink(missing_ok=True)
        tmp_link.symlink_to(path.name)
        os.replace(tmp_link, link)
        for old in sorted(self.root.glob("step_*.pt"))[: -self.keep]:
            old.unlink(missing_ok=True)
        return path
