"""What a calibration records and prints: run metadata, fit errors, the markdown report."""

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

__all__ = ["describe_device", "fit_errors", "format_report", "run_metadata"]


def describe_device(device: torch.device, *, cpuinfo: str = "/proc/cpuinfo") -> str:
    """A CUDA device's name, else the CPU's from ``/proc/cpuinfo`` with its family, model
    and stepping (virtual machines often show one generic name for different CPUs) and the
    logical CPUs (or ``platform``'s name)."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo, encoding="utf-8") as lines:
            for line in lines:
                key, _, value = line.partition(":")
                if not key.strip():  # the first processor's block ends
                    break
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    where = ", ".join(
        f"{k} {fields[k]}" for k in ("cpu family", "model", "stepping") if k in fields
    )
    return f"{name} ({where + '; ' if where else ''}{os.cpu_count()} logical CPUs)"


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
