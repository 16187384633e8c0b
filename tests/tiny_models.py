"""Small float64 models shared by tests that train a few steps on every rank."""

from __future__ import annotations

import torch
from torch import nn


def conv_net(hidden: int = 6) -> nn.Module:
    """Conv2d(2→3) on 4×4 inputs, then two Linear layers; seeded, float64."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(48, hidden),
        nn.Tanh(),
        nn.Linear(hidden, 3),
    ).double()
