"""A small CNN for 8x8 digit images: the default experiment's model."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Two 3x3 conv blocks, one 2x2 pooling, then a hidden linear layer.

    Every trainable layer is a Conv2d or Linear, so K-FAC preconditions all of
    them; the network is small enough to train in a couple of minutes on a CPU.

    Args:
        num_classes: Number of output classes.
        channels: Output channels of the two conv layers.
        hidden: Width of the hidden linear layer.
    """

    def __init__(self, num_classes: int, channels: Sequence[int] = (16, 32), hidden: int = 64):
        super().__init__()
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c1, c2, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c2 * 4 * 4, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of 1x8x8 images."""
        return self.classifier(self.features(x))
