"""Fitting a :class:`~spdkfac.sim.hardware.DeviceModel` to ops timed on a real device."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from spdkfac.costmodel import nonnegative_relative_fit
from spdkfac.sim.hardware import DeviceModel
from spdkfac.sim.workload import Op

__all__ = ["HALF_SIDES", "fit_device_model", "relative_errors"]

#: Candidate ``gemm_half_side`` values tried by :func:`fit_device_model`.
HALF_SIDES: tuple[float, ...] = (0.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 48.0, 64.0, 128.0)
_MIN_SAMPLES = 3


def relative_errors(model: DeviceModel, ops: Sequence[Op]) -> list[float]:
    """``|predicted / measured − 1|`` per timed op (measurements stripped before predicting)."""
    errors = []
    for op in ops:
        if op.seconds:
            bare = Op(op.name, op.flops, op.bytes, op.gemm_side)
            errors.append(abs(model.op_seconds(bare) / op.seconds - 1.0))
    return errors


def _op_scales(model: DeviceModel, ops: Sequence[Op]) -> dict[str, float]:
    """Median measured/roofline ratio (beyond the overhead) of each op kind seen 3+ times."""
    ratios: dict[str, list[float]] = {}
    for op in ops:
        bare = Op(op.name, op.flops, op.bytes, op.gemm_side)
        roofline = model.op_seconds(bare) - model.op_overhead_seconds
        # Ops whose roofline is below the per-op overhead say nothing about their kind.
        if op.seconds and roofline > model.op_overhead_seconds:
            spent = max(op.seconds - model.op_overhead_seconds, 0.05 * op.seconds)
            ratios.setdefault(op.name, []).append(spent / roofline)
    return {
        name: statistics.median(values)
        for name, values in ratios.items()
        if len(values) >= _MIN_SAMPLES
    }


def fit_device_model(
    ops: Sequence[Op], *, half_sides: Sequence[float] = HALF_SIDES, scale_ops: bool = True
) -> tuple[DeviceModel, dict[str, float]]:
    """Fit the roofline to timed ops (``Op.seconds`` set, e.g. by a timed trace).

    Memory-bound ops (no FLOPs) give the per-op overhead and the bandwidth (relative least
    squares on ``overhead + bytes/bandwidth``); ops with FLOPs then give the peak GEMM rate
    for each candidate half side (:data:`HALF_SIDES`), and the half side with the lowest
    median relative error wins. With ``scale_ops``, every op kind seen at least three times
    then gets its median measured/roofline ratio as ``op_scale``.

    Returns:
        The model and the median relative errors of ``"gemm"`` and ``"memory"`` ops.

    Raises:
        ValueError: Without timed ops of both kinds.
    """
    gemm = [op for op in ops if op.seconds and op.flops > 0]
    memory = [op for op in ops if op.seconds and op.flops == 0 and op.bytes > 0]
    if not gemm or not memory:
        raise ValueError("need timed ops with FLOPs and timed memory-bound ops")
    overhead, per_byte = nonnegative_relative_fit(
        [[1.0] * len(memory), [op.bytes for op in memory]], [op.seconds or 0.0 for op in memory]
    )
    bandwidth = 1.0 / per_byte if per_byte > 0 else 1e15
    best: tuple[float, DeviceModel] | None = None
    for half in half_sides:
        # t ≈ overhead + c·flops·(s + h)/s with the overhead fixed: minimise the squared
        # relative error Σ((overhead + c·wᵢ − tᵢ)/tᵢ)², whose minimiser is closed-form.
        work = [
            op.flops * ((op.gemm_side + half) / op.gemm_side if op.gemm_side else 1.0)
            for op in gemm
        ]
        times = [op.seconds or 0.0 for op in gemm]
        numerator = sum(w / t * (t - overhead) / t for w, t in zip(work, times, strict=True))
        denominator = sum((w / t) ** 2 for w, t in zip(work, times, strict=True))
        per_flop = numerator / denominator if denominator > 0 else 0.0
        if per_flop <= 0:
            continue
        model = DeviceModel(
            gemm_flops_per_second=1.0 / per_flop,
            gemm_half_side=half,
            memory_bytes_per_second=bandwidth,
            op_overhead_seconds=overhead,
        )
        error = statistics.median(relative_errors(model, gemm))
        if best is None or error < best[0]:
            best = (error, model)
    if best is None:
        raise ValueError("GEMM times do not grow with FLOPs; cannot fit a rate")
    model = best[1]
    if scale_ops:
        model = replace(model, op_scale=_op_scales(model, [*gemm, *memory]))
    return model, {
        "gemm": statistics.median(relative_errors(model, gemm)),
        "memory": statistics.median(relative_errors(model, memory)),
    }
