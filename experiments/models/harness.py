"""A small ResNet-like network with every convolution geometry the factor kernels dispatch on.

The model of the fake-CUDA harness (:mod:`experiments.bench.fake_cuda`, used by
``tests/fake_cuda.py``), which runs its hooks and steps on fake CUDA tensors in
``make test``, and of the GPU report
(:mod:`experiments.bench.gpu_report`), which runs the same model on a real GPU.
"""

from __future__ import annotations

import torch
from torch import nn


class ResNetLike(nn.Module):
    """Stem, a residual block, a strided block with a 1×1 shortcut, pooling and a head.

    Convolutions of every geometry the factor kernels dispatch on: 3×3 stride 1
    (shifted correlations), 3×3 stride 2 and 1×1 stride 2 (im2col with the
    triangle product), with and without bias, plus BatchNorm (not K-FAC) and a
    Linear head.
    """

    def __init__(self, width: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(width)
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.down = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.shortcut = nn.Conv2d(width, 2 * width, 1, stride=2, bias=False)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn0(self.stem(x)))
        x = torch.relu(x + self.bn1(self.conv1(x)))
        x = torch.relu(self.down(x) + self.shortcut(x))
        return self.head(x.mean((2, 3)))
