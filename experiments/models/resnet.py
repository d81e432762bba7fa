"""torchvision's ResNet-50, optionally with every stage's width divided.

One constructor serves the ImageNet preset (full width) and the benchmark,
which times the same bottleneck network at a quarter of the width on a CPU:
the largest factor shrinks from 4609 (an ``eigh`` of about 30 s on one core)
to 1153 at ``width_divisor=4``, which is what makes the "decompose every step"
setting affordable there. Both come from ``conf/model/resnet50.yaml``.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def resnet50(
    num_classes: int = 1000, width_divisor: int = 1, zero_init_residual: bool = False
) -> nn.Module:
    """A randomly initialised ResNet-50 (bottleneck blocks 3-4-6-3, expansion 4).

    Args:
        num_classes: Classifier outputs (from the data module or the benchmark's batch).
        width_divisor: Divide every stage's width by this (1: torchvision's network
            exactly); the 64-channel stem is kept.
        zero_init_residual: Start every residual branch's last BatchNorm at zero.

    Raises:
        ValueError: ``width_divisor`` does not divide 64.
    """
    import torchvision
    from torchvision.models.resnet import Bottleneck, ResNet

    if width_divisor == 1:
        return torchvision.models.resnet50(
            weights=None, num_classes=num_classes, zero_init_residual=zero_init_residual
        )
    if width_divisor < 1 or 64 % width_divisor:
        raise ValueError(f"width_divisor must divide 64, got {width_divisor}")

    class NarrowResNet(ResNet):
        def _make_layer(self, block: type, planes: int, *args: Any, **kwargs: Any) -> nn.Module:
            return super()._make_layer(block, planes // width_divisor, *args, **kwargs)

    model = NarrowResNet(
        Bottleneck, [3, 4, 6, 3], num_classes=num_classes, zero_init_residual=zero_init_residual
    )
    # conv1/bn1 keep torchvision's 64 stem channels; only the classifier input changes.
    model.fc = nn.Linear(512 * Bottleneck.expansion // width_divisor, num_classes)
    return model
