"""Pure cost models: α-β communication time and inverse compute time, in seconds."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_COST_MODEL",
    "AlphaBetaModel",
    "CostModel",
    "PolynomialInverseModel",
]


def _check_non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


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
        _check_non_negative("alpha", self.alpha)
        _check_non_negative("beta", self.beta)

    def predict(self, nbytes: float) -> float:
        """Predicted seconds to move ``nbytes`` bytes."""
        return self.alpha + self.beta * nbytes


@dataclass(frozen=True)
class PolynomialInverseModel:
    """``t(d) = c0 + c2·d² + c3·d³``: the time to invert a damped d×d factor.

    The cubic term is the decomposition's flops; the quadratic one captures memory traffic
    and the constant the per-call overhead that dominates tiny factors.
    """

    c0: float
    c2: float
    c3: float

    def __post_init__(self) -> None:
        for name in ("c0", "c2", "c3"):
            _check_non_negative(name, getattr(self, name))

    def predict(self, dim: int) -> float:
        """Predicted seconds to invert a ``dim`` x ``dim`` factor."""
        return self.c0 + self.c2 * dim**2 + self.c3 * dim**3


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

    def inverse_seconds(self, dim: int) -> float:
        """Predicted time to invert one ``dim`` x ``dim`` factor."""
        return self.inverse.predict(dim)

    def broadcast_seconds(self, dim: int) -> float:
        """Predicted time to broadcast one inverse as a packed upper triangle."""
        packed = dim * (dim + 1) // 2
        return self.broadcast.predict(packed * self.bytes_per_element)

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


# Measured on this project's 2-core x86_64 machine, one thread per rank, gloo on loopback
# (CLUSTER.md: ~0.3 ms start-up, ~1.5 GB/s) and Cholesky inverses with torch 2.13 (0.41 ms
# at d=128, 5.3 ms at d=577, 50 ms at d=1024). The calibration command replaces these.
DEFAULT_COST_MODEL = CostModel(
    inverse=PolynomialInverseModel(c0=6e-5, c2=1e-8, c3=3.5e-11),
    broadcast=AlphaBetaModel(alpha=3e-4, beta=7e-10),
    allreduce=AlphaBetaModel(alpha=3.5e-4, beta=7e-10),
)
