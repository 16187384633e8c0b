"""The items of a traced iteration: ATen ops and the moments K-FAC and DDP act."""

from __future__ import annotations

from dataclasses import dataclass

from spdkfac.types import FactorKind

__all__ = ["FactorHook", "GradReady", "Op", "TraceItem"]


@dataclass(frozen=True)
class Op:
    """One ATen operation.

    Attributes:
        name: The operator (``aten.convolution``), for reports.
        flops: Floating-point operations (PyTorch's flop counter; 0 for other ops).
        bytes: Bytes of every tensor read or written.
        gemm_side: Smallest side of the GEMM it amounts to (0: not a GEMM, or unknown).
        seconds: Measured time, when the trace timed the operation on a real device.
    """

    name: str
    flops: float
    bytes: float
    gemm_side: int = 0
    seconds: float | None = None


@dataclass(frozen=True)
class FactorHook:
    """A K-FAC hook firing: ``"A"`` in the forward pre-hook, ``"G"`` on the output gradient."""

    kind: FactorKind
    layer: str


@dataclass(frozen=True)
class GradReady:
    """A parameter's gradient became final (DDP may launch its bucket)."""

    parameter: str
    numel: int


TraceItem = Op | FactorHook | GradReady
