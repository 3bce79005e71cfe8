"""Model builders used across the lessons."""

from __future__ import annotations

from torch import nn
from torchvision.models import resnet18


def resnet18_mnist(num_classes: int = 10) -> nn.Module:
    """ResNet-18 for 1-channel 28x28 MNIST digits.

    Only the stem changes: torchvision's ResNet-18 expects 3-channel images, so its first
    convolution is replaced by one that takes a single (grey) channel.
    """
    model = resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(1, 64, kernel_size=(7, 7), stride=(2, 2), padding=(3, 3), bias=False)
    return model
