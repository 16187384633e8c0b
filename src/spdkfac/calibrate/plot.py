"""The calibration plot: measured points against the fitted curves, log-log."""

from __future__ import annotations

import os
from typing import Any

from spdkfac.costmodel import (
    CalibrationFile,
    CalibrationSamples,
    ExponentialInverseModel,
    FactorTimeModel,
)
from spdkfac.support.optional import optional_import, skip_notice

__all__ = ["plot_calibration"]


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
    Needs matplotlib (the ``dev`` extra); when it is missing or fails to import, prints one
    line and returns False.

    Args:
        calibration: The fitted models.
        samples: The measurements (None: ``calibration.samples``).
        png_path: Where to write the PNG.

    Returns:
        Whether the PNG was written.
    """
    figure_module = optional_import("matplotlib.figure")
    if figure_module is None:
        print(skip_notice("matplotlib.figure", f"the plot {png_path}"))
        return False
    data = samples or calibration.samples
    if data is None or not data.inverse:
        print(f"no measurements to draw; not writing {png_path}")
        return False
    panels = 1 + bool(data.allreduce) + bool(data.factor and calibration.factor)
    figure = figure_module.Figure(figsize=(5.2 * panels, 4.2), layout="constrained")
    axes = iter(figure.subplots(1, panels, squeeze=False)[0])
    _inverse_panel(next(axes), calibration, data)
    if data.allreduce and data.world_size in calibration.communication:
        _collectives_panel(next(axes), calibration, data)
    if data.factor and calibration.factor is not None:
        _factor_panel(next(axes), calibration.factor, data)
    figure.suptitle(
        f"{calibration.metadata.get('device', '')}, torch {calibration.metadata.get('torch', '')}"
        f", {calibration.metadata.get('threads', '?')} thread(s)",
        fontsize=9,
    )
    figure.savefig(os.fspath(png_path), dpi=110)
    return True


def _inverse_panel(ax: Any, calibration: CalibrationFile, data: CalibrationSamples) -> None:
    """Inverse time against the dimension: the fit, and the paper's exponential."""
    dims = [float(d) for d, _ in data.inverse]
    grid = _curve(min(dims), max(dims))
    ax.loglog(dims, [t for _, t in data.inverse], "o", label="measured")
    ax.loglog(grid, [calibration.inverse.predict(d) for d in grid], "-", label="c0+c2·d²+c3·d³")
    if len(set(dims)) >= 2:
        paper = ExponentialInverseModel.fit([(float(d), t) for d, t in data.inverse])
        ax.loglog(grid, [paper.predict(d) for d in grid], ":", label="α·e^(β·d) (paper)")
    ax.set(xlabel="factor dimension d", ylabel="seconds", title="inverse")
    ax.set_ylim(min(t for _, t in data.inverse) / 3, max(t for _, t in data.inverse) * 3)
    ax.legend()


def _collectives_panel(ax: Any, calibration: CalibrationFile, data: CalibrationSamples) -> None:
    """All-reduce and broadcast time against the message size, with their α-β fits."""
    broadcast, allreduce = calibration.communication[data.world_size]
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


def _factor_panel(ax: Any, model: FactorTimeModel, data: CalibrationSamples) -> None:
    """Factor time against the flops of the product, per kind, with the rate lines."""
    for kind, marker in (("A", "o"), ("G", "s")):
        chosen = [s for s in data.factor if s.kind == kind]
        if not chosen:
            continue
        flops = [s.flops for s in chosen]
        (points,) = ax.loglog(flops, [s.seconds for s in chosen], marker, label=kind)
        line = _curve(max(min(flops), 1.0), max(flops))
        rate = model.rate(kind)  # type: ignore[arg-type]
        ax.loglog(line, [rate.predict(f) for f in line], "-", color=points.get_color())
    ax.set(xlabel="flops (2·rows·d²)", ylabel="seconds", title="factor products")
    ax.legend()
