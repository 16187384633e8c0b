"""Small three-convolution network for Fashion-MNIST and CIFAR-sized images."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["SmallCNN"]


class SmallCNN(nn.Module):
    """Conv(32)-Pool → Conv(64)-Pool → Conv(64)-Pool → Linear(128) → Linear(num_classes).

    Convolutions are 3x3 with padding 1, each followed by ReLU, and each pool halves the
    resolution (rounding down), so the classifier sees ``64 * (input_size // 8) ** 2``
    features (576 at 28x28). The third convolution keeps that classifier input, and so
    the largest K-FAC factor, small. There is no batch normalization, which keeps every
    trainable layer a K-FAC-supported one.

    Args:
        num_classes: Number of output logits.
        in_channels: Channels of the input images.
        input_size: Height and width of the (square) input images; at least 8.
    """

    def __init__(
        self, *, num_classes: int = 10, in_channels: int = 1, input_size: int = 28
    ) -> None:
        super().__init__()
        if input_size < 8:
            raise ValueError(f"input_size must be at least 8 for SmallCNN, got {input_size}")
        pooled = input_size // 8
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=3, padding=1)
        self.relu1 = nn.ReLU(inplace=True)
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3, padding=1)
        self.relu2 = nn.ReLU(inplace=True)
        self.pool2 = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(64, 64, kernel_size=3, padding=1)
        self.relu3 = nn.ReLU(inplace=True)
        self.pool3 = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(64 * pooled * pooled, 128)
        self.relu4 = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Return logits of shape ``[N, num_classes]`` for images ``[N, C, H, W]``."""
        x = self.pool1(self.relu1(self.conv1(x)))
        x = self.pool2(self.relu2(self.conv2(x)))
        x = self.pool3(self.relu3(self.conv3(x)))
        x = self.relu4(self.fc1(self.flatten(x)))
        out: Tensor = self.fc2(x)
        return out
