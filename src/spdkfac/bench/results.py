"""What a benchmark run measured (``results.json``) and the statistics the report shows."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from spdkfac.bench.variants import VARIANTS, after_backward_baseline
from spdkfac.support.jsonio import read_json, write_json

__all__ = [
    "BenchResults",
    "ExposedFactorComm",
    "IterationStats",
    "VariantResult",
    "exposed_factor_comm",
    "iteration_stats",
    "ratio_to",
]

_FORMAT = 1


@dataclass(frozen=True)
class VariantResult:
    """One variant's measurements.

    Attributes:
        name: Key of :data:`~spdkfac.bench.variants.VARIANTS`.
        times: Seconds of every iteration, warm-up included, one sequence per rank.
        warmup: Leading iterations left out of every statistic.
        breakdown: Seconds per measured iteration in the paper's categories, averaged over
            ranks (:func:`spdkfac.profiling.breakdown`).
        plan: The inverse placement's summary (empty for SGD).
        fusion_buckets: Factor all-reduces per step at the end (None: SGD or one rank).
        skipped_steps: K-FAC steps skipped on non-finite values (rank 0).
    """

    name: str
    times: tuple[tuple[float, ...], ...]
    warmup: int
    breakdown: Mapping[str, float]
    plan: str = ""
    fusion_buckets: int | None = None
    skipped_steps: int = 0

    @property
    def measured(self) -> list[float]:
        """Per measured iteration, the slowest rank's time (the job waits for it)."""
        kept = [list(rank_times[self.warmup :]) for rank_times in self.times]
        if not kept or not kept[0]:
            return []
        return [max(values) for values in zip(*kept, strict=True)]


@dataclass(frozen=True)
class BenchResults:
    """A whole run, as ``results.json`` holds it (times in seconds).

    ``factor_unpack`` is the measured host time per factor step of rebuilding every factor
    from its packed triangle (see :func:`spdkfac.bench.costs.unpack_seconds`): compute that
    the profiler counts inside ``FactorComm`` and no fusion policy can hide.
    ``link_measurement`` is an emulated link's setting and measured rate
    (:meth:`spdkfac.bench.link.MeasuredLink.to_json`); empty on loopback and under torchrun.
    ``layout`` is how every variant's model was distributed: ``"ddp"``
    (``DistributedDataParallel``, or the plain model on one rank) or ``"fsdp"`` (FSDP2).
    """

    command: str
    model: str
    world_size: int
    batch_size: int
    link: str
    variants: tuple[VariantResult, ...]
    settings: Mapping[str, Any] = field(default_factory=dict)
    machine: Mapping[str, Any] = field(default_factory=dict)
    cost_model: Mapping[str, Any] = field(default_factory=dict)
    factor_unpack: float = 0.0
    link_measurement: Mapping[str, Any] = field(default_factory=dict)
    layout: str = "ddp"

    def variant(self, name: str) -> VariantResult | None:
        """The result of variant ``name``, None when it did not run."""
        return next((v for v in self.variants if v.name == name), None)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (see :meth:`from_json`)."""
        data = asdict(self)
        data["format"] = _FORMAT
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BenchResults:
        """Rebuild results from :meth:`to_json`'s output."""
        if data.get("format") != _FORMAT:
            raise ValueError(f"results format {data.get('format')!r} is not {_FORMAT}")
        variants = tuple(
            VariantResult(
                name=item["name"],
                times=tuple(tuple(float(t) for t in rank) for rank in item["times"]),
                warmup=int(item["warmup"]),
                breakdown={k: float(v) for k, v in item["breakdown"].items()},
                plan=item.get("plan", ""),
                fusion_buckets=item.get("fusion_buckets"),
                skipped_steps=int(item.get("skipped_steps", 0)),
            )
            for item in data["variants"]
        )
        return cls(
            command=data["command"],
            model=data["model"],
            world_size=int(data["world_size"]),
            batch_size=int(data["batch_size"]),
            link=data["link"],
            variants=variants,
            settings=dict(data.get("settings", {})),
            machine=dict(data.get("machine", {})),
            cost_model=dict(data.get("cost_model", {})),
            factor_unpack=float(data.get("factor_unpack", 0.0)),
            link_measurement=dict(data.get("link_measurement") or {}),
            layout=str(data.get("layout", "ddp")),  # files written before FSDP2 rows: DDP
        )

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_json` to ``path`` atomically (NaN allowed: unmeasured fits)."""
        return write_json(path, self.to_json(), indent=1, allow_nan=True)

    @classmethod
    def load(cls, path: str | Path) -> BenchResults:
        """Read what :meth:`save` wrote.

        Raises:
            FileNotFoundError: No file at ``path``.
            ValueError: The file is not JSON or not a results file of this format.
        """
        return cls.from_json(read_json(path, "benchmark results file"))


@dataclass(frozen=True)
class IterationStats:
    """Median, quartiles (linear interpolation) and mean of the measured iteration times
    (the mean counts refresh steps in their share; the median hides them)."""

    count: int
    median: float
    q1: float
    q3: float
    mean: float


def iteration_stats(result: VariantResult) -> IterationStats:
    """Statistics of :attr:`VariantResult.measured`.

    Raises:
        ValueError: When no iteration was measured.
    """
    values = result.measured
    if not values:
        raise ValueError(f"variant {result.name!r} has no measured iterations")
    if len(values) == 1:
        return IterationStats(1, values[0], values[0], values[0], values[0])
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return IterationStats(len(values), median, q1, q3, statistics.fmean(values))


def ratio_to(results: BenchResults, name: str, reference: str) -> float | None:
    """Median iteration time of ``name`` over that of ``reference`` (None if it is absent)."""
    mine, theirs = results.variant(name), results.variant(reference)
    if mine is None or theirs is None:
        return None
    return iteration_stats(mine).median / iteration_stats(theirs).median


@dataclass(frozen=True)
class ExposedFactorComm:
    """One row of the Fig. 10 comparison.

    Attributes:
        name: The variant.
        exposed: Its non-overlapped factor communication, seconds per iteration.
        baseline: The after-backward variant it is compared with (None: none ran).
        hidden_percent: Share of the baseline's exposed factor communication this variant
            hides, ``100·(1 − exposed / baseline's)``; None without a usable baseline.
        reduction: Baseline's exposed over this one's (None when either is 0 or absent).
        communication: ``exposed`` less the run's unpack time (never below 0).
        hidden_communication_percent: ``hidden_percent`` computed on ``communication``.
    """

    name: str
    exposed: float
    baseline: str | None
    hidden_percent: float | None
    reduction: float | None
    communication: float
    hidden_communication_percent: float | None


def exposed_factor_comm(results: BenchResults) -> list[ExposedFactorComm]:
    """The Fig. 10 rows: every K-FAC variant's exposed ``FactorComm`` against its baseline."""
    names = [v.name for v in results.variants]
    unpack = results.factor_unpack
    rows = []
    for result in results.variants:
        if not VARIANTS[result.name].uses_kfac:
            continue
        exposed = result.breakdown.get("FactorComm", 0.0)
        baseline = after_backward_baseline(result.name, names)
        reference = None
        if baseline is not None:
            found = results.variant(baseline)
            reference = None if found is None else found.breakdown.get("FactorComm", 0.0)
        communication = max(0.0, exposed - unpack)
        reference_communication = None if reference is None else max(0.0, reference - unpack)
        rows.append(
            ExposedFactorComm(
                name=result.name,
                exposed=exposed,
                baseline=baseline,
                hidden_percent=_hidden(exposed, reference),
                reduction=reference / exposed if reference and exposed > 0 else None,
                communication=communication,
                hidden_communication_percent=_hidden(communication, reference_communication),
            )
        )
    return rows


def _hidden(exposed: float, reference: float | None) -> float | None:
    """``100·(1 − exposed / reference)``; None without a positive reference."""
    return None if not reference else 100.0 * (1.0 - exposed / reference)
