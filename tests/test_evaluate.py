"""Evaluation: summed statistics give the records path's metrics, bit for bit, in one round.

A :class:`SummableTask` (classification) is scored from per-rank counts reduced by
one all-reduce; its records path (``predict`` then ``score``, torchmetrics'
accuracy) defines the values. Here the two agree exactly for every count up to a
few hundred examples and at the sizes of real runs, and on 1 and 4 rank threads
for two evaluation sets scored together, one of them smaller than the world (a
rank with an empty shard). A task without the hook keeps the records path; both
paths make one round of collectives for all sets. Held-out loaders fetch a
``TensorDataset`` a batch at a time, with the batches the per-example loader made.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torchmetrics.functional.classification import multiclass_accuracy

from experiments.distributed import DistEnv
from experiments.tasks.base import SummableTask, Task, evaluate, evaluate_sets
from experiments.tasks.classification import ClassificationTask
from experiments.threads import current_rank, run_threads


class Lookup(nn.Module):
    """A model whose "images" are example indices and whose logits are a fixed table."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("logits", logits)

    def forward(self, index: torch.Tensor) -> torch.Tensor:
        return self.logits[index]


class RecordsOnly(Task):
    """A classification task without the summable hook: the records path, as before."""

    primary_metric = "accuracy"

    def __init__(self, task: ClassificationTask) -> None:
        self.task = task

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return self.task.training_loss(model, batch)

    def predict(self, model: nn.Module, batch: Any) -> list[Any]:
        return self.task.predict(model, batch)

    def score(self, records: list[Any]) -> dict[str, float]:
        return self.task.score(records)


class MedianTask(Task):
    """A metric no sum gives (the median of the per-example logit maxima): records only."""

    primary_metric = "median"

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def predict(self, model: nn.Module, batch: Any) -> list[Any]:
        index, _ = batch
        return list(zip(index.tolist(), model(index).amax(dim=1).tolist(), strict=True))

    def score(self, records: list[Any]) -> dict[str, float]:
        assert len({i for i, _ in records}) == len(records)  # each example once
        return {"median": statistics.median(v for _, v in records), "examples": len(records)}


def _problem(n: int, classes: int, seed: int) -> tuple[Lookup, torch.Tensor]:
    """Random logits (bfloat16-like ties included) and labels for ``n`` examples."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, classes, generator=gen).round(decimals=1)
    labels = torch.randint(classes, (n,), generator=gen)
    return Lookup(logits), labels


def _batches(labels: torch.Tensor, rank: int, world: int, size: int) -> list[Any]:
    """Rank ``rank``'s shard (examples rank, rank + world, ...) in batches of ``size``."""
    shard = torch.arange(rank, len(labels), world)
    return [(i, labels[i]) for i in shard.split(size)]


def test_counts_give_torchmetrics_accuracy_bit_for_bit() -> None:
    """Every (correct, examples) up to 30 examples, and at sizes of real evaluation sets."""
    task = ClassificationTask(10)
    cases = [(c, n) for n in range(1, 31) for c in range(n + 1)]
    gen = torch.Generator().manual_seed(0)
    for n in (359, 1437, 10_000, 100_003):
        cases += [(int(c), n) for c in torch.randint(n + 1, (10,), generator=gen)]
    for correct, n in cases:
        target = torch.arange(n) % 10
        preds = torch.where(torch.arange(n) < correct, target, (target + 1) % 10)
        expected = float(multiclass_accuracy(preds, target, num_classes=10, average="micro"))
        sums = torch.tensor([correct, n], dtype=torch.float64)
        got = task.score_statistics(sums)
        assert got == {"accuracy": expected, "examples": float(n)}, (correct, n)
        assert got == task.score([(preds, target)]), (correct, n)


@pytest.mark.parametrize("classes", [2, 10, 37])
def test_statistics_of_batches_equal_the_records_score(classes: int) -> None:
    """On one rank, batch by batch, through the model: the same dict as score(predict)."""
    model, labels = _problem(523, classes, seed=classes)
    task = ClassificationTask(classes)
    batches = _batches(labels, 0, 1, 50)
    records = [r for b in batches for r in task.predict(model, b)]
    sums = sum(task.statistics(model, b) for b in batches)
    assert isinstance(sums, torch.Tensor) and sums.dtype == torch.float64
    assert task.score_statistics(sums) == task.score(records)


def _sets(sizes: list[int]) -> tuple[Lookup, list[torch.Tensor]]:
    """One model (logits for the largest set) and each set's labels: set i is examples
    ``0 .. sizes[i] - 1`` of the model's table with labels of its own."""
    model, _ = _problem(max(sizes), 10, seed=0)
    gen = torch.Generator().manual_seed(1)
    return model, [torch.randint(10, (n,), generator=gen) for n in sizes]


def _evaluate_both(rank: int, world: int, sizes: list[int], batch: int) -> dict[str, Any]:
    """On one rank: all sets scored by the summable path, the records path and set by set."""
    env = DistEnv(rank, world)
    task = ClassificationTask(10)
    model, labels = _sets(sizes)
    sets = [_batches(y, rank, world, batch) for y in labels]
    model.train()
    before = torch.get_rng_state()
    out = {"summed": evaluate_sets(task, model, sets, env)}
    assert model.training  # the training mode is restored
    out["records"] = evaluate_sets(RecordsOnly(task), model, sets, env)
    out["one_by_one"] = [evaluate(task, model, s, env) for s in sets]
    out["median"] = evaluate_sets(MedianTask(), model, sets, env)
    assert torch.equal(torch.get_rng_state(), before)  # training's stream is not drawn from
    return out


@pytest.mark.parametrize("world", [1, 4])
def test_summed_path_equals_records_path_on_rank_threads(world: int) -> None:
    """Two sets at once, the second (3 examples) smaller than P=4: rank 3's shard is empty.

    Every rank gets the metrics one process computes from all records at once."""
    sizes = [1003, 3]
    results = run_threads(_evaluate_both, world, sizes, 64)
    model, labels = _sets(sizes)
    task, median = ClassificationTask(10), MedianTask()
    whole = [(torch.arange(len(y)), y) for y in labels]
    expected = [task.score(task.predict(model, b)) for b in whole]
    expected_median = [median.score(median.predict(model, b)) for b in whole]
    assert [e["examples"] for e in expected] == [1003.0, 3.0]
    for rank, out in enumerate(results):
        assert out["summed"] == out["records"] == out["one_by_one"] == expected, rank
        assert out["median"] == expected_median, rank


def _count_collectives(rank: int, world: int, calls: dict[int, list[str]]) -> None:
    env = DistEnv(rank, world)
    model, labels = _problem(40, 10, seed=1)
    sets = [_batches(labels, rank, world, 8), _batches(labels[:13], rank, world, 8)]
    calls[rank] = []
    evaluate_sets(ClassificationTask(10), model, sets, env)
    calls[rank].append("|")
    evaluate_sets(RecordsOnly(ClassificationTask(10)), model, sets, env)


def test_one_round_of_collectives_for_all_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Summable: one all-reduce for both sets; records: one gather and one broadcast."""
    calls: dict[int, list[str]] = {}
    for name in ("all_reduce", "gather_object", "broadcast_object_list", "all_gather_object"):
        real = getattr(dist, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            rank = current_rank()
            assert rank is not None
            calls[rank].append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, counted)
    run_threads(_count_collectives, 4, calls)
    for rank in range(4):
        # gather_object's own size exchange and broadcast_object_list's inner broadcasts
        # go to dist.all_gather and dist.broadcast, not counted here.
        assert calls[rank] == ["all_reduce", "|", "gather_object", "broadcast_object_list"]


class _Plain(Dataset):
    """A dataset that is not a TensorDataset: fetched an example at a time."""

    def __init__(self, inner: TensorDataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        return self.inner[i]


def _per_example(dataset: Dataset, env: DistEnv, batch_size: int) -> DataLoader:
    """The held-out loader as it was: per-example fetching and default collation."""
    shard = list(range(env.rank, len(dataset), env.world_size))  # type: ignore[arg-type]
    return DataLoader(dataset, batch_size=batch_size, sampler=shard, generator=torch.Generator())


def _same(a: Iterator[Any], b: Iterator[Any]) -> None:
    a_batches, b_batches = list(a), list(b)
    assert len(a_batches) == len(b_batches)
    for x, y in zip(a_batches, b_batches, strict=True):
        assert type(x) is type(y) and len(x) == len(y)
        for u, v in zip(x, y, strict=True):
            assert u.dtype == v.dtype and u.shape == v.shape and u.is_contiguous()
            assert torch.equal(u, v)


@pytest.mark.parametrize("world", [1, 3, 7])
def test_held_out_batches_are_fetched_whole_and_unchanged(tmp_path: Path, world: int) -> None:
    from experiments.data.digits import DigitsData

    kw = {"root": None, "fake": False, "batch_size": 16, "num_workers": 0}
    data = DigitsData(**kw, eval_batch_size=7, val_fraction=0.1)
    data.setup(DistEnv(), tmp_path)
    assert isinstance(data.eval_dataset, TensorDataset)
    before = torch.get_rng_state()
    for rank in range(world):
        env = DistEnv(rank, world)
        fast = data.eval_loader(env)
        assert fast.batch_size is None  # whole batches from the TensorDataset
        _same(iter(fast), iter(_per_example(data.eval_dataset, env, 7)))
        val = data.val_loader(env)
        assert val is not None
        _same(iter(val), iter(_per_example(data.val_dataset, env, 7)))
        plain = _Plain(data.eval_dataset)
        slow = data._held_out_loader(plain, env)
        assert slow.batch_size == 7  # any other dataset: an example at a time, as before
        _same(iter(slow), iter(_per_example(plain, env, 7)))
    assert torch.equal(torch.get_rng_state(), before)


def test_summable_hook_is_the_dispatch() -> None:
    assert isinstance(ClassificationTask(10), SummableTask)
    assert not isinstance(RecordsOnly(ClassificationTask(10)), SummableTask)
