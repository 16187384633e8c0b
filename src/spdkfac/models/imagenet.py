"""ImageNet ResNets (He et al., 2016; torchvision's v1.5 layout): ResNet-50 and ResNet-152."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["Bottleneck", "ImageNetResNet", "resnet50", "resnet152"]


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride, as in torchvision's v1.5), 1x1 expand by 4.

    Module names match ``torchvision.models.resnet.Bottleneck`` (``conv1`` … ``conv3``,
    ``downsample``), so per-layer calibrations of either model apply to both.

    Args:
        in_channels: Channels of the block input.
        width: Channels of the 3x3 convolution; the block outputs ``4 * width``.
        stride: Stride of the 3x3 convolution and of the projection shortcut.
    """

    expansion = 4

    def __init__(self, in_channels: int, width: int, *, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: Tensor) -> Tensor:
        """Return ``relu(main(x) + shortcut(x))``."""
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        result: Tensor = self.relu(out + identity)
        return result


class ImageNetResNet(nn.Module):
    """7x7/2 stem, 3x3/2 max-pool, four bottleneck stages (64…512 wide), GAP, linear.

    Args:
        blocks: Bottleneck blocks per stage, e.g. ``(3, 4, 6, 3)`` for ResNet-50.
        num_classes: Number of output logits.
        in_channels: Channels of the input images.
    """

    def __init__(
        self, blocks: tuple[int, int, int, int], *, num_classes: int = 1000, in_channels: int = 3
    ) -> None:
        super().__init__()
        if len(blocks) != 4 or any(count < 1 for count in blocks):
            raise ValueError(f"blocks must be four counts >= 1, got {blocks!r}")
        self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        channels = 64
        stages: list[nn.Sequential] = []
        for index, (count, width) in enumerate(zip(blocks, (64, 128, 256, 512), strict=True)):
            layers: list[nn.Module] = []
            for block in range(count):
                stride = 2 if index > 0 and block == 0 else 1
                layers.append(Bottleneck(channels, width, stride=stride))
                channels = width * Bottleneck.expansion
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: Tensor) -> Tensor:
        """Logits for a batch of images."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        result: Tensor = self.fc(self.avgpool(x).flatten(1))
        return result


def resnet50(*, num_classes: int = 1000, in_channels: int = 3) -> ImageNetResNet:
    """ResNet-50: (3, 4, 6, 3) bottlenecks, 53 convolutions and one linear layer."""
    return ImageNetResNet((3, 4, 6, 3), num_classes=num_classes, in_channels=in_channels)


def resnet152(*, num_classes: int = 1000, in_channels: int = 3) -> ImageNetResNet:
    """ResNet-152: (3, 8, 36, 3) bottlenecks, 155 convolutions and one linear layer."""
    return ImageNetResNet((3, 8, 36, 3), num_classes=num_classes, in_channels=in_channels)
