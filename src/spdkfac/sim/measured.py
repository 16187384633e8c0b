"""Per-op and per-layer compute times measured on a real device, saved for the simulator.

The roofline of :class:`~spdkfac.sim.hardware.DeviceModel` predicts any model; when the
model itself can be run on one worker, its measured times are better: every forward and
backward op of one iteration (the timed trace of :func:`~spdkfac.sim.workload
.trace_workload`) and every layer's A and G products
(:func:`~spdkfac.calibrate_factors.measure_factors`). :func:`measure_compute` takes them,
:meth:`MeasuredCompute.apply` puts them into a workload and hardware, and
``spdkfac simulate --measured PATH`` uses a saved file.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import torch
from torch import nn

from spdkfac.calibrate.factors import measure_factors
from spdkfac.costmodel import FactorTimeModel
from spdkfac.sim.hardware import Hardware
from spdkfac.sim.workload import Op, TraceItem, Workload, trace_workload
from spdkfac.support.jsonio import read_json, write_json

__all__ = ["FORMAT_NAME", "MeasuredCompute", "measure_compute"]

FORMAT_NAME: Final = "spdkfac-sim-measured"
_VERSION: Final = 1


@dataclass(frozen=True)
class MeasuredCompute:
    """Measured compute of one model at one batch size.

    Attributes:
        model: Model name.
        batch_size: Examples per rank.
        input_shape: Shape of one example.
        op_seconds: Seconds of every op of the trace (forward then backward, in order).
        factor_seconds: Layer → (A seconds, G seconds).
        metadata: JSON-compatible facts (device, threads, torch version, ...).
    """

    model: str
    batch_size: int
    input_shape: tuple[int, ...]
    op_seconds: tuple[float, ...]
    factor_seconds: Mapping[str, tuple[float, float]]
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if any(not seconds >= 0 for seconds in self.op_seconds):
            raise ValueError("op_seconds must be >= 0")
        pairs = {str(k): (float(a), float(g)) for k, (a, g) in self.factor_seconds.items()}
        object.__setattr__(self, "factor_seconds", MappingProxyType(pairs))
        object.__setattr__(self, "input_shape", tuple(int(n) for n in self.input_shape))

    def apply(self, workload: Workload, hardware: Hardware) -> tuple[Workload, Hardware]:
        """``workload`` with measured op times and ``hardware`` with measured products (and
        the ranks' speed spread, when the file was measured with concurrent processes).

        Raises:
            ValueError: When the workload is another model, batch or input shape, or its
                trace has a different number of ops.
        """
        key = (workload.model, workload.batch_size, workload.input_shape)
        if key != (self.model, self.batch_size, self.input_shape):
            raise ValueError(
                f"measured compute is for {self.model} batch {self.batch_size} input "
                f"{self.input_shape}, not {workload.model} batch {workload.batch_size} "
                f"input {workload.input_shape}"
            )
        if len(workload.ops()) != len(self.op_seconds):
            raise ValueError(
                f"measured {len(self.op_seconds)} ops but the trace has {len(workload.ops())}"
            )
        times = iter(self.op_seconds)

        def timed(items: tuple[TraceItem, ...]) -> tuple[TraceItem, ...]:
            return tuple(
                Op(i.name, i.flops, i.bytes, i.gemm_side, next(times)) if isinstance(i, Op) else i
                for i in items
            )

        forward = timed(workload.forward)
        measured = replace(workload, forward=forward, backward=timed(workload.backward))
        factor = FactorTimeModel(
            a_rate=hardware.factor.a_rate,
            g_rate=hardware.factor.g_rate,
            layers={**hardware.factor.layers, **self.factor_seconds},
        )
        spread = self.metadata.get("rank_spread")
        if isinstance(spread, (int, float)) and 0 <= spread < 0.5:
            hardware = replace(hardware, rank_spread=float(spread))
        return measured, replace(hardware, factor=factor, factor_layers_for=key)

    def to_json(self) -> dict[str, Any]:
        """A JSON document (see :meth:`from_json`)."""
        return {
            "format": FORMAT_NAME,
            "format_version": _VERSION,
            "model": self.model,
            "batch_size": self.batch_size,
            "input_shape": list(self.input_shape),
            "metadata": dict(self.metadata),
            "op_seconds": list(self.op_seconds),
            "factor_seconds": {name: list(pair) for name, pair in self.factor_seconds.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, source: str = "<json>") -> MeasuredCompute:
        """Rebuild from :meth:`to_json` output.

        Raises:
            ValueError: Naming ``source`` when it is not such a document.
        """
        if data.get("format") != FORMAT_NAME or data.get("format_version") != _VERSION:
            raise ValueError(f"{source}: not a {FORMAT_NAME} version {_VERSION} file")
        try:
            return cls(
                model=str(data["model"]),
                batch_size=int(data["batch_size"]),
                input_shape=tuple(data["input_shape"]),
                op_seconds=tuple(float(v) for v in data["op_seconds"]),
                factor_seconds={k: (v[0], v[1]) for k, v in data["factor_seconds"].items()},
                metadata=dict(data.get("metadata", {})),
            )
        except (KeyError, TypeError, IndexError) as error:
            raise ValueError(f"{source}: malformed measured-compute file ({error!r})") from None

    def save(self, path: str | Path) -> Path:
        """Write the JSON document."""
        return write_json(path, self.to_json(), indent=1, allow_nan=True)

    @classmethod
    def load(cls, path: str | Path) -> MeasuredCompute:
        """Read a file written by :meth:`save`."""
        return cls.from_json(read_json(path, "measured-compute file"), source=str(path))


def measure_compute(
    build: Callable[[], nn.Module],
    input_shape: tuple[int, ...],
    *,
    batch_size: int,
    name: str,
    repeats: int = 5,
    device: str | torch.device = "cpu",
) -> MeasuredCompute:
    """Time every op of one iteration and every layer's factor products on ``device``.

    Uses the threads torch is set to; set them as the real run does (one per rank).
    """
    device = torch.device(device)
    torch.manual_seed(0)
    with device:
        model = build()
    workload = trace_workload(
        model, input_shape, batch_size=batch_size, name=name, device=device, repeats=repeats
    )
    inputs = torch.randn(batch_size, *input_shape, device=device)
    targets = torch.randint(0, 2, (batch_size,), device=device)
    samples = measure_factors(model, inputs, targets, repeats)
    factors: dict[str, list[float]] = {}
    for sample in samples:
        factors.setdefault(sample.layer, [0.0, 0.0])[0 if sample.kind == "A" else 1] = (
            sample.seconds
        )
    return MeasuredCompute(
        model=name,
        batch_size=batch_size,
        input_shape=tuple(input_shape),
        op_seconds=tuple(op.seconds or 0.0 for op in workload.ops()),
        factor_seconds={layer: (pair[0], pair[1]) for layer, pair in factors.items()},
        metadata={
            "device": str(device),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "platform": platform.platform(),
            "repeats": repeats,
        },
    )
