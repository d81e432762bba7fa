"""CIFAR-10 through torchvision, from the official python pickle batches."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from torch.utils.data import Dataset
from torchvision import transforms
from torchvision.datasets import CIFAR10

from experiments.data.loading import DataModule
from experiments.distributed import DistEnv
from experiments.tasks.base import Task
from experiments.tasks.classification import ClassificationTask

BASE_FOLDER = CIFAR10.base_folder  # "cifar-10-batches-py"
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
FAKE_PER_BATCH = 52  # 5 training batches: 260 images
FAKE_TEST = 64


class _FakeCIFAR10(CIFAR10):
    """torchvision's loader with the MD5 checks of the official files turned off.

    Everything else (file names, pickle layout, decoding) is torchvision's, so the
    fake data goes through the real code path.
    """

    train_list: ClassVar[list[list[str | None]]] = [[n, None] for n, _ in CIFAR10.train_list]
    test_list: ClassVar[list[list[str | None]]] = [[n, None] for n, _ in CIFAR10.test_list]
    meta: ClassVar[dict[str, str | None]] = {**CIFAR10.meta, "md5": None}


def write_cifar10_batches(root: Path, per_batch: int, test_size: int, seed: int = 0) -> None:
    """Write random images in the official layout (``cifar-10-batches-py``).

    Each file is a pickled dict with ``data`` (N x 3072 uint8, channel-major
    32x32) and ``labels``; ``batches.meta`` holds ``label_names``.
    """
    rng = np.random.default_rng(seed)
    folder = root / BASE_FOLDER
    folder.mkdir(parents=True, exist_ok=True)

    def dump(name: str, count: int) -> None:
        batch = {
            "batch_label": name,
            "data": rng.integers(0, 256, size=(count, 3072), dtype=np.uint8),
            "labels": [int(v) for v in rng.integers(0, len(CLASSES), size=count)],
            "filenames": [f"{name}_{i}.png" for i in range(count)],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)

    for name, _ in CIFAR10.train_list:
        dump(name, per_batch)
    dump(CIFAR10.test_list[0][0], test_size)
    with open(folder / CIFAR10.meta["filename"], "wb") as f:
        pickle.dump({"label_names": list(CLASSES), "num_cases_per_batch": per_batch}, f)


class CIFAR10Data(DataModule):
    """CIFAR-10 with the standard augmentation (4-pixel padded crop, horizontal flip).

    Args:
        augment: Apply random crop and flip to training images.
        label_smoothing: Label smoothing of the loss.
        **kwargs: See :class:`~experiments.data.loading.DataModule`.
    """

    name = "CIFAR-10"
    source = (
        "Download cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html "
        "and unpack it in data.root (it holds cifar-10-batches-py/)."
    )

    def __init__(self, augment: bool = True, label_smoothing: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.augment = augment
        self.random_transforms = augment
        self.label_smoothing = label_smoothing

    def required_paths(self) -> list[str]:
        """The official batch files."""
        names = [n for n, _ in CIFAR10.train_list + CIFAR10.test_list] + [CIFAR10.meta["filename"]]
        return [f"{BASE_FOLDER}/{n}" for n in names]

    def write_fake(self, root: Path) -> None:
        """Five training batches of 52 random images and a test batch of 64."""
        write_cifar10_batches(root, FAKE_PER_BATCH, FAKE_TEST)

    def load(self, root: Path | None, env: DistEnv) -> tuple[Dataset, Dataset]:
        """torchvision's CIFAR10 (download=False), with MD5 checks on the real files."""
        assert root is not None
        normalize = [transforms.ToTensor(), transforms.Normalize(MEAN, STD)]
        augment = (
            [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()]
            if self.augment
            else []
        )
        cls = _FakeCIFAR10 if self.fake else CIFAR10
        train = cls(
            str(root), train=True, download=False, transform=transforms.Compose(augment + normalize)
        )
        test = cls(str(root), train=False, download=False, transform=transforms.Compose(normalize))
        return train, test

    def build_task(self) -> Task:
        """Ten-way classification."""
        return ClassificationTask(len(CLASSES), self.label_smoothing)

    def model_kwargs(self) -> dict[str, Any]:
        """The number of classes."""
        return {"num_classes": len(CLASSES)}
