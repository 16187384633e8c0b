"""Conv2d A factor from spatial auto-correlations of the input, without building patches.

For stride 1, the A block of kernel offsets (u,v) and (u',v') is a sum over the output
positions p of x[p + (u,v)·dil] x[p + (u',v')·dil]ᵀ, i.e. the correlation of the input
with itself at the relative shift Δ = (u'−u, v'−v)·dil, summed over a window of first
positions that depends on (u,v). The correlation over the whole image at one Δ is one
thin GEMM on a zero-bordered flat copy of the input (C²·B·H·W multiply-adds; only the
(2kh−1)(2kw−1)/2 shifts are needed, against (C·kh·kw)²·B·S/2 for
the patch product); the windows differ from the whole image only by strips along the
borders, which are subtracted exactly (see :mod:`~spdkfac.layers.correlation_plan`).
Blocks with u' < u are transposes of computed ones.
"""

from __future__ import annotations

import torch
from torch import Tensor

from spdkfac.layers.correlation_plan import StripGroup, Term, correlation_plan
from spdkfac.layers.geometry import Conv2dGeometry, Pair
from spdkfac.layers.kernels import factor_kernel, input_scale, workspace

__all__ = ["conv2d_a_factor_correlation", "correlation_supported"]


def correlation_supported(stride: Pair) -> bool:
    """Whether :func:`conv2d_a_factor_correlation` handles this stride (only stride 1)."""
    return tuple(stride) == (1, 1)


class _FlatImage:
    """The input in one reused buffer ``[C, lead + Hp·B·Wp + tail]``, image rows interleaved.

    Flat index ``r·B·Wp + n·Wp + c`` holds image n at row r, column c. Each image row is
    followed by ``(kw−1)·dw`` zero columns, the last row by ``(kh−1)·dh`` zero rows, and
    the buffer starts and ends with zeros, so a shift (a·dh, b·dw) of the whole batch is
    one offset of the flat index: a shifted position that leaves its image lands on a
    zero, never on another image. A shifted batch is then a view, and only the column
    margins (not a margin per image) are multiplied in vain.
    """

    def __init__(self, inputs: Tensor, geometry: Conv2dGeometry, scale: float) -> None:
        kernel_size, dilation, dtype = (
            geometry.kernel_size,
            geometry.dilation,
            geometry.compute_dtype,
        )
        batch, channels, height, width = inputs.shape
        self.size = (height, width)
        self.lead = (kernel_size[1] - 1) * dilation[1]
        line = width + self.lead
        self.row = batch * line  # flat offset of one image row
        self.length = height * self.row
        tail = (kernel_size[0] - 1) * dilation[0] * self.row + self.lead
        # The geometry is in the tag: every user writes the same interior, so the zeros
        # the buffer was created with stay zero.
        tag = f"correlation:{batch}x{height}x{width}:{kernel_size}:{dilation}"
        shape = (channels, self.lead + self.length + tail)
        self.buffer = workspace(tag, shape, dtype, inputs.device, zeroed=True)
        rows = height + (kernel_size[0] - 1) * dilation[0]
        # [C, B, rows, line] view (strides: buffer row, line, row, 1) of the interleaved data.
        self.images = (
            self.buffer[:, self.lead : self.lead + rows * self.row]
            .unflatten(1, (rows, batch, line))
            .transpose(1, 2)
        )
        interior = self.images[:, :, :height, :width]
        if scale != 1.0:
            torch.mul(inputs.transpose(0, 1), scale, out=interior)
        else:
            interior.copy_(inputs.transpose(0, 1))

    def shifted(self, a: int, b: int) -> Tensor:
        """``[C, H·B·Wp]``: entry m is the input at flat position m shifted by (a, b)."""
        start = self.lead + a * self.row + b
        return self.buffer[:, start : start + self.length]


def _correlate_whole(image: _FlatImage, term: Term, dilation: Pair, out: Tensor) -> None:
    """``out[s] = Σ_P x[:, P] x[:, P + shift_s]ᵀ`` over the whole image: one GEMM per shift.

    Both operands are views of the flat buffer (BLAS reads the shift as an offset), so
    nothing is copied or allocated. A convolution of the image with itself (the image as
    the kernel) does the same multiply-adds in one call, but its kernel reordering
    allocates and faults in fresh memory on every call, which made it slower between
    other work; and oneDNN 3.12 (torch 2.13) returns wrong bf16 results for such
    convolutions with 8 or 12 input channels (here: batch 8), so it is not used at all.
    """
    first = image.shifted(0, 0)
    for index, (a, b) in enumerate(term.shifts):
        torch.mm(first, image.shifted(a * dilation[0], b * dilation[1]).t(), out=out[index])


def _correlate_strips(image: _FlatImage, group: StripGroup, dilation: Pair, out: Tensor) -> None:
    """The same for a group of equally shaped border strips: copies and one batched product.

    The shifted regions of a strip are one overlapping strided view of the image, and
    when the strips' origins form a grid, so are those of the whole group: one copy
    gathers them all. A strip's own region is its (0, 0) shift when it has one.
    """
    images = image.images
    channels, batch = images.shape[0], images.shape[1]
    rows, cols, a_count, b_count = group.shape
    area, shifts = rows * cols, a_count * b_count
    step_c, step_b, step_r, _ = images.stride()
    shape = (group.terms, shifts * channels, batch * area)
    second = workspace("strip_second", shape, out.dtype, out.device)
    region_strides = (dilation[0] * step_r, dilation[1], step_c, step_b, step_r, 1)
    base = images.storage_offset() + group.a0 * dilation[0] * step_r + group.b0 * dilation[1]
    if group.grid is not None:
        (row, col), (row_count, row_step, col_count, col_step) = group.origins[0], group.grid
        view = images.as_strided(
            (row_count, col_count, a_count, b_count, channels, batch, rows, cols),
            (row_step * step_r, col_step, *region_strides),
            base + row * step_r + col,
        )
        second.view(view.shape).copy_(view)
    else:
        for index, (row, col) in enumerate(group.origins):
            view = images.as_strided(
                (a_count, b_count, channels, batch, rows, cols),
                region_strides,
                base + row * step_r + col,
            )
            second[index].view(view.shape).copy_(view)
    if group.own_shift is not None:
        start = group.own_shift * channels
        first = second[:, start : start + channels]
    else:
        first = workspace("strip_first", (shape[0], channels, shape[2]), out.dtype, out.device)
        for index, (row, col) in enumerate(group.origins):
            region = images[:, :, row : row + rows, col : col + cols]
            first[index].view(channels, batch, rows, cols).copy_(region)
    product = torch.bmm(first, second.transpose(1, 2))  # [terms, o, (shift, i)]
    out.view(group.terms, shifts, channels, channels).copy_(
        product.view(group.terms, channels, shifts, channels).transpose(1, 2)
    )


@factor_kernel
def conv2d_a_factor_correlation(inputs: Tensor, geometry: Conv2dGeometry) -> Tensor:
    """Same as :func:`~spdkfac.layers.conv2d.conv2d_a_factor`, from auto-correlations.

    Args:
        inputs: ``[B, C, H, W]`` layer input, already padded for non-zero padding modes.
        geometry: Its geometry (:meth:`~spdkfac.layers.geometry.Conv2dGeometry.of`); the
            stride must be 1 (see :func:`correlation_supported`). Its compute dtype is
            that of the correlations (e.g. ``torch.bfloat16``; the GEMMs accumulate in
            fp32).

    Returns:
        New ``[C·kh·kw(+1), C·kh·kw(+1)]`` symmetric factor of the input's dtype.

    Raises:
        ValueError: If the stride is not 1, or ``inputs`` does not have the geometry's
            shape.
    """
    if not correlation_supported(geometry.stride):
        raise ValueError(
            f"the correlation method needs stride (1, 1), got {tuple(geometry.stride)}"
        )
    geometry.check_input(inputs)
    channels, (height, width) = geometry.channels, geometry.size
    kh, kw = geometry.kernel_size
    dilation, bias, dtype = geometry.dilation, geometry.bias, geometry.compute_dtype
    count = geometry.rows
    dim = geometry.dim
    plan = correlation_plan(geometry, inputs.device)
    scale = input_scale(inputs, count, dtype)
    image = _FlatImage(inputs, geometry, scale)
    # Products land in the compute dtype; a low-precision copy is widened once, here.
    shape = (plan.rows, channels, channels)
    raw = workspace("correlation_stacked", shape, dtype, inputs.device)
    if plan.whole is not None:
        _correlate_whole(image, plan.whole, dilation, raw[: len(plan.whole.shifts)])
    for group in plan.groups:
        rows = raw[group.start : group.start + group.terms * group.shifts]
        _correlate_strips(image, group, dilation, rows)
    stacked = raw.to(inputs.dtype, copy=True)
    stacked[-1].zero_()
    stacked.mul_(1.0 / (float(count) * scale * scale))
    blocks = stacked.index_select(0, plan.initial)
    if plan.plus[0].numel():
        blocks.index_add_(0, plan.plus[0], stacked.index_select(0, plan.plus[1]))
    if plan.minus[0].numel():
        blocks.index_add_(0, plan.minus[0], stacked.index_select(0, plan.minus[1]), alpha=-1)

    factor = torch.empty(dim + int(bias), dim + int(bias), dtype=inputs.dtype, device=inputs.device)
    # [K, K, C, C] view of the patch block: factor[c·K + p, c'·K + q] = view[p, q, c, c'].
    by_offset = (
        factor[:dim, :dim].unflatten(0, (channels, kh * kw)).unflatten(2, (channels, kh * kw))
    )
    by_offset = by_offset.permute(1, 3, 0, 2)
    by_offset[plan.first, plan.second] = blocks
    off = plan.diagonal
    by_offset[plan.second[off:], plan.first[off:]] = blocks[off:].transpose(1, 2)
    if bias:
        integral = inputs.new_zeros(channels, height + 1, width + 1)
        integral[:, 1:, 1:] = inputs.sum(dim=0).cumsum(dim=1).cumsum(dim=2)
        flat = integral.view(channels, -1)
        corners = flat[:, plan.corners.view(-1)].view(channels, 4, -1)
        sums = (corners[:, 0] - corners[:, 1] - corners[:, 2] + corners[:, 3]).reshape(-1)
        sums.mul_(1.0 / float(count))
        factor[:dim, dim] = sums
        factor[dim, :dim] = sums
        factor[dim, dim] = 1.0
    return factor
