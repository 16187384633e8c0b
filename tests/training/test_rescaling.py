"""Tests for Osawa et al.'s weight rescaling."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from spdkfac.training.rescaling import rescale_weights_

__all__: list[str] = []


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(4, 3)
        self.small = nn.Linear(3, 2)
        self.conv = nn.Conv2d(2, 5, 3)
        self.bn = nn.BatchNorm2d(5)
        self.tied = nn.Linear(3, 2)
        self.tied.weight = self.small.weight
        with torch.no_grad():
            self.big.weight.fill_(10.0)  # ‖W‖ = 10·√12 > √6: rescaled
            self.big.bias.fill_(50.0)
            self.small.weight.fill_(0.01)  # tiny: left alone
            self.conv.weight.fill_(1.0)  # ‖W‖ = √90 > √10: rescaled to √10
            self.bn.weight.fill_(100.0)


def test_rescale_weights_caps_norms_only() -> None:
    net = _Net()
    small_before = net.small.weight.detach().clone()
    bias_before = net.big.bias.detach().clone()
    assert rescale_weights_(net) == 2
    assert float(net.big.weight.detach().norm()) == pytest.approx(math.sqrt(2 * 3), rel=1e-6)
    assert float(net.conv.weight.detach().norm()) == pytest.approx(math.sqrt(2 * 5), rel=1e-6)
    torch.testing.assert_close(net.big.weight, torch.full((3, 4), 10.0 * math.sqrt(6 / 1200)))
    assert torch.equal(net.small.weight, small_before)
    assert torch.equal(net.big.bias, bias_before)
    assert torch.equal(net.bn.weight, torch.full((5,), 100.0))
    assert net.big.weight.requires_grad and net.big.weight.grad_fn is None
    # already at the cap: s = 1 up to rounding, so at most a no-op rescale
    weight = net.big.weight.detach().clone()
    rescale_weights_(net)
    torch.testing.assert_close(net.big.weight, weight)


def test_rescale_weights_layer_types() -> None:
    net = _Net()
    assert rescale_weights_(net, layer_types=(nn.Conv2d,)) == 1
    assert float(net.big.weight.detach().norm()) == pytest.approx(10 * math.sqrt(12))
    for bad in [(), (nn.BatchNorm2d,), (nn.LayerNorm,), (int,), [nn.Linear]]:
        with pytest.raises(ValueError, match="layer_types"):
            rescale_weights_(net, layer_types=bad)  # type: ignore[arg-type]
