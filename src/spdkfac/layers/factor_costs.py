"""A cost model of the Conv2d A factor methods, calibrated on one CPU thread."""

from __future__ import annotations

import math
from typing import Literal

import torch

from spdkfac.layers.correlation_plan import correlation_plan
from spdkfac.layers.geometry import Conv2dGeometry
from spdkfac.layers.kernels import panel_height

__all__ = ["ConcreteMethod", "Conv2dGeometry", "estimate_conv2d_a_seconds"]

ConcreteMethod = Literal["reference", "im2col", "correlation"]


# Fitted on one thread of an AVX-512 + AMX-bf16 Xeon (torch 2.13, MKL 2024.2): sustained
# GEMM FLOP/s reach ``peak`` for large sides and halve at side ``half`` (small outputs
# waste most of each register tile). Only the ratios between methods matter.
_GEMM = {
    torch.float32: (155e9, 24.0),
    torch.float64: (75e9, 24.0),
    torch.bfloat16: (1.3e12, 250.0),
    torch.float16: (155e9, 24.0),  # no fp16 matrix units on that CPU
}
_COPY_BYTES_PER_S = 12e9  # strided copies, read + write
_FRESH_BYTES_PER_S = 3e9  # first writes to a new output (page faults) and strided scatters
_CALL_S = 12e-6  # fixed cost of one small library call from Python


def _gemm_seconds(flops: float, side: float, dtype: torch.dtype) -> float:
    peak, half = _GEMM.get(dtype, (10e9, 24.0))
    return flops / (peak * side / (side + half))


def estimate_conv2d_a_seconds(geometry: Conv2dGeometry, method: ConcreteMethod) -> float:
    """Modelled single-thread CPU seconds of one Conv2d A factor by ``method``.

    reference: ``unfold`` and its transposed copy, then the full product.
    im2col: the patch copy, (t+1)/2t of the full product for t panels, writing the output
    twice (triangle, mirror). correlation (stride 1): one thin GEMM per whole-image shift
    (C×C outputs, ``H·B·(W+(kw−1)·dw)`` long), the border strips (copies and products),
    the block assembly (strided scatter of the D×D output), fixed per-call costs.

    Raises:
        ValueError: For correlation on a geometry it does not handle (stride ≠ 1).
    """
    g = geometry
    kh, kw = g.kernel_size
    dim, rows = g.dim, g.rows
    item = torch.empty((), dtype=g.compute_dtype).element_size()
    full_product = 2.0 * dim * dim * rows
    output = 4.0 * dim * dim
    if method == "reference":
        copies = 3.0 * 2 * item * dim * rows / _COPY_BYTES_PER_S
        return (
            copies + _gemm_seconds(full_product, dim, g.compute_dtype) + output / _FRESH_BYTES_PER_S
        )
    if method == "im2col":
        panels = math.ceil(dim / panel_height(dim))
        product = full_product * (panels + 1) / (2 * panels)
        copy = 2.0 * item * dim * rows / _COPY_BYTES_PER_S
        calls = kh * kw + 2 * panels + 4
        return (
            copy
            + _gemm_seconds(product, dim, g.compute_dtype)
            + 2 * output / _FRESH_BYTES_PER_S
            + calls * _CALL_S
        )
    if method != "correlation" or g.stride != (1, 1):
        raise ValueError(f"method {method!r} does not apply to {g}")
    plan = correlation_plan(g, torch.device("cpu"))
    channels, batch = g.channels, g.batch
    seconds, calls = 0.0, 20
    if plan.whole is not None:
        length = g.size[0] * batch * (g.size[1] + (kw - 1) * g.dilation[1])
        flops = 2.0 * channels * channels * length * len(plan.whole.shifts)
        seconds += _gemm_seconds(flops, channels, g.compute_dtype)
        seconds += 2.0 * item * channels * batch * g.size[0] * g.size[1] / _COPY_BYTES_PER_S
        calls += len(plan.whole.shifts)
    for group in plan.groups:
        area = group.shape[0] * group.shape[1] * batch
        flops = 2.0 * channels * channels * area * group.shifts * group.terms
        seconds += _gemm_seconds(flops, channels, g.compute_dtype)
        copied = channels * area * (group.shifts + 1) * group.terms
        seconds += 2.0 * item * copied / _COPY_BYTES_PER_S
        calls += 2 * group.terms + 2
    # The scatter into the output is strided by kh·kw; beyond the caches it slows further.
    scatter = output * (1.0 + dim * dim / 4e6) / _FRESH_BYTES_PER_S
    blocks = 3.0 * 4 * plan.initial.numel() * channels * channels / _COPY_BYTES_PER_S
    return seconds + scatter + blocks + calls * _CALL_S
