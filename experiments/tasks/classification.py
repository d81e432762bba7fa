"""Image classification: cross-entropy (optionally label-smoothed) and top-1 accuracy."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.functional.classification import multiclass_accuracy

from experiments.tasks.base import Task


class ClassificationTask(Task):
    """Batches are ``(images, labels)``; the model returns logits.

    Args:
        num_classes: Number of classes.
        label_smoothing: Label smoothing of the training loss (0.1 for ImageNet).
    """

    primary_metric = "accuracy"

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
