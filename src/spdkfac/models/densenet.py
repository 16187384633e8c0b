"""DenseNet-BC (Huang et al., 2017) in torchvision's layout: DenseNet-121 and DenseNet-201."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["DenseNet", "densenet121", "densenet201"]


class _DenseLayer(nn.Module):
    """BN-ReLU-1x1 conv to ``bn_size * growth`` channels, BN-ReLU-3x3 conv to ``growth``."""

    def __init__(self, in_channels: int, growth: int, bn_size: int) -> None:
        super().__init__()
        self.norm1 = nn.BatchNorm2d(in_channels)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(in_channels, bn_size * growth, kernel_size=1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, kernel_size=3, padding=1, bias=False)

    def forward(self, features: list[Tensor]) -> Tensor:
        """The ``growth`` new channels computed from every earlier feature map."""
        stacked = torch.cat(features, 1)
        bottleneck = self.conv1(self.relu1(self.norm1(stacked)))
        result: Tensor = self.conv2(self.relu2(self.norm2(bottleneck)))
        return result


class _DenseBlock(nn.ModuleDict):
    """``count`` dense layers, each fed the concatenation of all earlier outputs."""

    def __init__(self, count: int, in_channels: int, growth: int, bn_size: int) -> None:
        super().__init__()
        for index in range(count):
            layer = _DenseLayer(in_channels + index * growth, growth, bn_size)
            self.add_module(f"denselayer{index + 1}", layer)

    def forward(self, x: Tensor) -> Tensor:
        """The input and every layer's output, concatenated along channels."""
        features = [x]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class _Transition(nn.Sequential):
    """BN-ReLU-1x1 conv halving the channels, then 2x2 average pooling."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(in_channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=1, bias=False)
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)


class DenseNet(nn.Module):
    """DenseNet-BC for ImageNet: 7x7/2 stem, max-pool, dense blocks with transitions, linear.

    Module names match ``torchvision.models.DenseNet`` (``features.denseblock1.denselayer1
    .conv1``, ``features.transition1.conv``, ``classifier``).

    Args:
        blocks: Dense layers per block, e.g. ``(6, 12, 48, 32)`` for DenseNet-201.
        growth: Channels each dense layer adds.
        init_features: Channels of the stem.
        bn_size: Bottleneck width as a multiple of ``growth``.
        num_classes: Number of output logits.
        in_channels: Channels of the input images.
    """

    def __init__(
        self,
        blocks: tuple[int, ...],
        *,
        growth: int = 32,
        init_features: int = 64,
        bn_size: int = 4,
        num_classes: int = 1000,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if not blocks or any(count < 1 for count in blocks):
            raise ValueError(f"blocks must be counts >= 1, got {blocks!r}")
        self.features = nn.Sequential()
        self.features.add_module(
            "conv0",
            nn.Conv2d(in_channels, init_features, kernel_size=7, stride=2, padding=3, bias=False),
        )
        self.features.add_module("norm0", nn.BatchNorm2d(init_features))
        self.features.add_module("relu0", nn.ReLU(inplace=True))
        self.features.add_module("pool0", nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
        channels = init_features
        for index, count in enumerate(blocks):
            block = _DenseBlock(count, channels, growth, bn_size)
            self.features.add_module(f"denseblock{index + 1}", block)
            channels += count * growth
            if index != len(blocks) - 1:
                self.features.add_module(
                    f"transition{index + 1}", _Transition(channels, channels // 2)
                )
                channels //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(channels))
        self.relu = nn.ReLU(inplace=True)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        """Logits for a batch of images."""
        features = self.relu(self.features(x))
        result: Tensor = self.classifier(self.avgpool(features).flatten(1))
        return result


def densenet121(*, num_classes: int = 1000, in_channels: int = 3) -> DenseNet:
    """DenseNet-121: blocks (6, 12, 24, 16), growth 32; 120 convolutions and one linear."""
    return DenseNet((6, 12, 24, 16), num_classes=num_classes, in_channels=in_channels)


def densenet201(*, num_classes: int = 1000, in_channels: int = 3) -> DenseNet:
    """DenseNet-201: blocks (6, 12, 48, 32), growth 32; 200 convolutions and one linear."""
    return DenseNet((6, 12, 48, 32), num_classes=num_classes, in_channels=in_channels)
