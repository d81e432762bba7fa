"""The data-module interface and the loaders that make runs resumable bitwise.

Every dataset family implements :class:`DataModule`: where the files must be,
how to write a tiny fake copy in the same on-disk format (``data.fake=true``),
how to load them, which task scores the model and which sizes the model needs.
The rest is shared here:

- The training order is a pure function of (seed, epoch): an
  :class:`EpochSampler` shards a seeded permutation like ``DistributedSampler``
  and can start mid-epoch, so a resumed run sees exactly the batches the
  uninterrupted run would have seen. A framework that deals one loader's batches to
  the ranks in turn (accelerate, Hugging Face Trainer) gets the same order from a
  :class:`RoundRobinSampler`.
- Random augmentation is a pure function of (seed, epoch, index):
  :class:`SeededDataset` seeds torch's RNG per sample, so results do not depend
  on the number of loader workers or on where a run was resumed.
- Evaluation shards the held-out split over ranks without padding, so every
  example is scored exactly once.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler, TensorDataset

from experiments.config import ExperimentError
from experiments.distributed import DistEnv
from experiments.tasks.base import Task

_SEED_MASK = (1 << 63) - 1


class EpochSampler(Sampler[tuple[int, int]]):
    """This rank's share of a seeded per-epoch permutation, as (sample seed, index) keys.

    Like ``DistributedSampler(drop_last=True)``: the permutation is cut to a
    multiple of the world size and rank r takes every world_size-th entry from r.

    Args:
        size: Dataset length.
        rank: This rank.
        world_size: Number of ranks.
        seed: Run seed; the permutation of epoch e uses seed + e.
    """

    def __init__(self, size: int, rank: int, world_size: int, seed: int) -> None:
        self.size = size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.per_rank = size // world_size
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch and skip its first ``start`` samples of this rank."""
        self.epoch = epoch
        self.start = start

    def __len__(self) -> int:
        return self.per_rank - self.start

    def __iter__(self) -> Iterator[tuple[int, int]]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.size, generator=generator)[: self.per_rank * self.world_size]
        mine = order[self.rank :: self.world_size].tolist()
        for index in mine[self.start :]:
            yield hash((self.seed, self.epoch, index)) & _SEED_MASK, index


class RoundRobinSampler(Sampler[tuple[int, int]]):
    """Every rank's :class:`EpochSampler` batches in one sequence, dealt out in turn.

    Global batch ``j·P + r`` is rank r's batch j. A loader that deals whole batches to
    the ranks in turn (accelerate's ``prepare``, hence Hugging Face Trainer) then hands
    each rank exactly the batches its own ``EpochSampler`` would, epoch by epoch
    (``set_epoch``), so a framework's run sees the project loop's data order.

    Args:
        size: Dataset length.
        world_size: Number of ranks.
        seed: Run seed (see :class:`EpochSampler`).
        batch_size: Examples per batch.
        batches: Batches of each rank per epoch (the trainer's steps per epoch times the
            micro-batches per step: the batches the trainer leaves out are left out here).
    """

    def __init__(
        self, size: int, world_size: int, seed: int, batch_size: int, batches: int
    ) -> None:
        self.ranks = [EpochSampler(size, r, world_size, seed) for r in range(world_size)]
        self.batch_size = batch_size
        self.batches = batches

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (a framework skips a resumed epoch's first batches itself)."""
        for sampler in self.ranks:
            sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return self.batches * self.batch_size * len(self.ranks)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        keys = [list(sampler) for sampler in self.ranks]
        for j in range(self.batches):
            for rank_keys in keys:
                yield from rank_keys[j * self.batch_size : (j + 1) * self.batch_size]


class SeededDataset(Dataset):
    """Wraps a dataset so each sample's random transforms use a seed of its own.

    Keys are the (sample seed, index) pairs an :class:`EpochSampler` yields. The
    global RNG is forked, so augmentation neither consumes nor depends on the
    training process's random stream.
    """

    def __init__(self, dataset: Dataset, seeded: bool = True) -> None:
        self.dataset = dataset
        self.seeded = seeded

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        sample_seed, index = key
        if not self.seeded:  # nothing random: skip the cost of forking the RNG
            return self.dataset[index]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed)
            return self.dataset[index]


class DataModule(abc.ABC):
    """One dataset family: files, fake twin, loaders, task and model sizes.

    Args:
        root: Folder holding the real dataset (ignored with ``fake``).
        fake: Write a tiny dataset in the real format to a scratch folder and
            load that instead, through the same code path.
        batch_size: Training examples per rank and step.
        eval_batch_size: Evaluation examples per rank and batch.
        num_workers: Loader worker processes.
    """

    #: Human-readable dataset name, for messages.
    name: ClassVar[str]
    #: Where the real data comes from, for the missing-data message.
    source: ClassVar[str] = ""
    #: Whether training samples go through random transforms (augmentation).
    random_transforms: bool = False

    def __init__(
        self,
        root: str | None,
        fake: bool,
        batch_size: int,
        eval_batch_size: int,
        num_workers: int,
    ) -> None:
        self.root = root
        self.fake = fake
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.train_dataset: Dataset | None = None
        self.eval_dataset: Dataset | None = None
        #: An optional validation split, set by :meth:`load` where the data has one:
        #: the trainer scores it beside the evaluation (test) set, as ``val_<metric>``,
        #: so hyperparameters can be chosen without looking at the test set.
        self.val_dataset: Dataset | None = None

    # -- to implement ---------------------------------------------------------------

    def required_paths(self) -> list[str]:
        """Files or folders under the root that must exist (relative paths)."""
        return []

    def find(self, root: Path, rel: str) -> Path | None:
        """Where ``rel`` is under ``root``, or None (override to accept variants)."""
        path = root / rel
        return path if path.exists() else None

    def write_fake(self, root: Path) -> None:
        """Write a tiny dataset in the real on-disk format under ``root``."""

    @abc.abstractmethod
    def load(self, root: Path | None, env: DistEnv) -> tuple[Dataset, Dataset]:
        """Build the training and evaluation datasets from the files under ``root``.

        A data set with a validation split also sets :attr:`val_dataset` here.
        """

    @abc.abstractmethod
    def build_task(self) -> Task:
        """The task that computes this data's loss and scores predictions."""

    @abc.abstractmethod
    def model_kwargs(self) -> dict[str, Any]:
        """Sizes the model needs from the data (classes, vocabulary, ...)."""

    def collate(self, train: bool) -> Callable[[list[Any]], Any] | None:
        """How samples become a batch (None: torch's default)."""
        del train
        return None

    # -- shared ---------------------------------------------------------------------

    def setup(self, env: DistEnv, scratch: Path) -> None:
        """Find (or fake) the files, then load the datasets.

        Args:
            env: This process's place in the run.
            scratch: A private temporary folder for fake data and caches.

        Raises:
            ExperimentError: The real data is missing; the message names the path.
        """
        root: Path | None
        if self.fake:
            root = scratch / "fake_data"
            self.write_fake(root)
        else:
            root = self._check_root()
        self.train_dataset, self.eval_dataset = self.load(root, env)

    def not_found(self, path: Path) -> ExperimentError:
        """The error for a missing dataset file: the path, the source, the fake option."""
        return ExperimentError(
            f"{self.name} not found: {path} does not exist (data.root={self.root}). "
            f"{self.source} Or run with data.fake=true for a tiny synthetic copy."
        )

    def _check_root(self) -> Path | None:
        needed = self.required_paths()
        if not needed:
            return None
        if self.root is None:
            raise ExperimentError(f"{self.name}: data.root is not set. {self.source}")
        root = Path(self.root).expanduser()
        for rel in needed:
            if self.find(root, rel) is None:
                raise self.not_found(root / rel)
        return root

    def steps_per_epoch(self, env: DistEnv, accumulate_grad_batches: int = 1) -> int:
        """Optimizer steps in one epoch.

        An epoch has ``(share // batch_size)`` full batches of this rank's share,
        and an optimizer step takes ``accumulate_grad_batches`` of them; the last
        ``batches % accumulate_grad_batches`` batches of an epoch are left out,
        as ``drop_last`` leaves out a partial batch, so every step sees the same
        number of examples and the epoch length is the same on every rank.
        """
        assert self.train_dataset is not None, "call setup() first"
        batches = (len(self.train_dataset) // env.world_size) // self.batch_size  # type: ignore[arg-type]
        return batches // accumulate_grad_batches

    def _train_set(self, env: DistEnv) -> Dataset:
        """The training set, refused when it holds no batch for each rank."""
        assert self.train_dataset is not None, "call setup() first"
        if self.steps_per_epoch(env) == 0:
            raise ExperimentError(
                f"{self.name}: the training set has {len(self.train_dataset)} examples, "  # type: ignore[arg-type]
                f"fewer than data.batch_size={self.batch_size} x {env.world_size} rank(s)"
            )
        return self.train_dataset

    def train_loader(self, env: DistEnv, seed: int) -> DataLoader:
        """Loader over this rank's share of the training set; see :class:`EpochSampler`."""
        dataset = self._train_set(env)
        sampler = EpochSampler(len(dataset), env.rank, env.world_size, seed)  # type: ignore[arg-type]
        return DataLoader(
            SeededDataset(dataset, seeded=self.random_transforms),
            batch_sampler=BatchSampler(sampler, self.batch_size, drop_last=True),
            num_workers=self.num_workers,
            collate_fn=self.collate(train=True),
            pin_memory=env.device.type == "cuda",
            # A private generator: creating an iterator must not draw from the global
            # RNG, or a resumed run's random stream would shift by one draw.
            generator=torch.Generator().manual_seed(seed),
        )

    def round_robin_train_loader(
        self, env: DistEnv, seed: int, accumulate_grad_batches: int = 1
    ) -> DataLoader:
        """Every rank's training batches in one loader, for a framework that deals whole
        batches to the ranks in turn (accelerate's ``prepare``, Hugging Face Trainer).

        Rank r's share is then :meth:`train_loader`'s batches, in the same order, epoch by
        epoch (:class:`RoundRobinSampler`); each epoch holds the batches of the trainer's
        ``steps_per_epoch(env, accumulate_grad_batches)`` steps, so a framework's epoch ends
        where the project loop's does and no step takes a partial accumulation.
        """
        dataset = self._train_set(env)
        sampler = RoundRobinSampler(
            len(dataset),  # type: ignore[arg-type]
            env.world_size,
            seed,
            self.batch_size,
            self.steps_per_epoch(env, accumulate_grad_batches) * accumulate_grad_batches,
        )
        return DataLoader(
            SeededDataset(dataset, seeded=self.random_transforms),
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            collate_fn=self.collate(train=True),
            pin_memory=env.device.type == "cuda",
            generator=torch.Generator().manual_seed(seed),
        )

    def eval_loader(self, env: DistEnv) -> DataLoader:
        """Loader over this rank's unpadded shard of the evaluation set."""
        assert self.eval_dataset is not None, "call setup() first"
        return self._held_out_loader(self.eval_dataset, env)

    def val_loader(self, env: DistEnv) -> DataLoader | None:
        """Loader over this rank's unpadded shard of the validation set (None: no such split)."""
        return None if self.val_dataset is None else self._held_out_loader(self.val_dataset, env)

    def _held_out_loader(self, dataset: Dataset, env: DistEnv) -> DataLoader:
        """Batches of this rank's shard, in order: examples r, r + P, r + 2P, ...

        A ``TensorDataset`` under the default collation is indexed a batch at a
        time (``dataset[indices]``: one gather per tensor) instead of an example
        at a time and then stacked: the same tensors, bit for bit, without a
        Python call per example. Every evaluation reads the whole held-out
        split; on MNIST-1D at P=64 fetching example by example took 2.2 to 4.6
        times as long.
        """
        shard = list(range(env.rank, len(dataset), env.world_size))  # type: ignore[arg-type]
        collate = self.collate(train=False)
        batching: dict[str, Any] = {"batch_size": self.eval_batch_size, "sampler": shard}
        if isinstance(dataset, TensorDataset) and collate is None:
            # batch_size=None: each of the sampler's lists of indices is fetched as a batch.
            batching = {
                "batch_size": None,
                "sampler": BatchSampler(shard, self.eval_batch_size, drop_last=False),
            }
        return DataLoader(
            dataset,
            **batching,
            num_workers=self.num_workers,
            collate_fn=collate,
            pin_memory=env.device.type == "cuda",
            generator=torch.Generator(),
        )


def epoch_sampler(loader: DataLoader) -> EpochSampler:
    """The :class:`EpochSampler` inside a loader built by :meth:`DataModule.train_loader`."""
    sampler = loader.batch_sampler.sampler  # type: ignore[union-attr]
    assert isinstance(sampler, EpochSampler)
    return sampler
