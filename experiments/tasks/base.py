"""The task interface and the distributed evaluation loop shared by all tasks.

A task turns a batch into a training loss, and a model's outputs on held-out
batches into picklable prediction records; after all ranks' records are
gathered, it scores them with a library metric. Keeping the gather in one
place means each task's scoring code sees the whole evaluation set, exactly
once, whatever the world size.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from experiments.distributed import DistEnv, unwrap


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


class Task(abc.ABC):
    """Loss, predictions and scores for one kind of problem."""

    #: The metric that summarises a run (returned by the entry point for sweeps).
    primary_metric: ClassVar[str]

    @abc.abstractmethod
    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The scalar loss of ``batch``, averaged over its examples."""

    @abc.abstractmethod
    def predict(self, model: nn.Module, batch: Any) -> list[Any]:
        """Picklable prediction records for an evaluation batch (on the CPU)."""

    @abc.abstractmethod
    def score(self, records: list[Any]) -> dict[str, float]:
        """Metrics over the records of the whole evaluation set."""


@torch.no_grad()
def evaluate(task: Task, model: nn.Module, loader: Iterable[Any], env: DistEnv) -> dict[str, float]:
    """Score ``model`` on every rank's evaluation shard; every rank gets the result.

    The bare model (not a DDP wrapper) runs in eval mode, so evaluation needs no
    gradient synchronisation and consumes no dropout randomness; the training
    mode is restored afterwards.
    """
    bare = unwrap(model)
    was_training = bare.training
    bare.eval()
    try:
        records: list[Any] = []
        for batch in loader:
            records.extend(task.predict(bare, to_device(batch, env.device)))
    finally:
        bare.train(was_training)
    # Rank 0 scores and shares the (small) result: P unpicklings of the records, not P**2.
    gathered = env.gather_objects(records)
    scores = task.score([r for recs in gathered for r in recs]) if gathered is not None else None
    return env.broadcast_object(scores)
