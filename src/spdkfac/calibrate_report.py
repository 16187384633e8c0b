"""What a calibration prints and draws: fit-error tables, run metadata, the fit plot."""

from __future__ import annotations

import math
import os
import platform
import socket
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

import torch

from spdkfac.comm import Communicator, LocalCommunicator
from spdkfac.costmodel import (
    CalibrationFile,
    CalibrationSamples,
    ExponentialInverseModel,
    Predictor,
    median_relative_error,
)

__all__ = ["describe_device", "fit_errors", "format_report", "plot_calibration", "run_metadata"]


def describe_device(device: torch.device) -> str:
    """A CUDA device's name, else the CPU model from ``/proc/cpuinfo`` (or ``platform``)."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} logical CPUs)"
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _backend(comm: Communicator) -> str:
    # Only comm/ may ask torch.distributed; the device implies the backend we launch.
    if isinstance(comm, LocalCommunicator):
        return "local"
    return "nccl" if comm.device.type == "cuda" else "gloo"


def run_metadata(
    comm: Communicator, *, method: str, repeats: int, max_seconds: float
) -> dict[str, Any]:
    """Facts a calibration depends on, for the file's ``metadata``."""
    from spdkfac import __version__

    return {
        "backend": _backend(comm),
        "world_size": comm.world_size,
        "world_sizes": [comm.world_size],
        "device": describe_device(comm.device),
        "torch": torch.__version__,
        "spdkfac": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "threads": torch.get_num_threads(),
        "inverse_method": method,
        "repeats": repeats,
        "max_seconds": max_seconds,
        "command": " ".join(["spdkfac", *sys.argv[1:]]),
    }


def _error_or_nan(model: Predictor, samples: Sequence[tuple[float, float]]) -> float:
    return median_relative_error(model, samples) if samples else math.nan


def fit_errors(calibration: CalibrationFile) -> dict[str, float]:
    """Median relative error of each fitted model on its own measurements.

    Keys: ``inverse`` (the polynomial used for planning), ``inverse_exponential_paper``
    and ``inverse_exponential_log`` (the paper's Eq. 26 fitted with √t weights, and
    unweighted, for comparison), ``broadcast``, ``allreduce``, ``factor_A`` and
    ``factor_G`` (the FLOP-rate lines). Models without samples are left out.
    """
    samples = calibration.samples
    if samples is None:
        return {}
    errors: dict[str, float] = {}
    inverse = [(float(d), t) for d, t in samples.inverse]
    if inverse:
        errors["inverse"] = median_relative_error(calibration.inverse, inverse)
        if len({d for d, _ in inverse}) >= 2:
            for key, weights in (("paper", True), ("log", False)):
                exponential = ExponentialInverseModel.fit(inverse, paper_weights=weights)
                errors[f"inverse_exponential_{key}"] = median_relative_error(exponential, inverse)
    if samples.world_size in calibration.communication and samples.allreduce:
        broadcast, allreduce = calibration.communication[samples.world_size]
        errors["broadcast"] = _error_or_nan(
            broadcast, [(float(b), t) for b, t in samples.broadcast]
        )
        errors["allreduce"] = _error_or_nan(
            allreduce, [(float(b), t) for b, t in samples.allreduce]
        )
    if calibration.factor is not None:
        for kind in ("A", "G"):
            pairs = [(s.flops, s.seconds) for s in samples.factor if s.kind == kind]
            if pairs:
                rate = calibration.factor.rate(kind)
                errors[f"factor_{kind}"] = median_relative_error(rate, pairs)
    return errors


def _percent(value: float | None) -> str:
    return "—" if value is None or math.isnan(value) else f"{100 * value:.1f} %"


def _points(title: str, unit: str, model: Predictor, pairs: Sequence[tuple[int, float]]) -> str:
    lines = [f"\n\n{title}\n", f"| {unit} | measured ms | fitted ms | error |", "|---|---|---|---|"]
    for x, seconds in pairs:
        predicted = model.predict(x)
        error = (predicted - seconds) / seconds
        lines.append(
            f"| {x} | {1000 * seconds:.4g} | {1000 * predicted:.4g} | {100 * error:+.1f} % |"
        )
    return "\n".join(lines)


def format_report(calibration: CalibrationFile) -> str:
    """Markdown: fitted parameters with median relative errors, then measured points."""
    errors = dict(calibration.metadata.get("fit_errors") or fit_errors(calibration))
    samples = calibration.samples or CalibrationSamples(world_size=1)
    inverse = calibration.inverse
    rows = [
        "| model | fitted parameters | median rel. error | samples |",
        "|---|---|---|---|",
        f"| inverse t = c0 + c2·d² + c3·d³ | c0={inverse.c0:.3e} s, c2={inverse.c2:.3e}, "
        f"c3={inverse.c3:.3e} | {_percent(errors.get('inverse'))} | {len(samples.inverse)} |",
        f"| inverse, paper Eq. 26 α·e^(β·d), √t-weighted log fit | (comparison only) | "
        f"{_percent(errors.get('inverse_exponential_paper'))} | {len(samples.inverse)} |",
        f"| inverse, α·e^(β·d), unweighted log fit | (comparison only) | "
        f"{_percent(errors.get('inverse_exponential_log'))} | {len(samples.inverse)} |",
    ]
    for size, (broadcast, allreduce) in calibration.communication.items():
        for name, model, count in (
            ("broadcast", broadcast, len(samples.broadcast)),
            ("allreduce", allreduce, len(samples.allreduce)),
        ):
            measured = size == samples.world_size and count > 0
            bandwidth = f"{1e-9 / model.beta:.3g} GB/s" if model.beta > 0 else "∞"
            rows.append(
                f"| {name} t = α + β·bytes, P={size} | α={1e6 * model.alpha:.1f} µs, "
                f"β={model.beta:.3e} s/B ({bandwidth}) | "
                f"{_percent(errors.get(name)) if measured else 'not measured'} | "
                f"{count if measured else 0} |"
            )
    if calibration.factor is not None:
        for kind in ("A", "G"):
            rate = calibration.factor.rate(kind)
            count = sum(s.kind == kind for s in samples.factor)
            rows.append(
                f"| factor {kind} t = overhead + flops/rate | "
                f"rate={rate.flops_per_second / 1e9:.1f} GFLOP/s, "
                f"overhead={1e6 * rate.overhead_seconds:.1f} µs "
                f"({len(calibration.factor.layers)} layers measured) | "
                f"{_percent(errors.get(f'factor_{kind}'))} | {count} |"
            )
    text = "\n".join(rows)
    if samples.inverse:
        text += _points("Inverse times", "dim", calibration.inverse, samples.inverse)
    if samples.world_size in calibration.communication:
        broadcast, allreduce = calibration.communication[samples.world_size]
        if samples.allreduce:
            text += _points("All-reduce times", "bytes", allreduce, samples.allreduce)
        if samples.broadcast:
            text += _points("Broadcast times", "bytes", broadcast, samples.broadcast)
    return text


def _curve(low: float, high: float, count: int = 200) -> list[float]:
    ratio = (high / low) ** (1 / (count - 1)) if high > low else 1.0
    return [low * ratio**i for i in range(count)]


def plot_calibration(
    calibration: CalibrationFile,
    samples: CalibrationSamples | None,
    png_path: str | os.PathLike[str],
) -> bool:
    """Draw measured points against fitted curves (log-log), like the paper's Figs. 7-8.

    Panels: inverse time vs dimension (with the paper's exponential for comparison),
    collective time vs bytes (when measured), factor time vs flops (when measured).
    Needs matplotlib (the ``dev`` extra); without it, prints one line and returns False.

    Args:
        calibration: The fitted models.
        samples: The measurements (None: ``calibration.samples``).
        png_path: Where to write the PNG.

    Returns:
        Whether the PNG was written.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f"matplotlib is not installed; not drawing {png_path} (pip install matplotlib)")
        return False
    data = samples or calibration.samples
    if data is None or not data.inverse:
        print(f"no measurements to draw; not writing {png_path}")
        return False
    panels = 1 + bool(data.allreduce) + bool(data.factor and calibration.factor)
    figure = Figure(figsize=(5.2 * panels, 4.2), layout="constrained")
    axes = figure.subplots(1, panels, squeeze=False)[0]
    dims = [float(d) for d, _ in data.inverse]
    grid = _curve(min(dims), max(dims))
    ax = axes[0]
    ax.loglog(dims, [t for _, t in data.inverse], "o", label="measured")
    ax.loglog(grid, [calibration.inverse.predict(d) for d in grid], "-", label="c0+c2·d²+c3·d³")
    if len(set(dims)) >= 2:
        paper = ExponentialInverseModel.fit([(float(d), t) for d, t in data.inverse])
        ax.loglog(grid, [paper.predict(d) for d in grid], ":", label="α·e^(β·d) (paper)")
    ax.set(xlabel="factor dimension d", ylabel="seconds", title="inverse")
    ax.set_ylim(min(t for _, t in data.inverse) / 3, max(t for _, t in data.inverse) * 3)
    ax.legend()
    column = 1
    if data.allreduce and data.world_size in calibration.communication:
        broadcast, allreduce = calibration.communication[data.world_size]
        ax = axes[column]
        column += 1
        for name, model, pairs, marker in (
            ("all-reduce", allreduce, data.allreduce, "o"),
            ("broadcast", broadcast, data.broadcast, "s"),
        ):
            sizes = [float(b) for b, _ in pairs]
            line = _curve(min(sizes), max(sizes))
            (points,) = ax.loglog(sizes, [t for _, t in pairs], marker, label=f"{name} measured")
            ax.loglog(line, [model.predict(b) for b in line], "-", color=points.get_color())
        ax.set(xlabel="message bytes", ylabel="seconds", title=f"collectives, P={data.world_size}")
        ax.legend()
    if data.factor and calibration.factor is not None:
        ax = axes[column]
        for kind, marker in (("A", "o"), ("G", "s")):
            chosen = [s for s in data.factor if s.kind == kind]
            if not chosen:
                continue
            flops = [s.flops for s in chosen]
            (points,) = ax.loglog(flops, [s.seconds for s in chosen], marker, label=kind)
            line = _curve(max(min(flops), 1.0), max(flops))
            rate = calibration.factor.rate(kind)  # type: ignore[arg-type]
            ax.loglog(line, [rate.predict(f) for f in line], "-", color=points.get_color())
        ax.set(xlabel="flops (2·rows·d²)", ylabel="seconds", title="factor products")
        ax.legend()
    figure.suptitle(
        f"{calibration.metadata.get('device', '')}, torch {calibration.metadata.get('torch', '')}"
        f", {calibration.metadata.get('threads', '?')} thread(s)",
        fontsize=9,
    )
    figure.savefig(os.fspath(png_path), dpi=110)
    return True
