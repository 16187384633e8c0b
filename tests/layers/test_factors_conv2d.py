"""Conv2d A and G factors against explicit per-example, per-position float64 loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_reference import explicit_conv_patches, outer_mean, output_grad, with_one
from spdkfac import KFACPreconditioner
from spdkfac.layers.conv2d import Conv2dLayer

CLASSES = 3
# (kernel, stride, padding, dilation, bias, input height/width)
GEOMETRIES = [
    ((3, 5), (2, 2), (1, 2), (1, 1), True, (9, 11)),
    ((3, 3), (1, 1), (1, 1), (2, 2), True, (8, 8)),
    ((1, 1), (1, 1), (0, 0), (1, 1), False, (5, 6)),
    ((2, 3), (3, 2), (0, 1), (1, 2), True, (10, 9)),
    ((7, 7), (2, 2), (3, 3), (1, 1), False, (12, 12)),
]


def _conv_reference(
    conv: nn.Conv2d,
    head: nn.Linear,
    inputs: Tensor,
    targets: Tensor,
    padded: Tensor,
    padding: tuple[int, int],
) -> tuple[Tensor, Tensor]:
    kernel = (int(conv.kernel_size[0]), int(conv.kernel_size[1]))
    stride = (int(conv.stride[0]), int(conv.stride[1]))
    dilation = (int(conv.dilation[0]), int(conv.dilation[1]))
    bias = conv.bias is not None
    patches = explicit_conv_patches(padded, kernel, stride, padding, dilation)
    rows = [with_one(p) if bias else p for per_example in patches for p in per_example]
    a_ref = outer_mean(rows)
    batch = inputs.shape[0]
    g_ref = torch.zeros(conv.out_channels, conv.out_channels, dtype=torch.float64)
    for n in range(batch):
        delta = output_grad(
            conv(inputs[n : n + 1]),
            lambda y, t=targets[n]: F.cross_entropy(head(torch.relu(y).flatten(1)), t[None]),
        )[0]
        positions = delta.reshape(conv.out_channels, -1)
        g_ref += positions @ positions.T
    return a_ref, g_ref / batch


def _run(
    conv: nn.Conv2d, size: tuple[int, int], batch: int = 3
) -> tuple[Tensor, Tensor, Tensor, Tensor, nn.Linear]:
    torch.manual_seed(0)
    inputs = torch.randn(batch, conv.in_channels, *size, dtype=torch.float64)
    with torch.no_grad():
        out_shape = conv(inputs[:1]).shape
    head = nn.Linear(out_shape[1:].numel(), CLASSES).double()
    # ReLU(inplace=True) right after the conv: G must still be the conv output's gradient.
    model = nn.Sequential(conv, nn.ReLU(inplace=True), nn.Flatten(), head)
    targets = torch.randint(0, CLASSES, (batch,))
    precond = KFACPreconditioner(model, kl_clip=None)
    F.cross_entropy(model(inputs), targets).backward()
    precond.step()
    a_factor, g_factor = precond.factors("0")
    assert a_factor is not None and g_factor is not None
    return a_factor, g_factor, inputs, targets, head


Geometry = tuple[tuple[int, int], tuple[int, int], tuple[int, int], tuple[int, int], bool,
                 tuple[int, int]]  # fmt: skip


def _conv_of(geometry: Geometry) -> nn.Conv2d:
    kernel, stride, padding, dilation, bias, _ = geometry
    conv = nn.Conv2d(2, 3, kernel, stride=stride, padding=padding, dilation=dilation, bias=bias)
    return conv.double()


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_conv2d_factors_match_reference(geometry: Geometry) -> None:
    torch.manual_seed(3)
    conv = _conv_of(geometry)
    a_factor, g_factor, inputs, targets, head = _run(conv, geometry[-1])
    a_ref, g_ref = _conv_reference(conv, head, inputs, targets, inputs, geometry[2])
    torch.testing.assert_close(a_factor, a_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_factor, g_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("padding", "padding_mode"), [("same", "zeros"), ((1, 2), "reflect"), ((1, 1), "circular")]
)
def test_conv2d_string_padding_and_padding_modes(
    padding: str | tuple[int, int], padding_mode: str
) -> None:
    torch.manual_seed(4)
    conv = nn.Conv2d(2, 3, (4, 3), padding=padding, padding_mode=padding_mode).double()
    a_factor, g_factor, inputs, targets, head = _run(conv, (7, 8))
    pad = list(conv._reversed_padding_repeated_twice)
    mode = "constant" if padding_mode == "zeros" else padding_mode
    padded = F.pad(inputs, pad, mode=mode)
    a_ref, g_ref = _conv_reference(conv, head, inputs, targets, padded, (0, 0))
    torch.testing.assert_close(a_factor, a_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_factor, g_ref, rtol=1e-10, atol=1e-12)


def test_grouped_conv_is_registered() -> None:
    model = nn.Sequential(nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(), nn.Linear(36, 2))
    precond = KFACPreconditioner(model)
    assert precond.layers == ["0", "2"]


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_conv2d_reduce_a_factor_is_the_mean_patches_second_moment(geometry: Geometry) -> None:
    """K-FAC-reduce (Eschenhagen et al., NeurIPS 2023, Sec. 3): A from each example's mean
    patch, here computed without building the patches, against explicit loops."""
    torch.manual_seed(5)
    kernel, stride, padding, dilation, bias, size = geometry
    inputs = torch.randn(3, 2, *size, dtype=torch.float64)
    a_factor, count = Conv2dLayer(weight_sharing="reduce").a_factor(_conv_of(geometry), inputs)
    patches = explicit_conv_patches(inputs, kernel, stride, padding, dilation)
    means = [torch.stack(per_example).mean(0) for per_example in patches]
    a_ref = outer_mean([with_one(m) if bias else m for m in means])
    assert count == 3
    torch.testing.assert_close(a_factor, a_ref, rtol=1e-10, atol=1e-12)
