"""ResNets for CIFAR (He et al. 2016, "Deep Residual Learning", section 4.2).

Three stages of n basic blocks with 16, 32 and 64 channels on 32x32, 16x16 and
8x8 maps, then global average pooling and a linear classifier: depth 6n + 2
(ResNet-20/32/44/56/110). The paper's CIFAR networks use identity shortcuts
with zero-padded extra channels (option A); option B uses 1x1 projections
where the shape changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _PadShortcut(nn.Module):
    """Option A: subsample by 2 and zero-pad the new channels (no parameters)."""

    def __init__(self, extra_channels: int) -> None:
        super().__init__()
        self.extra = extra_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, ::2, ::2]
        half = self.extra // 2
        return F.pad(x, (0, 0, 0, 0, half, self.extra - half))


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual connection.

    Args:
        in_planes: Input channels.
        planes: Output channels.
        stride: Stride of the first conv (2 at the start of stages 2 and 3).
        shortcut: ``"A"`` (zero padding) or ``"B"`` (1x1 projection).
    """

    def __init__(self, in_planes: int, planes: int, stride: int, shortcut: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            if shortcut == "A":
                self.shortcut = _PadShortcut(planes - in_planes)
            else:
                self.shortcut = nn.Sequential(
                    nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                    nn.BatchNorm2d(planes),
                )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Not in place: an in-place op after a hooked module upsets full backward hooks.
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CIFARResNet(nn.Module):
    """ResNet-(6n+2) for 32x32 images.

    Args:
        num_classes: Number of classes.
        depth: 6n + 2 (32 and 110 in the presets).
        shortcut: ``"A"`` or ``"B"``; see the module docstring.

    Raises:
        ValueError: ``depth`` is not 6n + 2, or ``shortcut`` is unknown.
    """

    def __init__(self, num_classes: int, depth: int = 32, shortcut: str = "A") -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6 != 0:
            raise ValueError(f"CIFAR ResNet depth must be 6n + 2 (e.g. 20, 32, 110), got {depth}")
        if shortcut not in ("A", "B"):
            raise ValueError(f"shortcut must be 'A' or 'B', got {shortcut!r}")
        n = (depth - 2) // 6
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        layers: list[nn.Module] = []
        in_planes = 16
        for stage, planes in enumerate((16, 32, 64)):
            for i in range(n):
                stride = 2 if stage > 0 and i == 0 else 1
                layers.append(BasicBlock(in_planes, planes, stride, shortcut))
                in_planes = planes
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch of 3x32x32 images."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)
