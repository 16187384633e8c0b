"""CIFAR-style residual networks (He et al., 2016) of depth 6n+2, and their wide variants."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["BasicBlock", "CifarResNet", "resnet20", "resnet32", "resnet56", "wide_resnet"]


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual connection.

    When the stride or channel count changes, the shortcut is a 1x1 convolution followed by
    batch normalization (the paper's option B); otherwise it is the identity. The shortcut
    runs after the main branch so that module definition order equals execution order.

    Args:
        in_channels: Channels of the block input.
        out_channels: Channels of the block output.
        stride: Stride of the first convolution and of the projection shortcut.
    """

    def __init__(self, in_channels: int, out_channels: int, *, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(
            in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False
        )
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.shortcut = nn.Identity()
        self.relu2 = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        """Return ``relu(main(x) + shortcut(x))``."""
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        # Out-of-place add: the main-branch output may still be referenced by hooks.
        out = out + self.shortcut(x)
        result: Tensor = self.relu2(out)
        return result


class CifarResNet(nn.Module):
    """ResNet for small images: 3x3 stem, three stages of 16/32/64 channels, GAP, linear.

    Stages two and three halve the resolution in their first block. Global average pooling
    makes the network work for any input size of at least 4 (e.g. 28x28 or 32x32). A
    ``width`` k > 1 multiplies the stage channels (16k/32k/64k) while the stem keeps 16,
    as in wide ResNets; the first block then needs a projection shortcut.

    Args:
        depth: Total number of weighted layers, ``6 * n + 2`` for ``n`` blocks per stage.
        num_classes: Number of output logits.
        in_channels: Channels of the input images.
        width: Channel multiplier of the three stages (an int >= 1).
    """

    def __init__(
        self, depth: int, *, num_classes: int = 10, in_channels: int = 3, width: int = 1
    ) -> None:
        super().__init__()
        if depth < 8 or (depth - 2) % 6 != 0:
            raise ValueError(f"depth must be 6n+2 with n >= 1 (e.g. 20, 32, 56), got {depth}")
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be an int >= 1, got {width!r}")
        blocks_per_stage = (depth - 2) // 6
        channels = (16 * width, 32 * width, 64 * width)
        self.depth = depth
        self.width = width
        self.conv1 = nn.Conv2d(in_channels, 16, kernel_size=3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = _make_stage(16, channels[0], blocks_per_stage, stride=1)
        self.layer2 = _make_stage(channels[0], channels[1], blocks_per_stage, stride=2)
        self.layer3 = _make_stage(channels[1], channels[2], blocks_per_stage, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(channels[2], num_classes)
        _init_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        """Return logits of shape ``[N, num_classes]`` for images ``[N, C, H, W]``."""
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        out: Tensor = self.fc(self.flatten(self.avgpool(x)))
        return out


def _make_stage(in_channels: int, out_channels: int, blocks: int, *, stride: int) -> nn.Sequential:
    layers = [BasicBlock(in_channels, out_channels, stride=stride)]
    layers.extend(BasicBlock(out_channels, out_channels) for _ in range(blocks - 1))
    return nn.Sequential(*layers)


def _init_weights(model: nn.Module) -> None:
    # Kaiming (fan-out) for convolutions as in the paper; unit-scale, zero-shift BN.
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


def resnet20(*, num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    """Build ResNet-20 (3 blocks per stage)."""
    return CifarResNet(20, num_classes=num_classes, in_channels=in_channels)


def resnet32(*, num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    """Build ResNet-32 (5 blocks per stage)."""
    return CifarResNet(32, num_classes=num_classes, in_channels=in_channels)


def resnet56(*, num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    """Build ResNet-56 (9 blocks per stage)."""
    return CifarResNet(56, num_classes=num_classes, in_channels=in_channels)


def wide_resnet(
    depth: int = 16, width: int = 4, *, num_classes: int = 10, in_channels: int = 3
) -> CifarResNet:
    """Build WRN-``depth``-``width`` (Zagoruyko & Komodakis, 2016) on :class:`CifarResNet`.

    WRN names count depth as ``6n + 4`` for ``n`` blocks per stage, so WRN-16-4 has two
    blocks per stage of 64/128/256 channels (a 16-channel stem) and K-FAC factors up to
    256·3·3 = 2304. The blocks are this module's post-activation ones, without dropout.

    Raises:
        ValueError: When ``depth`` is not ``6n + 4`` with n >= 1 or ``width`` < 1.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 10 or (depth - 4) % 6:
        raise ValueError(f"wide ResNet depth must be 6n+4 with n >= 1 (e.g. 16, 28), got {depth}")
    blocks = (depth - 4) // 6
    return CifarResNet(
        6 * blocks + 2, num_classes=num_classes, in_channels=in_channels, width=width
    )
