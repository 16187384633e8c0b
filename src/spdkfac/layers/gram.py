"""Factors that are one Gram product of the captured tensor: Linear A and G, Conv2d G."""

from __future__ import annotations

import torch
from torch import Tensor

from spdkfac.layers.kernels import (
    factor_kernel,
    input_scale,
    resolve_compute_dtype,
    second_moment,
    workspace,
)

__all__ = [
    "PER_EXAMPLE_MAX_CHANNELS",
    "channels_gram",
    "conv2d_g_factor_gram",
    "linear_a_factor_gram",
    "linear_g_factor_gram",
    "rows_gram",
]


@factor_kernel
def rows_gram(
    rows: Tensor, *, alpha: float, bias: bool, compute_dtype: torch.dtype | None = None
) -> Tensor:
    """``alpha · r̄ᵀr̄`` over the rows of ``rows`` (``[N, D]``), r̄ = [r, 1] with a bias.

    Computes one triangle with a BLAS product on ``rows`` as it lies in memory (no copy
    when it already has the compute dtype and unit stride in one dimension).

    Args:
        rows: ``[N, D]`` matrix.
        alpha: Scale of the product.
        bias: Append the bias row and column.
        compute_dtype: dtype of the products (e.g. ``torch.bfloat16``); None keeps ``rows``'.

    Returns:
        New ``[D(+1), D(+1)]`` tensor of ``rows``' dtype.
    """
    count, dim = rows.shape
    dtype = resolve_compute_dtype(compute_dtype, rows.dtype, rows=count, dim=dim)
    scale = input_scale(rows, count, dtype)
    if dtype == rows.dtype and scale == 1.0 and (rows.stride(0) == 1 or rows.stride(1) == 1):
        columns = rows.t()
    else:
        buffer = workspace("rows_gram", rows.shape, dtype, rows.device)
        if scale != 1.0:
            torch.mul(rows, scale, out=buffer)
        else:
            buffer.copy_(rows)
        columns = buffer.t()
    return second_moment(columns, alpha=alpha, bias=bias, out_dtype=rows.dtype, scale=scale)


def linear_a_factor_gram(
    inputs: Tensor, bias: bool, *, compute_dtype: torch.dtype | None = None
) -> Tensor:
    """Same as :func:`~spdkfac.layers.linear.linear_a_factor`, one triangle, no ones column."""
    rows = inputs.reshape(-1, inputs.shape[-1])
    return rows_gram(rows, alpha=1.0 / float(rows.shape[0]), bias=bias, compute_dtype=compute_dtype)


def linear_g_factor_gram(
    grad_output: Tensor, *, compute_dtype: torch.dtype | None = None
) -> Tensor:
    """Same as :func:`~spdkfac.layers.linear.linear_g_factor`: N·gᵀg over the N folded rows."""
    rows = grad_output.reshape(-1, grad_output.shape[-1])
    return rows_gram(rows, alpha=float(rows.shape[0]), bias=False, compute_dtype=compute_dtype)


#: Up to this many channels a per-example batched product (full, not triangular) beats
#: copying to ``[C, B·S]`` and one triangular product: measured on a 1-thread CPU.
PER_EXAMPLE_MAX_CHANNELS = 128


@factor_kernel
def channels_gram(
    tensor: Tensor, *, alpha: float, bias: bool, compute_dtype: torch.dtype | None = None
) -> Tensor:
    """``alpha · Σₙ Σₛ t̄ₙₛ t̄ₙₛᵀ`` over the channel vectors of ``tensor`` (``[B, C, ...]``).

    t̄ = [t, 1] with a bias. A channels-last tensor is used in place. A channel-first one
    with few channels (see :data:`PER_EXAMPLE_MAX_CHANNELS`) and at least as many
    positions is multiplied per example as it lies (``[C, S]`` slices, one batched
    product, a sum over examples); otherwise one copy lays it out as ``[C, B·S]`` (the
    copy ``unfold`` or ``movedim`` makes too, but into a reused buffer).

    Returns:
        New ``[C(+1), C(+1)]`` tensor of ``tensor``'s dtype.
    """
    batch, channels = tensor.shape[0], tensor.shape[1]
    positions = tensor[0, 0].numel()
    count = batch * positions
    dtype = resolve_compute_dtype(compute_dtype, tensor.dtype, rows=count, dim=channels)
    rows_view = tensor.movedim(1, -1)
    if rows_view.is_contiguous():
        rows = rows_view.reshape(-1, channels)
        return rows_gram(rows, alpha=alpha, bias=bias, compute_dtype=dtype)
    per_example = tensor.reshape(batch, channels, positions)
    if (
        dtype == tensor.dtype
        and channels <= PER_EXAMPLE_MAX_CHANNELS
        and channels <= positions
        and per_example.is_contiguous()
    ):
        products = torch.bmm(per_example, per_example.transpose(1, 2)).sum(dim=0)
        out = tensor.new_empty(channels + int(bias), channels + int(bias))
        torch.mul(products, alpha, out=out[:channels, :channels])
        if bias:
            sums = per_example.sum(dim=(0, 2)).mul_(alpha)
            out[:channels, channels] = sums
            out[channels, :channels] = sums
            out[channels, channels] = alpha * float(batch * positions)
        return out
    scale = input_scale(tensor, count, dtype)
    buffer = workspace("channels_gram", (channels, batch, positions), dtype, tensor.device)
    source = per_example.transpose(0, 1)
    if scale != 1.0:
        torch.mul(source, scale, out=buffer)
    else:
        buffer.copy_(source)
    columns = buffer.view(channels, -1)
    return second_moment(columns, alpha=alpha, bias=bias, out_dtype=tensor.dtype, scale=scale)


def conv2d_g_factor_gram(
    grad_output: Tensor, *, compute_dtype: torch.dtype | None = None
) -> Tensor:
    """Same as :func:`~spdkfac.layers.conv2d.conv2d_g_factor`: B·ΣₙΣₛ g gᵀ."""
    batch = grad_output.shape[0]
    return channels_gram(grad_output, alpha=float(batch), bias=False, compute_dtype=compute_dtype)
