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
        val_fraction: Share of the images held out for validation (scored as
            ``val_accuracy``, for choosing hyperparameters without the test set);
            0: no validation split, every non-test image trains.
        **kwargs: See :class:`~experiments.data.loading.DataModule`.
    """

    name = "digits"

    def __init__(
        self, test_fraction: float = 0.2, val_fraction: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        for key, value in (("test_fraction", test_fraction), ("val_fraction", val_fraction)):
            if not 0.0 <= float(value) < 1.0:
                raise ValueError(f"data.{key}={value!r}: expected a number in [0, 1)")
        if test_fraction + val_fraction >= 1.0:
            raise ValueError(
                f"data.val_fraction={val_fraction!r} and data.test_fraction={test_fraction!r} "
                "leave no training images"
            )
        self.test_fraction = test_fraction
        self.val_fraction = val_fraction

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
        x_val = y_val = None
        if self.val_fraction > 0:  # cut from the training images; the test split is unchanged
            x_train, x_val, y_train, y_val = train_test_split(
                x_train,
                y_train,
                test_size=self.val_fraction / (1.0 - self.test_fraction),
                stratify=y_train,
                random_state=0,
            )
        mean, std = x_train.mean(), x_train.std()

        def tensors(x: np.ndarray, y: np.ndarray) -> TensorDataset:
            x = ((x - mean) / std).astype(np.float32).reshape(-1, 1, 8, 8)
            return TensorDataset(torch.from_numpy(x), torch.from_numpy(y.astype(np.int64)))

        self.val_dataset = None if x_val is None else tensors(x_val, y_val)
        return tensors(x_train, y_train), tensors(x_test, y_test)

    def build_task(self) -> Task:
        """Ten-way classification."""
        return ClassificationTask(NUM_CLASSES)

    def model_kwargs(self) -> dict[str, Any]:
        """The number of classes."""
        return {"num_classes": NUM_CLASSES}
