"""A multilayer perceptron: the benchmark tests' tiny model, and the MNIST-1D MLP."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class MLP(nn.Sequential):
    """``Linear -> ReLU -> ... -> Linear`` on flattened inputs.

    Inputs are flattened first, so 1x8x8 digit images (``d_in=64``), MNIST-1D
    signals (``d_in=40``) and plain feature vectors work alike. The layers are
    the ``Sequential``'s children ``0``, ``2``, ``4``, ..., the names K-FAC and
    the cost model see; with one hidden width (an int) the network is the
    two-layer perceptron ``0 -> 2`` the benchmark's tests measure.

    Args:
        num_classes: Outputs (from the data module or the benchmark's batch).
        d_in: Input features.
        hidden: Width of the hidden layer, or one width per hidden layer
            (``[100, 100]``: the MNIST-1D paper's 40-100-100-10 MLP).
    """

    def __init__(self, num_classes: int, d_in: int = 64, hidden: int | Sequence[int] = 32) -> None:
        widths = [hidden] if isinstance(hidden, int) else [int(h) for h in hidden]
        if not widths or any(w <= 0 for w in widths):
            raise ValueError(f"hidden must be positive widths, got {hidden!r}")
        layers: list[nn.Module] = []
        for fan_in, fan_out in zip([d_in, *widths[:-1]], widths, strict=True):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        super().__init__(*layers, nn.Linear(widths[-1], num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of inputs of ``d_in`` features (any trailing shape)."""
        return super().forward(x.flatten(1))
