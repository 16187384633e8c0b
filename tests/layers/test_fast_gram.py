"""Gram-product factors (Linear A/G, Conv2d G, 1×1 Conv2d A), buffers and aliasing."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from spdkfac.layers.conv2d import conv2d_a_factor, conv2d_g_factor
from spdkfac.layers.correlation import conv2d_a_factor_correlation
from spdkfac.layers.geometry import Conv2dGeometry
from spdkfac.layers.gram import (
    PER_EXAMPLE_MAX_CHANNELS,
    channels_gram,
    conv2d_g_factor_gram,
    linear_a_factor_gram,
    linear_g_factor_gram,
)
from spdkfac.layers.im2col import conv2d_a_factor_im2col
from spdkfac.layers.kernels import (
    clear_workspace,
    gram_into,
    input_scale,
    set_workspace_limit,
    workspace,
)
from spdkfac.layers.linear import linear_a_factor, linear_g_factor


def _randn(*shape: int, seed: int = 0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("side", [1, 5, 127, 128, 129, 300, 517])
def test_gram_into_is_the_exactly_symmetric_product(side: int) -> None:
    matrix = _randn(side, 37, seed=side)
    # A NaN-filled destination: beta=0 must ignore it, and a strided view must work.
    big = torch.full((side + 1, side + 1), float("nan"), dtype=torch.float64)
    out = gram_into(matrix, big[:side, :side], alpha=0.5)
    torch.testing.assert_close(out, 0.5 * matrix @ matrix.T, rtol=1e-12, atol=1e-12)
    assert torch.equal(out, out.T)
    rows = _randn(23, side, seed=side + 1)
    torch.testing.assert_close(
        gram_into(rows.t(), torch.empty(side, side, dtype=torch.float64), alpha=1.0),
        rows.T @ rows,
        rtol=1e-12,
        atol=1e-12,
    )


@pytest.mark.parametrize(("side", "panel"), [(5, None), (300, None), (10, 3), (9, 3)])
def test_gram_into_symmetry_does_not_rely_on_blas(
    monkeypatch: pytest.MonkeyPatch, side: int, panel: int | None
) -> None:
    # BLAS does not promise a bitwise symmetric M Mᵀ (MKL on AMD CPUs rounds entries (i, j)
    # and (j, i) of the diagonal blocks differently): emulate such a BLAS on any CPU by
    # moving the strict lower triangle of each product's leading square one ulp up.
    real_addmm = torch.addmm

    def asymmetric_addmm(
        input: Tensor, mat1: Tensor, mat2: Tensor, *, beta: float, alpha: float, out: Tensor
    ) -> Tensor:
        result = real_addmm(input, mat1, mat2, beta=beta, alpha=alpha, out=out)
        square = result[:, : result.shape[0]]
        lower = torch.ones_like(square, dtype=torch.bool).tril_(-1)
        square[lower] = square[lower].nextafter(torch.tensor(float("inf"), dtype=square.dtype))
        return result

    monkeypatch.setattr(torch, "addmm", asymmetric_addmm)
    matrix = _randn(side, 11, seed=side)
    big = torch.full((side + 2, side + 2), float("nan"), dtype=torch.float64)
    out = gram_into(matrix, big[1 : side + 1, 1 : side + 1], alpha=0.5, panel=panel)
    assert torch.equal(out, out.T)
    torch.testing.assert_close(out, 0.5 * matrix @ matrix.T, rtol=1e-12, atol=1e-12)
    assert big[0].isnan().all() and big[-1].isnan().all()  # nothing outside the view


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(9, 6), (2, 3, 5), (1, 300)])
def test_linear_factors_match_reference(bias: bool, shape: tuple[int, ...]) -> None:
    inputs = _randn(*shape, seed=1)
    torch.testing.assert_close(
        linear_a_factor_gram(inputs, bias), linear_a_factor(inputs, bias), rtol=1e-12, atol=1e-12
    )
    grads = _randn(*shape, seed=2)
    torch.testing.assert_close(
        linear_g_factor_gram(grads), linear_g_factor(grads), rtol=1e-12, atol=1e-12
    )
    # A transposed (non-contiguous) input takes the copying path.
    rows = _randn(shape[-1], 7, seed=3).t()
    torch.testing.assert_close(
        linear_a_factor_gram(rows, bias), linear_a_factor(rows, bias), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize(
    "shape",
    [
        (3, 4, 5, 6),  # few channels: per-example batched product
        (2, 9, 2, 2),  # more channels than positions: copy + triangle
        (2, PER_EXAMPLE_MAX_CHANNELS + 1, 12, 11),  # many channels: copy + triangle
        (1, 3, 1, 1),
    ],
)
@pytest.mark.parametrize("channels_last", [False, True])
def test_conv2d_g_matches_reference(shape: tuple[int, int, int, int], channels_last: bool) -> None:
    grads = _randn(*shape, seed=4)
    if channels_last:
        grads = grads.contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(
        conv2d_g_factor_gram(grads), conv2d_g_factor(grads), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("bias", [True, False])
def test_channels_gram_is_the_1x1_a_factor(bias: bool) -> None:
    for shape in ((3, 4, 5, 6), (2, 9, 2, 2)):
        inputs = _randn(*shape, seed=5)
        count = shape[0] * shape[2] * shape[3]
        geometry = Conv2dGeometry.of(inputs, (1, 1), (1, 1), (0, 0), (1, 1), bias=bias)
        expected = conv2d_a_factor(inputs, geometry)
        result = channels_gram(inputs, alpha=1.0 / count, bias=bias)
        torch.testing.assert_close(result, expected, rtol=1e-12, atol=1e-12)


_CALLS: dict[str, Callable[[Tensor], Tensor]] = {
    "im2col 3x3": lambda x: conv2d_a_factor_im2col(
        x, Conv2dGeometry.of(x, (3, 3), (1, 1), (1, 1), (1, 1), bias=True)
    ),
    "im2col 1x1": lambda x: conv2d_a_factor_im2col(
        x, Conv2dGeometry.of(x, (1, 1), (1, 1), (0, 0), (1, 1), bias=True)
    ),
    "correlation": lambda x: conv2d_a_factor_correlation(
        x, Conv2dGeometry.of(x, (3, 3), (1, 1), (1, 1), (1, 1), bias=True)
    ),
    "conv2d G": conv2d_g_factor_gram,
    "conv2d G many channels": lambda x: conv2d_g_factor_gram(x.repeat(1, 40, 1, 1)),
    "linear A": lambda x: linear_a_factor_gram(x.flatten(1), True),
    "linear G": lambda x: linear_g_factor_gram(x.flatten(1)),
    "bf16 im2col": lambda x: conv2d_a_factor_im2col(
        x,
        Conv2dGeometry.of(
            x, (3, 3), (2, 2), (1, 1), (1, 1), bias=True, compute_dtype=torch.bfloat16
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(_CALLS))
def test_results_never_alias_reused_buffers(name: str) -> None:
    call = _CALLS[name]
    first_input, second_input = _randn(2, 4, 6, 6, seed=6), _randn(2, 4, 6, 6, seed=7)
    first = call(first_input)
    kept = first.clone()
    second = call(second_input)  # same shapes: reuses every workspace
    torch.testing.assert_close(first, kept, rtol=0, atol=0)
    expected_second = second.clone()
    first.add_(1.0)  # the caller accumulates into returned factors
    again = call(second_input)
    torch.testing.assert_close(second, expected_second, rtol=0, atol=0)
    torch.testing.assert_close(again, expected_second, rtol=0, atol=0)


def test_workspace_reuse_limit_and_clear() -> None:
    device = torch.device("cpu")
    try:
        clear_workspace()
        a = workspace("test", (4, 4), torch.float32, device)
        assert workspace("test", (4, 4), torch.float32, device) is a
        assert workspace("other", (4, 4), torch.float32, device) is not a
        zeroed = workspace("zeros", (3,), torch.float32, device, zeroed=True)
        assert torch.equal(zeroed, torch.zeros(3))
        set_workspace_limit(16)  # smaller than one 4x4 float buffer: nothing is kept
        b = workspace("test", (4, 4), torch.float32, device)
        assert workspace("test", (4, 4), torch.float32, device) is not b
        with pytest.raises(ValueError, match="nbytes"):
            set_workspace_limit(-1)
    finally:
        set_workspace_limit(512 * 2**20)


def test_input_scale_is_a_power_of_two_for_float16_only() -> None:
    inputs = torch.full((10,), 300.0)
    assert input_scale(inputs, 100_000, torch.bfloat16) == 1.0
    scale = input_scale(inputs, 100_000, torch.float16)
    assert scale < 1.0 and float(torch.log2(torch.tensor(scale))).is_integer()
    assert 100_000 * (scale * 300.0) ** 2 <= 65504.0
    assert input_scale(torch.zeros(3), 10, torch.float16) == 1.0
