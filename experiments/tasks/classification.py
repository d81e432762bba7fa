"""Image classification: cross-entropy (optionally label-smoothed) and top-1 accuracy.

Top-1 accuracy is a ratio of two counts, so evaluation sums them per rank and
all-reduces them (:class:`~experiments.tasks.base.SummableTask`); the records
path (:meth:`ClassificationTask.predict`, :meth:`ClassificationTask.score`,
torchmetrics' micro-averaged accuracy) defines the value, which the counts
reproduce bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.functional.classification import multiclass_accuracy

from experiments.tasks.base import SummableTask


class ClassificationTask(SummableTask):
    """Batches are ``(images, labels)``; the model returns logits.

    Args:
        num_classes: Number of classes.
        label_smoothing: Label smoothing of the training loss (0.1 for ImageNet).
    """

    primary_metric = "accuracy"
    #: Correct top-1 predictions and examples.
    num_statistics = 2

    def __init__(self, num_classes: int, label_smoothing: float = 0.0) -> None:
        self.num_classes = num_classes
        self.label_smoothing = label_smoothing

    def training_loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Cross-entropy of the batch."""
        images, labels = batch
        return F.cross_entropy(model(images), labels, label_smoothing=self.label_smoothing)

    def predict(self, model: nn.Module, batch: Any) -> list[Any]:
        """One record per batch: (predicted classes, true classes)."""
        images, labels = batch
        return [(model(images).argmax(dim=1).cpu(), labels.cpu())]

    def score(self, records: list[Any]) -> dict[str, float]:
        """Top-1 accuracy (micro-averaged over examples) with torchmetrics."""
        preds = torch.cat([p for p, _ in records])
        target = torch.cat([t for _, t in records])
        acc = multiclass_accuracy(preds, target, num_classes=self.num_classes, average="micro")
        return {"accuracy": float(acc), "examples": float(target.numel())}

    def statistics(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """(correct top-1 predictions, examples) of the batch, as float64 on its device."""
        images, labels = batch
        correct = (model(images).argmax(dim=1) == labels).sum()
        return torch.stack((correct, correct.new_tensor(labels.numel()))).to(torch.float64)

    def score_statistics(self, sums: torch.Tensor) -> dict[str, float]:
        """:meth:`score`'s values from the summed counts.

        torchmetrics' micro accuracy is ``tp / (tp + fn)`` with both counts cast
        to float32 and 0 for an empty set; ``tp + fn`` is the number of
        examples. The same float32 division here gives the same bits.
        """
        correct, examples = sums.to(torch.int64).float()
        acc = correct / examples if examples != 0 else torch.zeros(())
        return {"accuracy": float(acc), "examples": float(sums[1])}
