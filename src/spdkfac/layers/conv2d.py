"""K-FAC factors for ``nn.Conv2d`` (groups=1): A over the B·S patch rows, G = (1/B)ΣₙΣₛ δδᵀ."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac.layers.base import KFACLayer
from spdkfac.layers.factors import covariance
from spdkfac.layers.geometry import Conv2dGeometry, Pair
from spdkfac.layers.gram import conv2d_g_factor_gram
from spdkfac.layers.methods import conv2d_a_factor_fast
from spdkfac.layers.options import FactorOptions

__all__ = [
    "Conv2dLayer",
    "conv2d_a_factor",
    "conv2d_g_factor",
    "conv2d_geometry",
    "conv2d_patches",
]


def conv2d_patches(inputs: Tensor, geometry: Conv2dGeometry) -> Tensor:
    """The im2col patch matrix ``[B·S, C·kh·kw]`` of a zero-padded 4-D input.

    Raises:
        ValueError: If ``inputs`` does not have the geometry's shape.
    """
    geometry.check_input(inputs)
    columns = F.unfold(
        inputs,
        geometry.kernel_size,
        dilation=geometry.dilation,
        padding=geometry.padding,
        stride=geometry.stride,
    )
    return columns.transpose(1, 2).reshape(-1, columns.shape[1])


def conv2d_a_factor(inputs: Tensor, geometry: Conv2dGeometry) -> Tensor:
    """A = mean over the B·S patch rows of x̄x̄ᵀ (x̄ = [x, 1] with a bias).

    Computed in the input's dtype, whatever the geometry's compute dtype.

    Args:
        inputs: ``[B, C, H, W]`` layer input, already padded for non-zero padding modes.
        geometry: Its geometry (:meth:`Conv2dGeometry.of`; ``bias``: a constant-1 column).

    Returns:
        ``[C·kh·kw(+1), C·kh·kw(+1)]`` symmetric factor.

    Raises:
        ValueError: If ``inputs`` does not have the geometry's shape.
    """
    return covariance(conv2d_patches(inputs, geometry), bias=geometry.bias)


def conv2d_g_factor(grad_output: Tensor) -> Tensor:
    """G = (1/B) Σₙ Σₛ δₙₛδₙₛᵀ with δ = B·g, for ``grad_output`` of shape ``[B, O, oh, ow]``."""
    batch, channels = grad_output.shape[0], grad_output.shape[1]
    rows = grad_output.movedim(1, -1).reshape(-1, channels)
    # covariance divides by B·S; the convention wants B·Σ g gᵀ = B·(B·S)·covariance.
    return covariance(rows, bias=False).mul_(float(batch) * float(rows.shape[0]))


def _as_pair(value: int | tuple[int, ...]) -> Pair:
    if isinstance(value, int):
        return (value, value)
    return (int(value[0]), int(value[1]))


def conv2d_geometry(
    module: nn.Conv2d, inputs: Tensor, *, bias: bool, compute_dtype: torch.dtype | None = None
) -> tuple[Tensor, Conv2dGeometry]:
    """The input the A factor functions take and its geometry, for ``module``'s input.

    Padding ``unfold`` cannot express (string modes, non-zero padding modes) is applied to
    ``inputs`` here; the geometry keeps only the symmetric zero padding left to add.

    Args:
        module: A ``groups=1`` convolution.
        inputs: Its ``[B, C, H, W]`` input.
        bias: Append the bias row and column.
        compute_dtype: Requested compute dtype (None: the input's).
    """
    inputs, padding = _explicit_padding(module, inputs)
    geometry = Conv2dGeometry.of(
        inputs,
        _as_pair(module.kernel_size),
        _as_pair(module.stride),
        padding,
        _as_pair(module.dilation),
        bias=bias,
        compute_dtype=compute_dtype,
    )
    return inputs, geometry


class Conv2dLayer(KFACLayer):
    """Adapter for ``nn.Conv2d`` with ``groups == 1``, any stride, padding and dilation.

    Args:
        options: How factors are computed (method, compute dtype); the default picks the
            fastest exact method per layer. ``FactorOptions(method="reference")`` runs
            :func:`conv2d_a_factor` and :func:`conv2d_g_factor`.
    """

    module_types = (nn.Conv2d,)

    def __init__(self, *, options: FactorOptions | None = None) -> None:
        self.options = FactorOptions() if options is None else options

    def with_options(self, options: FactorOptions) -> Conv2dLayer:
        return Conv2dLayer(options=options)

    def supports(self, module: nn.Module) -> bool:
        return isinstance(module, nn.Conv2d) and module.groups == 1

    def a_dim(self, module: nn.Module) -> int:
        assert isinstance(module, nn.Conv2d)
        kh, kw = _as_pair(module.kernel_size)
        return module.in_channels * kh * kw + int(self.has_bias(module))

    def g_dim(self, module: nn.Module) -> int:
        assert isinstance(module, nn.Conv2d)
        return module.out_channels

    def a_factor(self, module: nn.Module, inputs: Tensor) -> tuple[Tensor, int]:
        assert isinstance(module, nn.Conv2d)
        inputs, geometry = conv2d_geometry(
            module, inputs, bias=self.has_bias(module), compute_dtype=self.options.compute_dtype
        )
        if self.options.method == "reference":
            factor = conv2d_a_factor(inputs, geometry)
        else:
            factor = conv2d_a_factor_fast(inputs, geometry, options=self.options)
        return factor, inputs.shape[0]

    def g_factor(self, module: nn.Module, grad_output: Tensor) -> tuple[Tensor, int]:
        if self.options.method == "reference":
            return conv2d_g_factor(grad_output), grad_output.shape[0]
        factor = conv2d_g_factor_gram(grad_output, compute_dtype=self.options.compute_dtype)
        return factor, grad_output.shape[0]


def _explicit_padding(module: nn.Conv2d, inputs: Tensor) -> tuple[Tensor, Pair]:
    """Apply the padding that unfold cannot express (string modes, non-zero padding modes).

    Returns the input to unfold and the symmetric zero padding unfold should still add.
    """
    if isinstance(module.padding, str) or module.padding_mode != "zeros":
        # The module's own forward pads with this 4-tuple; reuse it so geometry matches.
        pad = module._reversed_padding_repeated_twice
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        if any(pad):
            inputs = F.pad(inputs, list(pad), mode=mode)
        return inputs, (0, 0)
    return inputs, _as_pair(module.padding)
