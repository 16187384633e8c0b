"""Every fast Conv2d A method equals the unfold + aᵀa reference, in float64, for many geometries."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac.layers import Conv2dLayer, FactorOptions
from spdkfac.layers.conv2d import conv2d_a_factor
from spdkfac.layers.correlation import conv2d_a_factor_correlation
from spdkfac.layers.geometry import Conv2dGeometry
from spdkfac.layers.im2col import conv2d_a_factor_im2col
from spdkfac.layers.methods import conv2d_a_factor_fast

Pair = tuple[int, int]
# (kernel, stride, padding, dilation)
Geometry = tuple[Pair, Pair, Pair, Pair]

NAMED = {
    "3x3 same": ((3, 3), (1, 1), (1, 1), (1, 1)),
    "1x1": ((1, 1), (1, 1), (0, 0), (1, 1)),
    "1x1 stride 2": ((1, 1), (2, 2), (0, 0), (1, 1)),
    "1x1 padded": ((1, 1), (1, 1), (1, 2), (1, 1)),
    "3x3 stride 2": ((3, 3), (2, 2), (1, 1), (1, 1)),
    "7x7 stem stride 2 pad 3": ((7, 7), (2, 2), (3, 3), (1, 1)),
    "7x7 stride 1 pad 3": ((7, 7), (1, 1), (3, 3), (1, 1)),
    "dilation 2": ((3, 3), (1, 1), (2, 2), (2, 2)),
    "non-square": ((2, 5), (1, 1), (0, 2), (1, 1)),
    "non-square dilated": ((3, 2), (1, 1), (1, 0), (2, 3)),
    "valid 5x5": ((5, 5), (1, 1), (0, 0), (1, 1)),
    "padding beyond the kernel": ((3, 3), (1, 1), (4, 3), (1, 1)),
    "mixed strides": ((3, 4), (3, 2), (2, 1), (1, 2)),
}


def _random_geometries(count: int, seed: int) -> list[Geometry]:
    rng = random.Random(seed)
    geometries = []
    for _ in range(count):
        kernel = (rng.randint(1, 5), rng.randint(1, 5))
        dilation = (rng.randint(1, 3), rng.randint(1, 3))
        stride = (rng.choice([1, 1, 2, 3]), rng.choice([1, 1, 2]))
        padding = (rng.randint(0, 4), rng.randint(0, 4))
        geometries.append((kernel, stride, padding, dilation))
    return geometries


def _input(geometry: Geometry, seed: int, batch: int | None = None) -> Tensor:
    kernel, _, padding, dilation = geometry
    rng = random.Random(seed)
    smallest = [max(1, dilation[i] * (kernel[i] - 1) + 1 - 2 * padding[i]) for i in range(2)]
    size = [rng.randint(smallest[i], smallest[i] + 9) for i in range(2)]
    generator = torch.Generator().manual_seed(seed)
    shape = (batch or rng.randint(1, 3), rng.randint(1, 4), *size)
    return torch.randn(shape, generator=generator, dtype=torch.float64)


def _methods(stride: Pair) -> list[str]:
    return ["im2col", "correlation"] if stride == (1, 1) else ["im2col"]


def _run(method: str, inputs: Tensor, geometry: Geometry, bias: bool) -> Tensor:
    function = conv2d_a_factor_im2col if method == "im2col" else conv2d_a_factor_correlation
    return function(inputs, Conv2dGeometry.of(inputs, *geometry, bias=bias))


@pytest.mark.parametrize("name", sorted(NAMED))
@pytest.mark.parametrize("bias", [False, True])
def test_named_geometries_match_reference(name: str, bias: bool) -> None:
    geometry = NAMED[name]
    for seed, batch in ((0, 1), (1, 3)):
        inputs = _input(geometry, seed, batch)
        reference = conv2d_a_factor(inputs, Conv2dGeometry.of(inputs, *geometry, bias=bias))
        for method in _methods(geometry[1]):
            result = _run(method, inputs, geometry, bias)
            torch.testing.assert_close(result, reference, rtol=1e-10, atol=1e-12, msg=method)
        auto = conv2d_a_factor_fast(inputs, Conv2dGeometry.of(inputs, *geometry, bias=bias))
        torch.testing.assert_close(auto, reference, rtol=1e-10, atol=1e-12)


def test_random_geometries_match_reference() -> None:
    for index, geometry in enumerate(_random_geometries(120, seed=7)):
        inputs = _input(geometry, seed=index)
        bias = index % 2 == 0
        reference = conv2d_a_factor(inputs, Conv2dGeometry.of(inputs, *geometry, bias=bias))
        for method in _methods(geometry[1]):
            result = _run(method, inputs, geometry, bias)
            torch.testing.assert_close(
                result, reference, rtol=1e-10, atol=1e-12, msg=f"{method} {geometry}"
            )


def test_float32_matches_float64_reference() -> None:
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(4, 6, 12, 10, generator=generator).relu()
    geometry = NAMED["3x3 same"]
    exact = inputs.double()
    reference = conv2d_a_factor(exact, Conv2dGeometry.of(exact, *geometry, bias=True))
    for method in ("im2col", "correlation"):
        result = _run(method, inputs, geometry, True)
        assert result.dtype == torch.float32
        torch.testing.assert_close(result.double(), reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("padding", "padding_mode", "kernel"),
    [("same", "zeros", (4, 3)), ((1, 2), "reflect", (3, 3)), ((1, 1), "circular", (3, 2))],
)
@pytest.mark.parametrize("method", ["auto", "im2col", "correlation"])
def test_adapter_padding_modes(
    padding: str | Pair, padding_mode: str, kernel: Pair, method: str
) -> None:
    torch.manual_seed(4)
    conv = nn.Conv2d(2, 3, kernel, padding=padding, padding_mode=padding_mode).double()
    inputs = torch.randn(2, 2, 7, 8, dtype=torch.float64)
    fast = Conv2dLayer(options=FactorOptions(method=method))  # type: ignore[arg-type]
    reference = Conv2dLayer(options=FactorOptions(method="reference"))
    factor, weight = fast.a_factor(conv, inputs)
    expected, expected_weight = reference.a_factor(conv, inputs)
    assert weight == expected_weight == 2
    torch.testing.assert_close(factor, expected, rtol=1e-10, atol=1e-12)
    # The reference adapter is the documented math: unfold of the explicitly padded input.
    pad = list(conv._reversed_padding_repeated_twice)
    padded = F.pad(inputs, pad, mode="constant" if padding_mode == "zeros" else padding_mode)
    patches = F.unfold(padded, kernel).transpose(1, 2).reshape(-1, 2 * kernel[0] * kernel[1])
    rows = torch.cat([patches, torch.ones(patches.shape[0], 1, dtype=torch.float64)], dim=1)
    torch.testing.assert_close(factor, rows.T @ rows / rows.shape[0], rtol=1e-10, atol=1e-12)


def test_correlation_rejects_strides_other_than_one() -> None:
    inputs = torch.randn(1, 2, 6, 6, dtype=torch.float64)
    with pytest.raises(ValueError, match="stride"):
        conv2d_a_factor_correlation(
            inputs, Conv2dGeometry.of(inputs, (3, 3), (2, 1), (1, 1), (1, 1), bias=False)
        )


def test_forced_correlation_on_stride_two_falls_back_exactly() -> None:
    geometry = NAMED["3x3 stride 2"]
    inputs = _input(geometry, seed=5, batch=2)
    options = FactorOptions(method="correlation")
    shape = Conv2dGeometry.of(inputs, *geometry, bias=True)
    result = conv2d_a_factor_fast(inputs, shape, options=options)
    reference = conv2d_a_factor(inputs, shape)
    torch.testing.assert_close(result, reference, rtol=1e-10, atol=1e-12)
