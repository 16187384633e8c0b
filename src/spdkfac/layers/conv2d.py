"""K-FAC factors for ``nn.Conv2d`` (groups=1): A over the B·S patch rows, G = (1/B)ΣₙΣₛ δδᵀ.

The S output positions share the weight: the default (K-FAC-expand, Eschenhagen et al.,
NeurIPS 2023, Sec. 3) treats each patch as a row of A; K-FAC-reduce averages each
example's patches and sums its output gradients over the positions first:
``A = (1/B) Σₙ p̄ₙp̄ₙᵀ``, ``G = (1/B) Σₙ δ̂ₙδ̂ₙᵀ`` with ``δ̂ₙ = B Σₛ gₙₛ`` (``curvlinops``'
definitions for a loss per example). Grouped convolutions are handled one group at a time
by :class:`spdkfac.curvature.grouped.GroupedConvBlock` with this adapter's math.
"""

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
from spdkfac.types import WeightSharing

__all__ = [
    "Conv2dLayer",
    "conv2d_a_factor",
    "conv2d_g_factor",
    "conv2d_g_factor_reduce",
    "conv2d_geometry",
    "conv2d_mean_patches",
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


def _taps(
    size: int, out: int, kernel: int, stride: int, padding: int, dilation: int, like: Tensor
) -> Tensor:
    """``[kernel, size]``: entry (i, h) is 1 when kernel tap i reads input row (column) h at
    some output position (reads of the zero padding have no entry)."""
    taps = like.new_zeros(kernel, size)
    for tap in range(kernel):
        read = torch.arange(out, device=like.device) * stride + tap * dilation - padding
        taps[tap, read[(read >= 0) & (read < size)]] = 1.0
    return taps


def conv2d_mean_patches(inputs: Tensor, geometry: Conv2dGeometry) -> Tensor:
    """Each example's mean im2col patch, ``[B, C·kh·kw]`` (the mean over its rows of
    :func:`conv2d_patches`), without building the patches.

    Tap (i, j) of the kernel reads, over all output positions, input rows ``R_i`` and
    columns ``C_j``, so its sum is ``R_i x C_jᵀ`` per example and channel: two thin
    products of the input with 0/1 tap matrices (one pass over the input, no padding
    copy, instead of the ``B·S × C·kh·kw`` patch matrix).
    """
    geometry.check_input(inputs)
    batch, channels, height, width = inputs.shape
    (out_h, out_w), (kernel_h, kernel_w) = geometry.output_size, geometry.kernel_size
    rows = _taps(height, out_h, kernel_h, geometry.stride[0], geometry.padding[0],
                 geometry.dilation[0], inputs)  # fmt: skip
    columns = _taps(width, out_w, kernel_w, geometry.stride[1], geometry.padding[1],
                    geometry.dilation[1], inputs)  # fmt: skip
    by_column = inputs.reshape(-1, width) @ columns.t()  # [B·C·H, kw]
    by_row = by_column.view(batch * channels, height, kernel_w).transpose(0, 1)
    sums = rows @ by_row.reshape(height, -1)  # [kh, B·C·kw]
    sums = sums.view(kernel_h, batch * channels, kernel_w).transpose(0, 1)
    # [B·C, kh, kw] is unfold's column order within each example.
    return sums.reshape(batch, -1).div_(float(out_h * out_w))


def conv2d_a_factor_reduce(inputs: Tensor, geometry: Conv2dGeometry) -> Tensor:
    """K-FAC-reduce A: the second moment of each example's mean patch (p̄ = [p, 1])."""
    return covariance(conv2d_mean_patches(inputs, geometry), bias=geometry.bias)


def conv2d_g_factor_reduce(grad_output: Tensor) -> Tensor:
    """K-FAC-reduce G: ``(1/B) Σₙ δ̂ₙδ̂ₙᵀ`` with ``δ̂ₙ = B Σₛ gₙₛ``."""
    batch = grad_output.shape[0]
    sums = grad_output.reshape(batch, grad_output.shape[1], -1).sum(dim=2)
    return covariance(sums, bias=False).mul_(float(batch) * float(batch))


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
        weight_sharing: ``"expand"`` (patches as rows) or ``"reduce"`` (per-example means).
    """

    module_types: tuple[type[nn.Module], ...] = (nn.Conv2d,)

    def __init__(
        self, *, options: FactorOptions | None = None, weight_sharing: WeightSharing = "expand"
    ) -> None:
        self.options = FactorOptions() if options is None else options
        self.weight_sharing = weight_sharing

    def with_options(
        self, options: FactorOptions, *, weight_sharing: WeightSharing = "expand"
    ) -> Conv2dLayer:
        return type(self)(options=options, weight_sharing=weight_sharing)

    def supports(self, module: nn.Module) -> bool:
        return isinstance(module, self.module_types) and getattr(module, "groups", 1) == 1

    def a_dim(self, module: nn.Module) -> int:
        """Inputs per output unit (one group's), plus 1 with a bias."""
        weight = module.weight
        assert isinstance(weight, Tensor)
        # From the shape: indexing a sharded (DTensor) weight would be a collective.
        return weight.shape[1:].numel() + int(self.has_bias(module))

    def g_dim(self, module: nn.Module) -> int:
        """Output channels (of all groups)."""
        weight = module.weight
        assert isinstance(weight, Tensor)
        return weight.shape[0]

    def geometry(self, module: nn.Module, inputs: Tensor) -> tuple[Tensor, Conv2dGeometry]:
        """The 4-D input the A functions take and its geometry."""
        assert isinstance(module, nn.Conv2d)
        return conv2d_geometry(
            module, inputs, bias=self.has_bias(module), compute_dtype=self.options.compute_dtype
        )

    def grad_4d(self, grad_output: Tensor) -> Tensor:
        """The output gradient as ``[B, O, oh, ow]``."""
        return grad_output

    def a_factor(self, module: nn.Module, inputs: Tensor) -> tuple[Tensor, int]:
        inputs, geometry = self.geometry(module, inputs)
        if self.weight_sharing == "reduce":
            factor = conv2d_a_factor_reduce(inputs, geometry)
        elif self.options.method == "reference":
            factor = conv2d_a_factor(inputs, geometry)
        else:
            factor = conv2d_a_factor_fast(inputs, geometry, options=self.options)
        return factor, inputs.shape[0]

    def g_factor(self, module: nn.Module, grad_output: Tensor) -> tuple[Tensor, int]:
        grad_output = self.grad_4d(grad_output)
        if self.weight_sharing == "reduce":
            return conv2d_g_factor_reduce(grad_output), grad_output.shape[0]
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
