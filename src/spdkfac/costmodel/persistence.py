"""Calibration files: fitted cost models and their measurements as versioned JSON."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from spdkfac.costmodel.factor import FactorTimeModel
from spdkfac.costmodel.models import (
    DEFAULT_COST_MODEL,
    AlphaBetaModel,
    CostModel,
    PolynomialInverseModel,
)
from spdkfac.costmodel.schema import (
    CalibrationSamples,
    Reader,
    factor_from_json,
    factor_to_json,
    samples_from_json,
    samples_to_json,
)
from spdkfac.support.jsonio import read_json, write_json

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "CalibrationFile",
    "CalibrationSamples",
    "load_cost_model",
    "resolve_cost_model",
    "save_cost_model",
]

FORMAT_NAME: Final = "spdkfac-costmodel"
FORMAT_VERSION: Final = 1

Communication = Mapping[int, tuple[AlphaBetaModel, AlphaBetaModel]]
_ZERO = AlphaBetaModel(alpha=0.0, beta=0.0)


@dataclass(frozen=True, kw_only=True)
class CalibrationFile:
    """Everything ``spdkfac calibrate`` measured and fitted on one machine.

    Attributes:
        inverse: Inverse time vs dimension.
        communication: World size → (broadcast, all-reduce) models. A single-process
            calibration holds world size 1 with α = β = 0 (collectives are no-ops).
        factor: Factor-computation times, or None when no model was measured.
        metadata: JSON-compatible facts about the run (backend, world sizes, device,
            torch version, hostname, date, threads, ...). Normalised through JSON on
            construction, so a saved and reloaded file compares equal.
        samples: The measurements, or None.
        bytes_per_element: Bytes per communicated element the planners assume.
    """

    inverse: PolynomialInverseModel
    communication: Communication
    factor: FactorTimeModel | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    samples: CalibrationSamples | None = None
    bytes_per_element: int = 4

    def __post_init__(self) -> None:
        if not self.communication:
            raise ValueError("communication must hold at least one world size")
        entries: dict[int, tuple[AlphaBetaModel, AlphaBetaModel]] = {}
        for world_size, (broadcast, allreduce) in sorted(self.communication.items()):
            if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
                raise ValueError(f"communication keys must be world sizes >= 1, got {world_size!r}")
            entries[world_size] = (broadcast, allreduce)
        object.__setattr__(self, "communication", MappingProxyType(entries))
        if self.bytes_per_element < 1:
            raise ValueError(f"bytes_per_element must be >= 1, got {self.bytes_per_element}")
        try:
            normalised = json.loads(json.dumps(dict(self.metadata), allow_nan=False))
        except (TypeError, ValueError) as error:
            raise ValueError(f"metadata must be JSON-serialisable: {error}") from None
        object.__setattr__(self, "metadata", MappingProxyType(normalised))

    @property
    def world_sizes(self) -> tuple[int, ...]:
        """The world sizes with a communication entry, ascending."""
        return tuple(self.communication)

    def cost_model(self, world_size: int, *, source: str | None = None) -> CostModel:
        """The :class:`CostModel` for ``world_size``.

        Without an entry for ``world_size`` this warns (``UserWarning``, naming the file,
        the measured sizes and the one used) and falls back rather than failing, because
        α and β of ring and tree collectives change slowly with the number of ranks
        (factors like log P or (P−1)/P), so the nearest measured size (ties: the larger,
        which overestimates communication) gives a usable plan, and a job should not die
        for having been calibrated at 8 ranks and launched on 6. When only world size 1
        was measured, whose zero costs say nothing about a real link, the built-in
        default collectives are used instead, also with a warning. World size 1 itself
        never communicates, so it needs no entry and gets α = β = 0 silently.

        Args:
            world_size: Ranks of the run that will use the model.
            source: Where the calibration came from, for the warning text.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        where = source or "calibration"
        if world_size in self.communication:
            broadcast, allreduce = self.communication[world_size]
        elif world_size == 1:
            broadcast, allreduce = _ZERO, _ZERO
        else:
            measured = [size for size in self.communication if size > 1]
            if measured:
                nearest = min(measured, key=lambda size: (abs(size - world_size), -size))
                broadcast, allreduce = self.communication[nearest]
                used = f"using the collectives measured at world size {nearest}"
            else:
                broadcast, allreduce = DEFAULT_COST_MODEL.broadcast, DEFAULT_COST_MODEL.allreduce
                used = "using the built-in default collective costs"
            warnings.warn(
                f"{where}: no communication costs for world size {world_size} "
                f"(measured: {list(self.world_sizes)}); {used}. Run `spdkfac calibrate` "
                f"with {world_size} ranks for an exact model.",
                UserWarning,
                stacklevel=2,
            )
        return CostModel(
            inverse=self.inverse,
            broadcast=broadcast,
            allreduce=allreduce,
            bytes_per_element=self.bytes_per_element,
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON document (format ``spdkfac-costmodel``, version 1)."""
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "metadata": dict(self.metadata),
            "bytes_per_element": self.bytes_per_element,
            "inverse": {
                "form": "polynomial",
                "c0": self.inverse.c0,
                "c2": self.inverse.c2,
                "c3": self.inverse.c3,
            },
            "communication": {
                str(size): {
                    "broadcast": {"alpha": broadcast.alpha, "beta": broadcast.beta},
                    "allreduce": {"alpha": allreduce.alpha, "beta": allreduce.beta},
                }
                for size, (broadcast, allreduce) in self.communication.items()
            },
            "factor": None if self.factor is None else factor_to_json(self.factor),
            "samples": None if self.samples is None else samples_to_json(self.samples),
        }

    @classmethod
    def from_json(cls, data: Any, *, source: str = "<json>") -> CalibrationFile:
        """Validate and build from :meth:`to_json`'s output.

        Raises:
            ValueError: Naming ``source`` and the first problem: not a cost-model
                document, another format version, or a missing or malformed field.
        """
        reader = Reader(source)
        root = reader.mapping(data, "document")
        if root.get("format") != FORMAT_NAME:
            raise reader.error(
                "document", f"not a {FORMAT_NAME} file (format={root.get('format')!r})"
            )
        version = root.get("format_version")
        if version != FORMAT_VERSION:
            raise reader.error(
                "format_version", f"is {version!r}; this spdkfac reads version {FORMAT_VERSION}"
            )
        inverse = reader.mapping(root.get("inverse"), "inverse")
        if inverse.get("form") != "polynomial":
            raise reader.error("inverse.form", f"unknown form {inverse.get('form')!r}")
        communication: dict[int, tuple[AlphaBetaModel, AlphaBetaModel]] = {}
        for key, entry in reader.mapping(root.get("communication"), "communication").items():
            if not (key.isascii() and key.isdigit()) or int(key) < 1:
                raise reader.error(f"communication.{key}", "key must be a world size >= 1")
            where = f"communication.{key}"
            body = reader.mapping(entry, where)
            communication[int(key)] = (
                reader.build(AlphaBetaModel, body.get("broadcast"), f"{where}.broadcast"),
                reader.build(AlphaBetaModel, body.get("allreduce"), f"{where}.allreduce"),
            )
        try:
            return cls(
                inverse=reader.build(
                    PolynomialInverseModel,
                    {k: inverse.get(k) for k in ("c0", "c2", "c3")},
                    "inverse",
                ),
                communication=communication,
                factor=factor_from_json(reader, root.get("factor")),
                metadata=reader.mapping(root.get("metadata", {}), "metadata"),
                samples=samples_from_json(reader, root.get("samples")),
                bytes_per_element=reader.integer(
                    root.get("bytes_per_element"), "bytes_per_element"
                ),
            )
        except ValueError as error:
            if str(error).startswith(source):
                raise
            raise reader.error("document", str(error)) from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the JSON atomically: a temporary file in the same directory, fsync, rename.

        A reader (another rank, a crashed run) sees the old file or the new one, never a
        partial one. Returns the path written.
        """
        return write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> CalibrationFile:
        """Read and validate a file written by :meth:`save`.

        Raises:
            FileNotFoundError: No file at ``path`` (the message names it).
            ValueError: The file is not UTF-8 JSON, not a cost-model file, another format
                version, or has a missing or malformed field (the message names the file
                and the reason).
        """
        data = read_json(path, "cost-model file")
        return cls.from_json(data, source=str(Path(path)))


def save_cost_model(
    path: str | os.PathLike[str],
    *,
    inverse: PolynomialInverseModel,
    communication: Communication,
    factor: FactorTimeModel | None = None,
    metadata: Mapping[str, Any] | None = None,
    samples: CalibrationSamples | None = None,
) -> Path:
    """Build a :class:`CalibrationFile` and :meth:`~CalibrationFile.save` it atomically."""
    calibration = CalibrationFile(
        inverse=inverse,
        communication=communication,
        factor=factor,
        metadata=metadata or {},
        samples=samples,
    )
    return calibration.save(path)


def load_cost_model(path: str | os.PathLike[str], world_size: int) -> CostModel:
    """The :class:`CostModel` for ``world_size`` from a calibration file.

    Missing or unreadable files raise (see :meth:`CalibrationFile.load`); a file without
    ``world_size`` warns and falls back (see :meth:`CalibrationFile.cost_model`).
    """
    return CalibrationFile.load(path).cost_model(world_size, source=str(path))


def resolve_cost_model(
    cost_model: CostModel | CalibrationFile | str | os.PathLike[str] | None, world_size: int
) -> CostModel:
    """Turn what a user passes as ``cost_model=`` into a :class:`CostModel`.

    Args:
        cost_model: None (the built-in :data:`DEFAULT_COST_MODEL`), a ready model, a
            loaded :class:`CalibrationFile`, or the path of a calibration file.
        world_size: Ranks of the run; selects the communication entry.

    Raises:
        TypeError: Any other type.
        FileNotFoundError, ValueError: From :func:`load_cost_model`.
    """
    if cost_model is None:
        return DEFAULT_COST_MODEL
    if isinstance(cost_model, CostModel):
        return cost_model
    if isinstance(cost_model, CalibrationFile):
        return cost_model.cost_model(world_size)
    if isinstance(cost_model, (str, os.PathLike)):
        if not os.fspath(cost_model):
            raise ValueError("cost_model path must not be empty")
        return load_cost_model(cost_model, world_size)
    raise TypeError(
        "cost_model must be a CostModel, a CalibrationFile, a path to a calibration file "
        f"or None, got {type(cost_model).__name__}"
    )
