"""scikit-learn's bundled 8x8 handwritten digits: the default, download-free experiment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from experiments.data.loading import DataModule
from experiments.distributed import DistEnv
from experiments.tasks.base import Task
from experiments.tasks.classification import ClassificationTask

NUM_CLASSES = 10
FAKE_SIZE = 200


class DigitsData(DataModule):
    """The 1797 digits of ``sklearn.datasets.load_digits``, split stratified.

    The data ships with scikit-learn, so there is nothing to fake: ``fake=true``
    only takes the first 200 images to keep smoke runs short.

    Args:
        test_fraction: Share of the images held out for evaluation.
        **kwargs: See :class:`~experiments.data.loading.DataModule`.
    """

    name = "digits"

    def __init__(self, test_fraction: float = 0.2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.test_fraction = test_fraction

    def load(self, root: Path | None, env: DistEnv) -> tuple[Dataset, Dataset]:
        """Scale pixels by the training set's mean and std; images are 1x8x8."""
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        images, labels = load_digits(return_X_y=True)
        if self.fake:
            images, labels = images[:FAKE_SIZE], labels[:FAKE_SIZE]
        x_train, x_test, y_train, y_test = train_test_split(
            images, labels, test_size=self.test_fraction, stratify=labels, random_state=0
        )
        mean, std = x_train.mean(), x_train.std()

        def tensors(x: np.ndarray, y: np.ndarray) -> TensorDataset:
            x = ((x - mean) / std).astype(np.float32).reshape(-1, 1, 8, 8)
            return TensorDataset(torch.from_numpy(x), torch.from_numpy(y.astype(np.int64)))

        return tensors(x_train, y_train), tensors(x_test, y_test)

    def build_task(self) -> Task:
        """Ten-way classification."""
        return ClassificationTask(NUM_CLASSES)

    def model_kwargs(self) -> dict[str, Any]:
        """The number of classes."""
        return {"num_classes": NUM_CLASSES}
