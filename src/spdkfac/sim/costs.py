"""Seconds of every piece of one simulated iteration, from a workload and its hardware.

Besides the traced forward/backward ops, the factor products and the inverses, a real step
does bookkeeping on every factor and gradient. It is counted here op by op, as the code
runs it, in terms of a few elementwise *primitives* (see :data:`PRIMITIVES`); each costs
``overhead + seconds_per_element · elements`` from ``Hardware.bookkeeping`` when measured
there, else the device roofline's memory bandwidth:

* hook: ``FactorAccumulator.add`` scales the factor by its batch size, the hand-over
  divides it back (``mean()``), and the exchange packs the triangle, scales and copies it
  into its bucket (the last three only with more than one rank);
* step prologue: the gradients' and, on factor steps, every pending factor's
  ``isfinite().all()``, then ``mean()`` of every factor again;
* inside the factor wait: per factor, divide the reduced triangle, unpack it, and check
  the sum is finite (:func:`~spdkfac.linalg.is_finite`);
* running average (in place: scale and add), packing inverses on owners (the inverse
  form's wire elements), unpacking them on receivers, the KL clip (a dot product, a scale
  and a copy per layer) and momentum SGD.

Inversions are the hardware's inverse-time fit (of damped inverses by Cholesky) times the
workload's inverse form's ``compute_scale`` (:mod:`spdkfac.forms`).

When the hardware carries pieces measured inside a profiled run of this workload
(``Hardware.spans``, see :mod:`spdkfac.sim.profiled`), those replace the models above.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Final

from spdkfac.linalg import packed_size
from spdkfac.profiling import Phase, span_name
from spdkfac.sim.hardware import Hardware
from spdkfac.sim.workload import LayerSpec, Op, Workload

__all__ = ["PRIMITIVES", "WorkloadCosts", "piece_name"]

#: Primitive → (float32 bytes touched per element, ops) for the roofline fallback.
PRIMITIVES: Final[dict[str, tuple[int, int]]] = {
    "scale": (8, 1),  # out-of-place or in-place multiply/divide by a scalar
    "copy": (8, 1),
    "pack": (8, 1),  # index_select of the upper triangle; elements = packed size
    "unpack": (12, 3),  # new_empty + two index_copy_; elements = full size
    "finite_all": (5, 2),  # isfinite(t).all()
    "finite_sum": (4, 2),  # t.sum(dtype=float64) then isfinite
    "average": (16, 2),  # ξF + (1−ξ)F_new in place
    "dot": (8, 2),  # (a * b).sum()
    "sgd": (20, 3),  # momentum SGD, per parameter tensor
    "matmul": (0, 2),  # Ĝ ∇ Â; elements = FLOPs (roofline: the device's GEMM rate)
}


def piece_name(phase: Phase, layer: str) -> str:
    """A profiled piece's key in ``Hardware.spans``: its span name without ``kfac/``."""
    return span_name(phase, layer).removeprefix("kfac/")


@dataclass(frozen=True)
class WorkloadCosts:
    """Per-piece seconds of ``workload`` on ``hardware`` with ``world_size`` ranks."""

    workload: Workload
    hardware: Hardware
    world_size: int

    def primitive(self, name: str, elements: float) -> float:
        """Seconds of one call of a bookkeeping primitive on ``elements`` elements."""
        scale = self.hardware.bookkeeping_scale
        measured = self.hardware.bookkeeping.get(name)
        if measured is not None:
            overhead, per_element = measured
            return scale * (overhead + per_element * elements)
        nbytes, ops = PRIMITIVES[name]
        device = self.hardware.device
        if name == "matmul":
            return scale * (ops * device.op_overhead_seconds + device.gemm_seconds(elements))
        return scale * (ops * device.op_overhead_seconds + device.memory_seconds(nbytes * elements))

    def profiled(self, name: str) -> float | None:
        """Seconds of piece ``name`` measured in a profiled run of this workload, if any."""
        workload = self.workload
        if self.hardware.spans_for != (workload.model, workload.batch_size, workload.input_shape):
            return None
        return self.hardware.spans.get(name)

    def op(self, op: Op) -> float:
        """A traced forward or backward op."""
        return self.hardware.device.op_seconds(op)

    def factor(self, layer: LayerSpec, kind: str) -> float:
        """A hook's work: the product, the hook's Python, the accumulator's scaling and,
        with more than one rank, the hand-over into the exchange."""
        profiled = self.profiled(piece_name(Phase.FACTOR_COMPUTE, f"{layer.name}/{kind}"))
        if profiled is not None:
            return profiled
        dim = layer.a_dim if kind == "A" else layer.g_dim
        full, packed = dim * dim, packed_size(dim)
        seconds = self.hardware.factor_seconds(self.workload, layer, kind)
        seconds += self.hardware.hook_overhead_seconds + self.primitive("scale", full)
        if self.world_size > 1:
            seconds += self.primitive("scale", full) + self.primitive("pack", packed)
            seconds += self.primitive("scale", packed) + self.primitive("copy", packed)
        return seconds

    def _dims(self, layers: Collection[str] | None = None) -> list[int]:
        return [
            d
            for layer in self.workload.layers
            if layers is None or layer.name in layers
            for d in (layer.a_dim, layer.g_dim)
        ]

    def _piece(
        self,
        name: str,
        model: Callable[[Collection[str] | None], float],
        layers: Collection[str] | None,
    ) -> float:
        """Piece ``name`` for ``layers`` (None: every layer): ``model(layers)``, or when a
        profiled run measured the piece, its time scaled by their share of the model."""
        profiled = self.profiled(name)
        if profiled is None:
            return model(layers)
        if layers is None:
            return profiled
        whole = model(None)
        return profiled * model(layers) / whole if whole > 0 else 0.0

    def step_prologue(self, factor_step: bool) -> float:
        """Before the factor wait: gradient checks, and on factor steps the factors'
        finiteness check and ``mean()``."""
        profiled = self.profiled(piece_name(Phase.STEP, "prologue")) if factor_step else None
        if profiled is not None:
            return profiled
        layers = self.workload.layers
        seconds = sum(self.primitive("finite_all", layer.g_dim * layer.a_dim) for layer in layers)
        if factor_step:
            for dim in self._dims():
                seconds += self.primitive("finite_all", dim * dim)
                seconds += self.primitive("scale", dim * dim)
        return seconds

    def unpack_factors(self, layers: Collection[str] | None = None) -> float:
        """Rebuilding every reduced factor (of ``layers`` only, when given: an owner's)
        inside the exchange's ``wait()``."""
        return self._piece(piece_name(Phase.FACTOR_COMM, "unpack"), self._unpack, layers)

    def _unpack(self, layers: Collection[str] | None) -> float:
        return sum(
            self.primitive("scale", packed_size(d))
            + self.primitive("unpack", d * d)
            + self.primitive("finite_sum", d * d)
            for d in self._dims(layers)
        )

    def running_average(self, layers: Collection[str] | None = None) -> float:
        """``F ← ξF + (1−ξ)F_new`` for every factor (of ``layers`` only, when given)."""
        name = piece_name(Phase.FACTOR_COMPUTE, "running_average")
        return self._piece(name, self._average, layers)

    def _average(self, layers: Collection[str] | None) -> float:
        return sum(self.primitive("average", d * d) for d in self._dims(layers))

    def inverse(self, dim: int, key: str | None = None) -> float:
        """One result of the workload's inverse form (of factor ``key``, when a profiled
        run timed it): the hardware's inverse-time fit (damped inverses by Cholesky)
        times the form's ``compute_scale``."""
        profiled = None if key is None else self.profiled(piece_name(Phase.INVERSE_COMPUTE, key))
        if profiled is not None:
            return profiled
        return self.workload.form.compute_scale * self.hardware.inverse.predict(dim)

    def pack_inverse(self, dim: int) -> float:
        """The owner writing one result into its broadcast buffer (the form's wire
        elements: a packed triangle, or an eigen-basis's ``d² + d``)."""
        wire = self.workload.form.wire_size(dim)
        return self.primitive("pack", wire) + self.primitive("copy", wire)

    def unpack_inverse(self, dim: int) -> float:
        """A receiver rebuilding one broadcast inverse."""
        return self.primitive("unpack", dim * dim)

    def precondition(self, layer: LayerSpec) -> float:
        """``V = Ĝ ∇ Â`` (two GEMMs) and the per-layer Python of ``step()`` around it."""
        profiled = self.profiled(piece_name(Phase.PRECONDITION, layer.name))
        if profiled is not None:
            return profiled
        seconds = self.hardware.layer_step_overhead_seconds
        if "matmul" in self.hardware.bookkeeping:
            return seconds + self.primitive("matmul", layer.precondition_flops)
        device = self.hardware.device
        side = min(layer.g_dim, layer.a_dim)
        return (
            seconds
            + 2 * device.op_overhead_seconds
            + device.gemm_seconds(layer.precondition_flops, side)
        )

    def kl_clip(self) -> float:
        """``Σ⟨V, ∇⟩`` over layers, then scaling and writing every gradient back."""
        profiled = self.profiled(piece_name(Phase.PRECONDITION, "kl_clip"))
        if profiled is not None:
            return profiled
        return self._kl_clip(None, ("dot", "scale", "copy"))

    def _kl_clip(self, layers: Collection[str] | None, primitives: tuple[str, ...]) -> float:
        return sum(
            sum(self.primitive(name, n) for name in primitives)
            for n in (
                layer.g_dim * layer.a_dim
                for layer in self.workload.layers
                if layers is None or layer.name in layers
            )
        )

    def _kl_part(self, layers: Collection[str] | None, primitives: tuple[str, ...]) -> float:
        """Part of the KL clip's work; a profiled ``kl_clip`` scaled by its modelled share."""
        part = self._kl_clip(layers, primitives)
        profiled = self.profiled(piece_name(Phase.PRECONDITION, "kl_clip"))
        if profiled is None:
            return part
        whole = self._kl_clip(None, ("dot", "scale", "copy"))
        return profiled * part / whole if whole > 0 else 0.0

    def kl_terms(self, layers: Collection[str]) -> float:
        """An owner's share of the KL clip: ``⟨V, ∇⟩`` over its ``layers``."""
        return self._kl_part(layers, ("dot",))

    def write_gradients(self) -> float:
        """Scaling every gathered preconditioned gradient by ν into ``.grad``."""
        return self._kl_part(None, ("scale", "copy"))

    def optimizer(self) -> float:
        """Momentum SGD over every parameter tensor, ``zero_grad`` and the per-iteration
        host overhead."""
        profiled = self.profiled(piece_name(Phase.ITERATION, "tail"))
        if profiled is not None:
            return profiled
        return self.hardware.iteration_overhead_seconds + sum(
            self.primitive("sgd", numel) for _, numel in self.workload.parameters
        )
