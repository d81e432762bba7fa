"""A two-layer perceptron: the benchmark tests' tiny model, also trainable on digits."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Sequential):
    """``Linear -> ReLU -> Linear`` on flattened inputs.

    Inputs are flattened first, so 1x8x8 digit images (``d_in=64``) and plain
    feature vectors work alike; the layers are the ``Sequential``'s children
    ``0`` and ``2``, the names K-FAC and the cost model see.

    Args:
        num_classes: Outputs (from the data module or the benchmark's batch).
        d_in: Input features.
        hidden: Width of the hidden layer.
    """

    def __init__(self, num_classes: int, d_in: int = 64, hidden: int = 32) -> None:
        super().__init__(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of inputs of ``d_in`` features (any trailing shape)."""
        return super().forward(x.flatten(1))
