"""JSON encoding and validation of the records inside a calibration file."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from spdkfac.costmodel.factor import FactorSample, FactorTimeModel, FlopRateModel

__all__ = [
    "CalibrationSamples",
    "Reader",
    "factor_from_json",
    "factor_to_json",
    "samples_from_json",
    "samples_to_json",
]

_Built = TypeVar("_Built")


@dataclass(frozen=True, kw_only=True)
class CalibrationSamples:
    """The raw measurements a calibration was fitted from (for plots and error reports).

    Attributes:
        world_size: Ranks the collectives were measured with.
        inverse: ``(dim, seconds)`` pairs.
        broadcast: ``(bytes, seconds)`` pairs (empty at world size 1).
        allreduce: ``(bytes, seconds)`` pairs (empty at world size 1).
        factor: Per-layer factor timings (empty when no model was measured).
    """

    world_size: int
    inverse: tuple[tuple[int, float], ...] = ()
    broadcast: tuple[tuple[int, float], ...] = ()
    allreduce: tuple[tuple[int, float], ...] = ()
    factor: tuple[FactorSample, ...] = ()

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        for name in ("inverse", "broadcast", "allreduce"):
            pairs = tuple((int(x), float(t)) for x, t in getattr(self, name))
            object.__setattr__(self, name, pairs)
        object.__setattr__(self, "factor", tuple(self.factor))


class Reader:
    """Validates parsed JSON, raising ``ValueError("<source>: <field>: <reason>")``.

    Args:
        source: The file (or other origin) named in every error.
    """

    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, where: str, reason: str) -> ValueError:
        """The error to raise for field ``where``."""
        return ValueError(f"{self.source}: {where}: {reason}")

    def mapping(self, value: Any, where: str) -> dict[str, Any]:
        """``value`` as a JSON object."""
        if not isinstance(value, dict):
            raise self.error(where, f"expected an object, got {type(value).__name__}")
        return value

    def sequence(self, value: Any, where: str) -> list[Any]:
        """``value`` as a JSON array."""
        if not isinstance(value, list):
            raise self.error(where, f"expected an array, got {type(value).__name__}")
        return value

    def number(self, value: Any, where: str) -> float:
        """``value`` as a finite number (booleans are not numbers here)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(where, f"expected a number, got {value!r}")
        if not math.isfinite(value):
            raise self.error(where, f"must be finite, got {value!r}")
        return float(value)

    def integer(self, value: Any, where: str) -> int:
        """``value`` as an integer."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(where, f"expected an integer, got {value!r}")
        return value

    def text(self, value: Any, where: str) -> str:
        """``value`` as a string."""
        if not isinstance(value, str):
            raise self.error(where, f"expected a string, got {value!r}")
        return value

    def build(self, factory: Callable[..., _Built], value: Any, where: str) -> _Built:
        """``factory(**fields)`` with every field a number; its ValueError names ``where``."""
        fields = {
            key: self.number(item, f"{where}.{key}")
            for key, item in self.mapping(value, where).items()
        }
        try:
            return factory(**fields)
        except (TypeError, ValueError) as error:
            raise self.error(where, str(error)) from None

    def pairs(self, value: Any, where: str) -> tuple[tuple[int, float], ...]:
        """An array of ``[int, number]`` pairs."""
        out = []
        for index, item in enumerate(self.sequence(value, where)):
            pair = self.sequence(item, f"{where}[{index}]")
            if len(pair) != 2:
                raise self.error(f"{where}[{index}]", "expected a pair [x, seconds]")
            out.append(
                (
                    self.integer(pair[0], f"{where}[{index}][0]"),
                    self.number(pair[1], f"{where}[{index}][1]"),
                )
            )
        return tuple(out)


def _rate_to_json(model: FlopRateModel) -> dict[str, float]:
    return {"flops_per_second": model.flops_per_second, "overhead_seconds": model.overhead_seconds}


def factor_to_json(model: FactorTimeModel) -> dict[str, Any]:
    """The ``factor`` object of a calibration file."""
    return {
        "A": _rate_to_json(model.a_rate),
        "G": _rate_to_json(model.g_rate),
        "layers": {name: {"A": a, "G": g} for name, (a, g) in model.layers.items()},
    }


def factor_from_json(reader: Reader, value: Any) -> FactorTimeModel | None:
    """Parse the ``factor`` object (``null`` → None)."""
    if value is None:
        return None
    body = reader.mapping(value, "factor")
    layers = {}
    for name, entry in reader.mapping(body.get("layers", {}), "factor.layers").items():
        times = reader.mapping(entry, f"factor.layers.{name}")
        layers[name] = (
            reader.number(times.get("A"), f"factor.layers.{name}.A"),
            reader.number(times.get("G"), f"factor.layers.{name}.G"),
        )
    try:
        return FactorTimeModel(
            a_rate=reader.build(FlopRateModel, body.get("A"), "factor.A"),
            g_rate=reader.build(FlopRateModel, body.get("G"), "factor.G"),
            layers=layers,
        )
    except ValueError as error:
        if str(error).startswith(reader.source):
            raise
        raise reader.error("factor", str(error)) from None


def samples_to_json(samples: CalibrationSamples) -> dict[str, Any]:
    """The ``samples`` object of a calibration file."""
    return {
        "world_size": samples.world_size,
        "inverse": [list(pair) for pair in samples.inverse],
        "broadcast": [list(pair) for pair in samples.broadcast],
        "allreduce": [list(pair) for pair in samples.allreduce],
        "factor": [
            {"layer": s.layer, "kind": s.kind, "flops": s.flops, "seconds": s.seconds}
            for s in samples.factor
        ],
    }


def samples_from_json(reader: Reader, value: Any) -> CalibrationSamples | None:
    """Parse the ``samples`` object (``null`` or absent → None)."""
    if value is None:
        return None
    body = reader.mapping(value, "samples")
    factor = []
    for index, item in enumerate(reader.sequence(body.get("factor", []), "samples.factor")):
        where = f"samples.factor[{index}]"
        entry = reader.mapping(item, where)
        try:
            factor.append(
                FactorSample(
                    layer=reader.text(entry.get("layer"), f"{where}.layer"),
                    kind=reader.text(entry.get("kind"), f"{where}.kind"),  # type: ignore[arg-type]
                    flops=reader.number(entry.get("flops"), f"{where}.flops"),
                    seconds=reader.number(entry.get("seconds"), f"{where}.seconds"),
                )
            )
        except ValueError as error:
            if str(error).startswith(reader.source):
                raise
            raise reader.error(where, str(error)) from None
    try:
        return CalibrationSamples(
            world_size=reader.integer(body.get("world_size"), "samples.world_size"),
            inverse=reader.pairs(body.get("inverse", []), "samples.inverse"),
            broadcast=reader.pairs(body.get("broadcast", []), "samples.broadcast"),
            allreduce=reader.pairs(body.get("allreduce", []), "samples.allreduce"),
            factor=tuple(factor),
        )
    except ValueError as error:
        if str(error).startswith(reader.source):
            raise
        raise reader.error("samples", str(error)) from None
