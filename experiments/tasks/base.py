"""The task interface and the distributed evaluation loop shared by all tasks.

A task turns a batch into a training loss, and a model's outputs on held-out
batches into picklable prediction records; after all ranks' records are
gathered, it scores them with a library metric. Keeping the gather in one
place means each task's scoring code sees the whole evaluation set, exactly
once, whatever the world size.

A task whose metrics are functions of sums over examples (classification:
correct predictions and examples) can say so by being a :class:`SummableTask`:
each rank then sums its own shard's statistics and one all-reduce of a small
tensor replaces the records' pickling, gather and broadcast. With every rank a
thread of one process (``launcher=threads``) each collective is a rendezvous
of all P threads, and a pickled tensor costs a ``torch.save`` and, on rank 0,
a ``torch.load``: at P=64 the records path took most of a run's wall time.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
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


class SummableTask(Task):
    """A task whose metrics follow from statistics summed over the evaluation set.

    :func:`evaluate_sets` then sums each rank's statistics and reduces them over
    ranks with one all-reduce, instead of gathering pickled records on rank 0
    and broadcasting its scores. :meth:`predict` and :meth:`score` stay: they
    define the metrics, and ``score(records)`` must equal
    ``score_statistics(sums)`` for the same set, bit for bit (the tests check it).

    The statistics are float64 and each is an integer (or another value whose
    sums float64 holds exactly, below 2**53): their sums are then the same in
    any order, so the result does not depend on the world size or on how a
    backend orders its reduction.
    """

    #: Length of the vector :meth:`statistics` returns.
    num_statistics: ClassVar[int]

    @abc.abstractmethod
    def statistics(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The batch's summable statistics: ``num_statistics`` float64 values on its device.

        Left on the device: summed there, they need no host synchronisation per batch.
        """

    @abc.abstractmethod
    def score_statistics(self, sums: torch.Tensor) -> dict[str, float]:
        """Metrics of the whole evaluation set from its summed statistics (on the CPU)."""


@torch.no_grad()
def evaluate_sets(
    task: Task, model: nn.Module, loaders: Sequence[Iterable[Any]], env: DistEnv
) -> list[dict[str, float]]:
    """Score ``model`` on several evaluation sets in one round of collectives.

    Every rank runs its shard of each set (``loaders[i]``); every rank gets the
    metrics of each set, in order. The collectives are one all-reduce for a
    :class:`SummableTask`, else one gather of all sets' records onto rank 0
    (which scores them: P unpicklings of the records, not P**2) and one
    broadcast of the scores, whatever the number of sets: with ranks as
    threads, a collective's cost is a rendezvous of every rank, so test and
    validation share theirs.

    The bare model (not a DDP wrapper) runs in eval mode, so evaluation needs no
    gradient synchronisation and consumes no dropout randomness; the training
    mode is restored afterwards.
    """
    bare = unwrap(model)
    was_training = bare.training
    bare.eval()
    try:
        if isinstance(task, SummableTask):
            shape = (len(loaders), task.num_statistics)
            sums = torch.zeros(shape, dtype=torch.float64, device=env.device)
            for i, loader in enumerate(loaders):
                for batch in loader:
                    sums[i] += task.statistics(bare, to_device(batch, env.device))
        else:
            records: list[list[Any]] = [[] for _ in loaders]
            for mine, loader in zip(records, loaders, strict=True):
                for batch in loader:
                    mine.extend(task.predict(bare, to_device(batch, env.device)))
    finally:
        bare.train(was_training)
    if isinstance(task, SummableTask):
        totals = env.sum(sums).cpu()
        return [task.score_statistics(row) for row in totals]
    gathered = env.gather_objects(records)  # [rank][set] -> records
    scores = None
    if gathered is not None:
        sets = range(len(records))
        scores = [task.score([r for mine in gathered for r in mine[i]]) for i in sets]
    return env.broadcast_object(scores)


def evaluate(task: Task, model: nn.Module, loader: Iterable[Any], env: DistEnv) -> dict[str, float]:
    """Score ``model`` on every rank's shard of one evaluation set (see :func:`evaluate_sets`)."""
    return evaluate_sets(task, model, [loader], env)[0]
