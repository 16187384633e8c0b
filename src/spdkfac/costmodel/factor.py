"""Factor-computation time per layer: measured seconds, with a FLOP-rate fallback."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from spdkfac.costmodel.fitting import check_samples, nonnegative_relative_fit
from spdkfac.support.checks import check_choice, check_number
from spdkfac.types import FactorKind

__all__ = ["FactorKind", "FactorSample", "FactorTimeModel", "FlopRateModel", "factor_flops"]

_KINDS: tuple[FactorKind, ...] = ("A", "G")


def factor_flops(rows: int, dim: int) -> float:
    """Floating-point operations of one factor ``XᵀX`` with ``X`` of shape ``[rows, dim]``.

    Counts the full product (2·rows·dim²), as ``benchmarks/perf/bench_phases.py`` does, even when
    an implementation exploits symmetry: the rate is then simply higher.
    """
    return 2.0 * rows * dim * dim


@dataclass(frozen=True)
class FactorSample:
    """One measured factor computation.

    Attributes:
        layer: Module name (``named_modules`` key).
        kind: ``"A"`` or ``"G"``.
        flops: :func:`factor_flops` of the product.
        seconds: Median measured time.
    """

    layer: str
    kind: FactorKind
    flops: float
    seconds: float

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, _KINDS)
        check_number(f"flops of {self.layer}/{self.kind}", self.flops, low_inclusive=True)
        check_number(f"seconds of {self.layer}/{self.kind}", self.seconds)


@dataclass(frozen=True)
class FlopRateModel:
    """``t(flops) = overhead + flops / rate``: one kind of factor product.

    Attributes:
        flops_per_second: Effective rate (> 0). With methods that skip part of the
            product (symmetry, convolution structure) it can exceed the machine's peak.
        overhead_seconds: Fixed cost per call (>= 0).
    """

    flops_per_second: float
    overhead_seconds: float = 0.0

    def __post_init__(self) -> None:
        check_number("flops_per_second", self.flops_per_second)
        check_number("overhead_seconds", self.overhead_seconds, low_inclusive=True)

    def predict(self, flops: float) -> float:
        """Predicted seconds of a product of ``flops`` operations."""
        return self.overhead_seconds + flops / self.flops_per_second

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float]]) -> FlopRateModel:
        """Fit to ``(flops, seconds)`` pairs: non-negative least squares on relative error.

        Raises:
            ValueError: No samples, a bad sample, or none with flops > 0.
        """
        flops, times = check_samples(samples, "FlopRateModel.fit")
        overhead, seconds_per_flop = nonnegative_relative_fit([[1.0] * len(flops), flops], times)
        if seconds_per_flop <= 0:
            # Time did not grow with flops, so the rate is unobservable: take the slowest
            # seconds-per-flop seen, which keeps predictions for larger layers pessimistic.
            per_flop = [t / f for f, t in zip(flops, times, strict=True) if f > 0]
            if not per_flop:
                raise ValueError("FlopRateModel.fit: need a sample with flops > 0")
            seconds_per_flop = max(per_flop)
        return cls(flops_per_second=1.0 / seconds_per_flop, overhead_seconds=overhead)


@dataclass(frozen=True)
class FactorTimeModel:
    """Seconds to compute one layer's A or G factor.

    Layers that were measured use their measured time; any other layer is predicted from
    its flops by the rate line of its factor kind. A and G get separate lines because they
    are different computations: A of a Conv2d expands (or correlates) input patches over a
    large dimension, G is a Gram product of output gradients with a small one (on the
    project's CPU the fitted A rate was ~5x the G rate; one shared line had 42 % median
    error against 11-21 % for the two).

    Attributes:
        a_rate: Rate line of A factors.
        g_rate: Rate line of G factors.
        layers: Module name → (A seconds, G seconds), as measured.
    """

    a_rate: FlopRateModel
    g_rate: FlopRateModel
    layers: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        frozen: dict[str, tuple[float, float]] = {}
        for name, pair in self.layers.items():
            a_seconds, g_seconds = (
                check_number(f"layers[{name!r}] {kind} seconds", value, low_inclusive=True)
                for kind, value in zip(_KINDS, pair, strict=True)
            )
            frozen[str(name)] = (a_seconds, g_seconds)
        # Read-only view: the dataclass is frozen, its mapping should be too.
        object.__setattr__(self, "layers", MappingProxyType(frozen))

    def rate(self, kind: FactorKind) -> FlopRateModel:
        """The rate line of ``kind`` factors."""
        check_choice("kind", kind, _KINDS)
        return self.a_rate if kind == "A" else self.g_rate

    def seconds(self, layer: str, kind: FactorKind, flops: float) -> float:
        """Measured seconds of ``layer``'s ``kind`` factor, else the FLOP-rate prediction."""
        measured = self.layers.get(layer)
        if measured is None:
            return self.rate(kind).predict(flops)
        return measured[0] if kind == "A" else measured[1]

    @classmethod
    def fit(cls, samples: Sequence[FactorSample]) -> FactorTimeModel:
        """Keep every sample's seconds per layer and fit one rate line per factor kind.

        Raises:
            ValueError: A kind without samples, or a layer with only one of its two
                factors (calibration always measures both).
        """
        by_layer: dict[str, dict[str, float]] = {}
        for sample in samples:
            by_layer.setdefault(sample.layer, {})[sample.kind] = sample.seconds
        incomplete = sorted(name for name, kinds in by_layer.items() if len(kinds) != 2)
        if incomplete or not by_layer:
            raise ValueError(
                f"FactorTimeModel.fit: need layers with both A and G (incomplete: {incomplete})"
            )
        a_rate, g_rate = (
            FlopRateModel.fit([(s.flops, s.seconds) for s in samples if s.kind == kind])
            for kind in ("A", "G")
        )
        return cls(
            a_rate=a_rate,
            g_rate=g_rate,
            layers={name: (kinds["A"], kinds["G"]) for name, kinds in by_layer.items()},
        )
