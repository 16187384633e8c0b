"""Conv2d A factor by im2col into a reused buffer and one triangular Gram product."""

from __future__ import annotations

import torch
from torch import Tensor

from spdkfac.layers.geometry import Conv2dGeometry
from spdkfac.layers.gram import channels_gram
from spdkfac.layers.kernels import factor_kernel, input_scale, second_moment, workspace

__all__ = ["conv2d_a_factor_im2col", "padded_workspace"]


def padded_workspace(
    tag: str,
    inputs: Tensor,
    margins: tuple[int, int, int, int],
    dtype: torch.dtype,
    *,
    scale: float = 1.0,
) -> Tensor:
    """``scale·inputs`` (``[B, C, H, W]``) channel-first in a reused zero-margined buffer.

    Args:
        tag: Role of the buffer (see :func:`~spdkfac.layers.kernels.workspace`).
        inputs: The image.
        margins: Zero rows above and below, zero columns left and right of the image.
        dtype: dtype of the buffer.
        scale: Factor applied while copying (see :func:`~spdkfac.layers.kernels.input_scale`).

    Returns:
        ``[C, B, top+H+bottom, left+W+right]``; the image at rows ``[top, top+H)`` and
        columns ``[left, left+W)``, zeros elsewhere.
    """
    batch, channels, height, width = inputs.shape
    top, bottom, left, right = margins
    shape = (channels, batch, top + height + bottom, left + width + right)
    # The margins are part of the key: every user of this buffer writes the same interior,
    # so the zeros it was created with stay zero and need no refill per call.
    buffer = workspace(f"{tag}:{margins}", shape, dtype, inputs.device, zeroed=True)
    interior = buffer[:, :, top : top + height, left : left + width]
    source = inputs.transpose(0, 1)
    if scale != 1.0:
        torch.mul(source, scale, out=interior)
    else:
        interior.copy_(source)
    return buffer


@factor_kernel
def conv2d_a_factor_im2col(inputs: Tensor, geometry: Conv2dGeometry) -> Tensor:
    """Same as :func:`~spdkfac.layers.conv2d.conv2d_a_factor`, without ``F.unfold``.

    The patch matrix is built transposed, ``[C·kh·kw, B·S]``, by copying the kh·kw
    strided views of the padded input into a buffer reused across calls: each copy moves
    whole output rows, where ``unfold`` followed by the ``[B·S, D]`` transpose touches
    memory far less regularly. Only the upper triangle of the product is computed.

    Args:
        inputs: ``[B, C, H, W]`` layer input, already padded for non-zero padding modes.
        geometry: Its geometry (:meth:`~spdkfac.layers.geometry.Conv2dGeometry.of`): the
            convolution, the bias row and column, and the compute dtype of the patch
            matrix and products (e.g. ``torch.bfloat16``; the GEMM accumulates in fp32).

    Returns:
        New ``[C·kh·kw(+1), C·kh·kw(+1)]`` symmetric factor of the input's dtype.

    Raises:
        ValueError: If ``inputs`` does not have the geometry's shape.
    """
    geometry.check_input(inputs)
    batch, channels, height, width = inputs.shape
    kh, kw = geometry.kernel_size
    stride, padding, dilation = geometry.stride, geometry.padding, geometry.dilation
    dtype, bias = geometry.compute_dtype, geometry.bias
    if geometry.kernel_size == (1, 1) and stride == (1, 1) and padding == (0, 0):
        # The patches are the pixels: no copy at all for few channels.
        count = batch * height * width
        return channels_gram(inputs, alpha=1.0 / float(count), bias=bias, compute_dtype=dtype)
    out_h, out_w = geometry.output_size
    count = batch * out_h * out_w
    dim = geometry.dim
    scale = input_scale(inputs, count, dtype)
    if padding == (0, 0) and scale == 1.0:
        # No padding: the strided views can read the input itself.
        source = inputs.transpose(0, 1)
    else:
        margins = (padding[0], padding[0], padding[1], padding[1])
        source = padded_workspace("im2col_padded", inputs, margins, dtype, scale=scale)
    patches = workspace(
        "im2col_patches", (channels, kh, kw, batch, out_h, out_w), dtype, inputs.device
    )
    row_span = (out_h - 1) * stride[0] + 1
    col_span = (out_w - 1) * stride[1] + 1
    for u in range(kh):
        top = u * dilation[0]
        for v in range(kw):
            left = v * dilation[1]
            patches[:, u, v].copy_(
                source[:, :, top : top + row_span : stride[0], left : left + col_span : stride[1]]
            )
    return second_moment(
        patches.view(dim, count),
        alpha=1.0 / float(count),
        bias=bias,
        out_dtype=inputs.dtype,
        scale=scale,
    )
