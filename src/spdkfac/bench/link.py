"""What was measured on an emulated link, and the label a benchmark report gives it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spdkfac.bench.netns import LinkShape
from spdkfac.costmodel import AlphaBetaModel

__all__ = ["LinkMeasurement", "MeasuredLink", "format_bytes"]

Samples = tuple[tuple[int, float], ...]


def format_bytes(nbytes: int) -> str:
    """``16 MiB``, ``256 KiB``, ``100 B``: whole binary units where they divide."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size} {unit}"
    return f"{nbytes} B"


def _samples(pairs: Sequence[Sequence[float]], name: str) -> Samples:
    samples = tuple(sorted((int(size), float(seconds)) for size, seconds in pairs))
    if not samples:
        raise ValueError(f"{name} must hold at least one (bytes, seconds) sample")
    if any(size <= 0 or not seconds > 0 for size, seconds in samples):
        raise ValueError(f"{name} needs bytes > 0 and seconds > 0, got {samples}")
    return samples


def _fit_json(model: AlphaBetaModel) -> dict[str, float]:
    return {"alpha_seconds": model.alpha, "beta_seconds_per_byte": model.beta}


def _alpha_beta(model: AlphaBetaModel) -> str:
    return f"α {1e3 * model.alpha:.3f} ms, β {1e9 * model.beta:.2f} ns/B"


@dataclass(frozen=True)
class LinkMeasurement:
    """Median seconds of gloo all-reduce and broadcast per message size between the ranks.

    Attributes:
        world_size: Ranks that took part.
        allreduce: ``(bytes, seconds)`` pairs, ascending (the slowest rank's time).
        broadcast: The same for broadcast.
    """

    world_size: int
    allreduce: Samples
    broadcast: Samples

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"world_size must be >= 2 to measure a link, got {self.world_size}")
        object.__setattr__(self, "allreduce", _samples(self.allreduce, "allreduce"))
        object.__setattr__(self, "broadcast", _samples(self.broadcast, "broadcast"))

    @property
    def allreduce_fit(self) -> AlphaBetaModel:
        """α-β fitted to the all-reduce samples (:meth:`AlphaBetaModel.fit`)."""
        return AlphaBetaModel.fit(self.allreduce)

    @property
    def broadcast_fit(self) -> AlphaBetaModel:
        """α-β fitted to the broadcast samples."""
        return AlphaBetaModel.fit(self.broadcast)

    @property
    def large_message_bytes(self) -> int:
        """The largest all-reduce measured, whose rate the label quotes."""
        return self.allreduce[-1][0]

    @property
    def gigabytes_per_second(self) -> float:
        """Bytes of the largest all-reduce over its time, in GB/s (1e9 B/s)."""
        size, seconds = self.allreduce[-1]
        return size / seconds / 1e9

    @property
    def gigabits_per_second(self) -> float:
        """:attr:`gigabytes_per_second` in Gbit/s, comparable with the ``tc`` rate."""
        return 8.0 * self.gigabytes_per_second

    @property
    def bus_gigabytes_per_second(self) -> float:
        """What each link carried: a ring all-reduce sends 2(P-1)/P of the message per rank
        (equal to :attr:`gigabytes_per_second` on two ranks)."""
        return self.gigabytes_per_second * 2 * (self.world_size - 1) / self.world_size

    def summary(self) -> str:
        """``0.118 GB/s (0.94 Gbit/s) for a 16 MiB all-reduce, α 0.620 ms, β 8.41 ns/B``."""
        bus = (
            ""
            if self.world_size == 2
            else f", ring bus bandwidth {self.bus_gigabytes_per_second:.3f} GB/s"
        )
        return (
            f"{self.gigabytes_per_second:.3f} GB/s ({self.gigabits_per_second:.2f} Gbit/s) "
            f"for a {format_bytes(self.large_message_bytes)} all-reduce{bus}, "
            f"{_alpha_beta(self.allreduce_fit)}"
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: the samples, their fits and the large-message rate (derived
        values are for readers; :meth:`from_json` recomputes them)."""
        return {
            "world_size": self.world_size,
            "allreduce": [list(pair) for pair in self.allreduce],
            "broadcast": [list(pair) for pair in self.broadcast],
            "allreduce_fit": _fit_json(self.allreduce_fit),
            "broadcast_fit": _fit_json(self.broadcast_fit),
            "large_message_bytes": self.large_message_bytes,
            "gigabytes_per_second": self.gigabytes_per_second,
            "gigabits_per_second": self.gigabits_per_second,
            "bus_gigabytes_per_second": self.bus_gigabytes_per_second,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LinkMeasurement:
        """Rebuild a measurement from :meth:`to_json`'s output."""
        return cls(
            world_size=int(data["world_size"]),
            allreduce=tuple((int(n), float(t)) for n, t in data["allreduce"]),
            broadcast=tuple((int(n), float(t)) for n, t in data["broadcast"]),
        )


@dataclass(frozen=True)
class MeasuredLink:
    """An emulated link: its ``tc`` setting and what gloo measured on it around the run.

    Attributes:
        shape: The cap each rank's link had.
        before: Measured after the namespaces were set up, before the benchmark.
        after: Measured after the benchmark (None: not measured).
    """

    shape: LinkShape
    before: LinkMeasurement
    after: LinkMeasurement | None = None

    def label(self) -> str:
        """The report's link label: the measured rate, the ``tbf`` rate only as a setting."""
        text = f"emulated (tbf setting {self.shape.rate}): measured {self.before.summary()}"
        if self.after is not None:
            text += f"; {self.after.gigabytes_per_second:.3f} GB/s after the run"
        return text

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (``results.json``'s ``link_measurement``)."""
        return {
            "shape": self.shape.to_json(),
            "before": self.before.to_json(),
            "after": None if self.after is None else self.after.to_json(),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MeasuredLink:
        """Rebuild from :meth:`to_json`'s output."""
        after = data.get("after")
        return cls(
            shape=LinkShape.from_json(data["shape"]),
            before=LinkMeasurement.from_json(data["before"]),
            after=None if after is None else LinkMeasurement.from_json(after),
        )
