"""The MNIST-1D paper's small CNN, written with the layer types K-FAC preconditions."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class MNIST1DCNN(nn.Module):
    """Three strided convolutions over the signal, then a linear classifier.

    The network of the MNIST-1D paper (Greydanus & Kobak 2024, ``ConvBase``:
    25 channels, kernels 5, 3, 3, stride 2, padding 1, ReLU, then one linear
    layer on the flattened features), with each ``Conv1d`` written as a
    ``Conv2d`` over a ``(N, C, 1, L)`` signal with ``(1, k)`` kernels, stride
    ``(1, 2)`` and padding ``(0, 1)``: the same function, and a layer type the
    preconditioner supports (K-FAC has no ``Conv1d`` layer), so every layer
    is preconditioned.

    Args:
        num_classes: Outputs (from the data module).
        d_in: Length of the signal (40 for the package's default generator).
        channels: Output channels of each convolution.
        kernel_sizes: Kernel length of each convolution.
        stride: Stride of every convolution (each pads 1 on both ends).
    """

    def __init__(
        self,
        num_classes: int,
        d_in: int = 40,
        channels: Sequence[int] = (25, 25, 25),
        kernel_sizes: Sequence[int] = (5, 3, 3),
        stride: int = 2,
    ) -> None:
        super().__init__()
        if len(channels) != len(kernel_sizes) or not channels:
            raise ValueError(
                f"one kernel size per conv layer: channels {list(channels)}, "
                f"kernel_sizes {list(kernel_sizes)}"
            )
        layers: list[nn.Module] = []
        length, fan_in = d_in, 1
        for width, kernel in zip(channels, kernel_sizes, strict=True):
            layers += [
                nn.Conv2d(fan_in, width, (1, kernel), stride=(1, stride), padding=(0, 1)),
                nn.ReLU(),
            ]
            length = (length + 2 - kernel) // stride + 1
            fan_in = width
        if length <= 0:
            raise ValueError(f"a signal of length {d_in} is too short for these convolutions")
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(fan_in * length, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of signals, ``(N, L)``, ``(N, 1, L)`` or ``(N, 1, 1, L)``."""
        signal = x.reshape(x.shape[0], 1, 1, x.shape[-1])
        return self.classifier(self.features(signal).flatten(1))
