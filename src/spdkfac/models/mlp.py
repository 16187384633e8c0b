"""Multi-layer perceptron for small image classification benchmarks."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["MLP"]


class MLP(nn.Module):
    """Three-layer perceptron: Flatten → 256 → 128 → ``num_classes`` with ReLU between.

    Submodules are defined in forward order so ``named_modules()`` lists the linear layers
    in the order they run.

    Args:
        num_classes: Number of output logits.
        in_channels: Channels of the input images.
        input_size: Height and width of the (square) input images.
        hidden_sizes: Widths of the two hidden layers.
    """

    def __init__(
        self,
        *,
        num_classes: int = 10,
        in_channels: int = 1,
        input_size: int = 28,
        hidden_sizes: tuple[int, int] = (256, 128),
    ) -> None:
        super().__init__()
        in_features = in_channels * input_size * input_size
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(in_features, hidden_sizes[0])
        self.relu1 = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(hidden_sizes[0], hidden_sizes[1])
        self.relu2 = nn.ReLU(inplace=True)
        self.fc3 = nn.Linear(hidden_sizes[1], num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Return logits of shape ``[N, num_classes]`` for images ``[N, C, H, W]``."""
        x = self.relu1(self.fc1(self.flatten(x)))
        x = self.relu2(self.fc2(x))
        out: Tensor = self.fc3(x)
        return out
