"""Pure cost models: α-β communication time and inverse compute time, in seconds."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from spdkfac.costmodel.fitting import check_samples, nonnegative_relative_fit
from spdkfac.support.checks import check_number

__all__ = [
    "DEFAULT_COST_MODEL",
    "AlphaBetaModel",
    "CostModel",
    "ExponentialInverseModel",
    "PolynomialInverseModel",
]


@dataclass(frozen=True)
class AlphaBetaModel:
    """``t(bytes) = α + β·bytes``: start-up latency plus inverse bandwidth.

    Attributes:
        alpha: Seconds per message.
        beta: Seconds per byte.
    """

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        check_number("alpha", self.alpha, low_inclusive=True)
        check_number("beta", self.beta, low_inclusive=True)

    def predict(self, nbytes: float) -> float:
        """Predicted seconds to move ``nbytes`` bytes."""
        return self.alpha + self.beta * nbytes

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float]]) -> AlphaBetaModel:
        """Fit α, β ≥ 0 to measured ``(bytes, seconds)`` pairs.

        Minimises the sum of squared *relative* errors (weighted least squares with
        weights 1/t), so small messages, where α dominates, count as much as large ones;
        a plain least-squares fit would let the 64 MB points decide α. When the
        unconstrained optimum has a negative coefficient, the best fit with that
        coefficient fixed at 0 is returned.

        Raises:
            ValueError: No samples, or a sample with negative bytes or a time <= 0.
        """
        sizes, times = check_samples(samples, "AlphaBetaModel.fit")
        alpha, beta = nonnegative_relative_fit([[1.0] * len(sizes), sizes], times)
        return cls(alpha=alpha, beta=beta)


@dataclass(frozen=True)
class PolynomialInverseModel:
    """``t(d) = c0 + c2·d² + c3·d³``: the time to invert a damped d×d factor.

    The cubic term is the decomposition's flops; the quadratic one captures memory traffic
    and the constant the per-call overhead that dominates tiny factors.

    Why this form and not the paper's ``t = α·e^{β·d}`` (Eq. 26): a Cholesky inverse costs
    Θ(d³) flops, so over the range K-FAC needs (d = 64…4096: 64× in d, 2.6·10⁵× in d³) the
    time grows like a polynomial plus a per-call floor, and an exponential can only follow
    it over a narrow band. Measured on this project's 2-core Xeon (torch 2.13, 1 thread,
    Cholesky; ``benchmarks/reports/calibration_cpu.md``), median relative error over the
    13 default calibration dims (64…4096): this model 6-10 %; the exponential fitted the
    paper's way (``np.polyfit(d, log t, 1, w=√t)``) 700-850 %, fitted on log time without
    weights 76-79 %. On 12 held-out K-FAC-like dims (48…3500): 23 % against 60 % and
    800 %. What remains is not noise but cache effects no smooth curve follows: exact
    powers of two are up to 2x slower than their neighbours (d = 1024: 45-50 ms,
    d = 1025: 24 ms).
    """

    c0: float
    c2: float
    c3: float

    def __post_init__(self) -> None:
        for name in ("c0", "c2", "c3"):
            check_number(name, getattr(self, name), low_inclusive=True)

    def predict(self, dim: float) -> float:
        """Predicted seconds to invert a ``dim`` x ``dim`` factor."""
        return self.c0 + self.c2 * dim**2 + self.c3 * dim**3

    @classmethod
    def fit(cls, samples: Sequence[tuple[float, float]]) -> PolynomialInverseModel:
        """Fit c0, c2, c3 ≥ 0 to measured ``(dim, seconds)`` pairs.

        Non-negative least squares on relative error over the basis {1, d², d³}: every one
        of the 7 non-empty subsets is fitted and the best non-negative fit kept (ties go
        to fewer terms). Relative error keeps the 50 µs inverses of small factors as
        important as the seconds-long ones of large factors.

        Raises:
            ValueError: No samples, or a sample with a negative dimension or a time <= 0.
        """
        dims, times = check_samples(samples, "PolynomialInverseModel.fit")
        c0, c2, c3 = nonnegative_relative_fit(
            [[1.0] * len(dims), [d**2 for d in dims], [d**3 for d in dims]], times
        )
        return cls(c0=c0, c2=c2, c3=c3)


@dataclass(frozen=True)
class ExponentialInverseModel:
    """``t(d) = α·e^{β·d}``: the SPD-KFAC paper's inverse model (Eq. 26), for comparison.

    Kept so calibration can report how it fares against :class:`PolynomialInverseModel`,
    which is what :class:`CostModel` uses.

    Attributes:
        alpha: Seconds at d = 0.
        beta: Growth rate per unit of dimension.
    """

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        check_number("alpha", self.alpha, low_inclusive=True)
        if not math.isfinite(self.beta):
            raise ValueError(f"beta must be finite, got {self.beta!r}")

    def predict(self, dim: float) -> float:
        """Predicted seconds to invert a ``dim`` x ``dim`` factor (inf on overflow)."""
        try:
            return self.alpha * math.exp(self.beta * dim)
        except OverflowError:
            return math.inf

    @classmethod
    def fit(
        cls, samples: Sequence[tuple[float, float]], *, paper_weights: bool = True
    ) -> ExponentialInverseModel:
        """Fit by least squares on ``log t``.

        Args:
            samples: ``(dim, seconds)`` pairs, at least two distinct dimensions.
            paper_weights: Weight residuals by √t as the authors' ``compute_models.py``
                does (``np.polyfit(d, log t, 1, w=√t)``); False weighs all points equally,
                which minimises relative error to first order.
        """
        dims, times = check_samples(samples, "ExponentialInverseModel.fit", min_count=2)
        if len(set(dims)) < 2:
            raise ValueError("ExponentialInverseModel.fit: need two distinct dimensions")
        weights = np.sqrt(times) if paper_weights else None
        slope, intercept = np.polyfit(dims, np.log(times), 1, w=weights)
        return cls(alpha=float(math.exp(intercept)), beta=float(slope))


@dataclass(frozen=True)
class CostModel:
    """The costs placement and fusion decisions are made from.

    Attributes:
        inverse: Inversion time vs factor dimension.
        broadcast: Broadcast time vs message bytes.
        allreduce: All-reduce time vs message bytes.
        bytes_per_element: Bytes of one communicated factor element (4 for float32).
    """

    inverse: PolynomialInverseModel
    broadcast: AlphaBetaModel
    allreduce: AlphaBetaModel
    bytes_per_element: int = field(default=4)

    def as_vector(self) -> tuple[float, ...]:
        """All parameters as a flat tuple (see :meth:`from_vector`)."""
        return (
            self.inverse.c0,
            self.inverse.c2,
            self.inverse.c3,
            self.broadcast.alpha,
            self.broadcast.beta,
            self.allreduce.alpha,
            self.allreduce.beta,
            float(self.bytes_per_element),
        )

    @classmethod
    def from_vector(cls, values: tuple[float, ...] | list[float]) -> CostModel:
        """Rebuild a model from :meth:`as_vector`'s output."""
        c0, c2, c3, b_alpha, b_beta, a_alpha, a_beta, bpe = values
        return cls(
            inverse=PolynomialInverseModel(c0=c0, c2=c2, c3=c3),
            broadcast=AlphaBetaModel(alpha=b_alpha, beta=b_beta),
            allreduce=AlphaBetaModel(alpha=a_alpha, beta=a_beta),
            bytes_per_element=round(bpe),
        )

    def inverse_seconds(self, dim: int, scale: float = 1.0) -> float:
        """Predicted time to compute one result of a ``dim`` x ``dim`` factor: the
        inverse-time fit (of damped inverses by Cholesky, as calibrated) times ``scale``,
        the result's compute time relative to it (an inverse form's ``compute_scale``)."""
        return scale * self.inverse.predict(dim)

    def broadcast_seconds(self, dim: int, elements: int | None = None) -> float:
        """Predicted time to broadcast one result of a ``dim`` x ``dim`` factor that
        occupies ``elements`` elements on the wire (an inverse form's ``wire_size``;
        None: a damped inverse's packed upper triangle, ``dim·(dim + 1)/2``)."""
        if elements is None:
            elements = dim * (dim + 1) // 2
        return self.broadcast.predict(elements * self.bytes_per_element)

    def broadcast_group_elements(self, bandwidth_to_startup: float = 4.0) -> int:
        """Smallest message (in elements) whose transfer time is ``bandwidth_to_startup``
        times the broadcast start-up time; smaller messages are worth fusing."""
        beta = self.broadcast.beta * self.bytes_per_element
        if beta <= 0:
            return 2**62
        return max(1, math.ceil(bandwidth_to_startup * self.broadcast.alpha / beta))

    def allreduce_seconds(self, elements: int) -> float:
        """Predicted time to all-reduce ``elements`` factor elements."""
        return self.allreduce.predict(elements * self.bytes_per_element)


# Fitted by ``spdkfac calibrate`` on this project's 2-core x86_64 machine (torch 2.13, one
# thread per rank): the inverse from the single-process run, the collectives from the
# 2-rank run on gloo/loopback (benchmarks/reports/costmodel_cpu*.json). Pass a file of your
# own machine's as ``cost_model=PATH``.
DEFAULT_COST_MODEL = CostModel(
    inverse=PolynomialInverseModel(c0=6.87e-5, c2=6.66e-9, c3=1.574e-11),
    broadcast=AlphaBetaModel(alpha=2.09e-4, beta=3.35e-10),
    allreduce=AlphaBetaModel(alpha=3.25e-4, beta=7.35e-10),
)
