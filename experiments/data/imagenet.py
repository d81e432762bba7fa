"""ImageNet (ILSVRC-2012) as JPEG class folders through torchvision's ImageFolder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset
from torchvision import transforms
from torchvision.datasets import ImageFolder

from experiments.config import ExperimentError
from experiments.data.loading import DataModule
from experiments.distributed import DistEnv
from experiments.tasks.base import Task
from experiments.tasks.classification import ClassificationTask

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
FAKE_CLASSES = 4
FAKE_TRAIN_PER_CLASS = 16  # 64 images: two full batches of the preset
FAKE_VAL_PER_CLASS = 2
FAKE_SIDE = 40


def write_image_folders(
    root: Path, splits: dict[str, int], classes: int, side: int, seed: int = 0
) -> None:
    """Write random JPEGs as ``root/<split>/<wnid>/<name>.JPEG`` (ImageNet's layout)."""
    rng = np.random.default_rng(seed)
    for split, per_class in splits.items():
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{split}_{c}_{i}.JPEG", quality=90)


class ImageNetData(DataModule):
    """ImageNet with the usual ResNet pre-processing.

    Training: random-resized crop and horizontal flip; evaluation: resize to
    256/224 of the crop size, then a centre crop.

    Args:
        image_size: Crop side (224 for the published runs).
        label_smoothing: Label smoothing of the loss (0.1 in the preset).
        **kwargs: See :class:`~experiments.data.loading.DataModule`.
    """

    name = "ImageNet"
    source = (
        "Get ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar from https://image-net.org, "
        "unpack them to data.root/train/<wnid>/*.JPEG and data.root/val/<wnid>/*.JPEG "
        "(sort the validation images into class folders, e.g. with the usual valprep.sh)."
    )

    def __init__(self, image_size: int = 224, label_smoothing: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.image_size = image_size
        self.random_transforms = True
        self.label_smoothing = label_smoothing
        self.num_classes = 0

    def required_paths(self) -> list[str]:
        """The two split folders."""
        return ["train", "val"]

    def write_fake(self, root: Path) -> None:
        """Four classes of small random JPEGs (16 training and 2 validation images each)."""
        splits = {"train": FAKE_TRAIN_PER_CLASS, "val": FAKE_VAL_PER_CLASS}
        write_image_folders(root, splits, FAKE_CLASSES, FAKE_SIDE)

    def load(self, root: Path | None, env: DistEnv) -> tuple[Dataset, Dataset]:
        """Two ImageFolders; the classes are the training folder's sub-folders."""
        assert root is not None
        normalize = [transforms.ToTensor(), transforms.Normalize(MEAN, STD)]
        train_tf = transforms.Compose(
            [
                transforms.RandomResizedCrop(self.image_size),
                transforms.RandomHorizontalFlip(),
                *normalize,
            ]
        )
        eval_tf = transforms.Compose(
            [
                transforms.Resize(round(self.image_size * 256 / 224)),
                transforms.CenterCrop(self.image_size),
                *normalize,
            ]
        )
        train = ImageFolder(str(root / "train"), transform=train_tf)
        val = ImageFolder(str(root / "val"), transform=eval_tf)
        if val.class_to_idx != train.class_to_idx:
            raise ExperimentError(
                f"ImageNet: the class folders of {root / 'val'} differ from those of "
                f"{root / 'train'}; labels would not match"
            )
        self.num_classes = len(train.classes)
        return train, val

    def build_task(self) -> Task:
        """N-way classification, N from the training folders."""
        return ClassificationTask(self.num_classes, self.label_smoothing)

    def model_kwargs(self) -> dict[str, Any]:
        """The number of classes."""
        return {"num_classes": self.num_classes}
