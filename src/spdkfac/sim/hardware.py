"""What things cost on a simulated cluster: compute roofline, factors, inverses, collectives."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal

from spdkfac.costmodel import (
    AlphaBetaModel,
    CalibrationFile,
    CostModel,
    FactorTimeModel,
    PolynomialInverseModel,
)
from spdkfac.sim.collectives import CollectiveOp
from spdkfac.sim.network import CollectiveCost, Network
from spdkfac.sim.workload import LayerSpec, Op, Workload
from spdkfac.support.checks import check_int, check_number

__all__ = ["CommunicationModel", "DeviceModel", "Hardware"]

Scaling = Literal["constant", "ring"]


@dataclass(frozen=True, kw_only=True)
class DeviceModel:
    """Seconds of a traced op: a roofline with a GEMM efficiency curve.

    ``t = overhead + max(flops / rate(side), bytes / bandwidth)`` where a GEMM whose
    smallest side is ``s`` runs at ``rate = peak · s / (s + half)`` (narrow GEMMs waste
    most of each register or shared-memory tile); ops without FLOPs are memory-bound.
    ``op_scale`` corrects op kinds that stray from the roofline in a consistent way (on a
    CPU, training-mode batch norm makes several passes over its input), as fitted by
    :func:`~spdkfac.sim.calibration.fit_device_model`. An op timed on the device
    (``Op.seconds``) keeps its measured time.

    Attributes:
        gemm_flops_per_second: Peak GEMM rate.
        gemm_half_side: Smallest GEMM side at which the rate halves (0: always peak).
        memory_bytes_per_second: Sustained memory bandwidth of elementwise ops.
        op_overhead_seconds: Fixed cost per op (dispatch, kernel launch).
        op_scale: Op name (``aten.native_batch_norm``) → factor on its roofline time.
    """

    gemm_flops_per_second: float
    gemm_half_side: float = 0.0
    memory_bytes_per_second: float
    op_overhead_seconds: float = 0.0
    op_scale: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        scale = {
            str(name): check_number(f"op_scale[{str(name)!r}]", value)
            for name, value in self.op_scale.items()
        }
        object.__setattr__(self, "op_scale", MappingProxyType(scale))
        check_number("gemm_flops_per_second", self.gemm_flops_per_second)
        check_number("gemm_half_side", self.gemm_half_side, low_inclusive=True)
        check_number("memory_bytes_per_second", self.memory_bytes_per_second)
        check_number("op_overhead_seconds", self.op_overhead_seconds, low_inclusive=True)

    def gemm_seconds(self, flops: float, side: float = 0.0) -> float:
        """Seconds of ``flops`` GEMM operations whose smallest side is ``side``."""
        rate = self.gemm_flops_per_second
        if side > 0 and self.gemm_half_side > 0:
            rate *= side / (side + self.gemm_half_side)
        return flops / rate

    def memory_seconds(self, nbytes: float) -> float:
        """Seconds to stream ``nbytes`` bytes."""
        return nbytes / self.memory_bytes_per_second

    def op_seconds(self, op: Op) -> float:
        """Seconds of one traced op (its measurement when it has one)."""
        if op.seconds is not None:
            return op.seconds
        compute = self.gemm_seconds(op.flops, op.gemm_side) if op.flops > 0 else 0.0
        roofline = max(compute, self.memory_seconds(op.bytes)) * self.op_scale.get(op.name, 1.0)
        return self.op_overhead_seconds + roofline


@dataclass(frozen=True)
class CommunicationModel:
    """Broadcast and all-reduce α-β models per world size (a :class:`Network`).

    A reduce-scatter and an all-gather each cost half the all-reduce's α and β (a ring
    all-reduce is a reduce-scatter followed by an all-gather); a reduce costs what the
    broadcast does (the same messages, backwards).

    Attributes:
        measured: World size → (broadcast, all-reduce), as calibrated.
        scaling: How to reach an unmeasured world size from the nearest measured one:
            ``"constant"`` keeps its α and β (the SPD-KFAC paper's single fit for all P);
            ``"ring"`` scales a ring all-reduce (α ∝ P−1, β ∝ (P−1)/P) and a tree
            broadcast (α ∝ ⌈log₂P⌉, β constant).
    """

    measured: Mapping[int, tuple[AlphaBetaModel, AlphaBetaModel]]
    scaling: Scaling = "constant"

    def __post_init__(self) -> None:
        entries = {int(size): pair for size, pair in self.measured.items() if size > 1}
        if not entries:
            raise ValueError("communication needs a measured world size > 1")
        if self.scaling not in ("constant", "ring"):
            raise ValueError(f"scaling must be 'constant' or 'ring', got {self.scaling!r}")
        object.__setattr__(self, "measured", MappingProxyType(dict(sorted(entries.items()))))

    def at(self, world_size: int) -> tuple[AlphaBetaModel, AlphaBetaModel]:
        """(broadcast, all-reduce) at ``world_size`` (free at 1)."""
        if world_size <= 1:
            zero = AlphaBetaModel(alpha=0.0, beta=0.0)
            return zero, zero
        if world_size in self.measured:
            return self.measured[world_size]
        base = min(self.measured, key=lambda size: (abs(size - world_size), -size))
        broadcast, allreduce = self.measured[base]
        if self.scaling == "constant":
            return broadcast, allreduce
        steps = (world_size - 1) / (base - 1)
        share = ((world_size - 1) / world_size) / ((base - 1) / base)
        depth = math.ceil(math.log2(world_size)) / math.ceil(math.log2(base))
        return (
            AlphaBetaModel(alpha=broadcast.alpha * depth, beta=broadcast.beta),
            AlphaBetaModel(alpha=allreduce.alpha * steps, beta=allreduce.beta * share),
        )

    def cost(self, op: CollectiveOp, world_size: int) -> CollectiveCost:
        """The cost of ``op`` on ``world_size`` ranks (one line: the measured one)."""
        line = _FROM_PAIR[op](*self.at(world_size))
        return CollectiveCost.of(("measured",), (line,))

    def calibrated(
        self, measured: Mapping[int, tuple[AlphaBetaModel, AlphaBetaModel]]
    ) -> CommunicationModel:
        """Lines measured elsewhere, reached by the same scaling."""
        return CommunicationModel(measured, scaling=self.scaling)


def _half(line: AlphaBetaModel) -> AlphaBetaModel:
    return AlphaBetaModel(alpha=line.alpha / 2, beta=line.beta / 2)


#: Collective → its line from a measured (broadcast, all-reduce) pair.
_FROM_PAIR: Mapping[CollectiveOp, Callable[[AlphaBetaModel, AlphaBetaModel], AlphaBetaModel]] = (
    MappingProxyType(
        {
            CollectiveOp.BROADCAST: lambda broadcast, _: broadcast,
            CollectiveOp.REDUCE: lambda broadcast, _: broadcast,  # a broadcast backwards
            CollectiveOp.ALL_REDUCE: lambda _, allreduce: allreduce,
            CollectiveOp.REDUCE_SCATTER: lambda _, allreduce: _half(allreduce),
            CollectiveOp.ALL_GATHER: lambda _, allreduce: _half(allreduce),
        }
    )
)


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Every cost the simulator needs for one kind of worker and network.

    Attributes:
        name: Preset name.
        description: One line for reports.
        device: Roofline of forward/backward ops and of the K-FAC bookkeeping.
        factor: A and G product times (per-layer measurements and FLOP-rate lines).
        factor_layers_for: ``(model, batch size, example shape)`` the per-layer factor
            measurements were taken on; other workloads use the rate lines.
        inverse: Damped-inverse time vs dimension.
        communication: Collective costs per world size (what collectives take): measured
            α-β lines (:class:`CommunicationModel`) or a cluster's topology
            (:class:`~spdkfac.sim.network.NetworkModel`).
        planning: The collective costs the real run plans with (its fusion and placement
            decisions), when they differ from ``communication``; None: the same.
        bytes_per_element: Bytes of one communicated element.
        bookkeeping: Measured elementwise primitives (:data:`spdkfac.sim.costs.PRIMITIVES`):
            name → (seconds per call, seconds per element); others use the roofline.
        bookkeeping_scale: Factor on every bookkeeping primitive (a profiled run finds
            them slower inside a real step than measured alone).
        hook_overhead_seconds: Host time per K-FAC hook call beyond the product itself.
        issue_overhead_seconds: Host time to post one asynchronous collective.
        layer_step_overhead_seconds: Host time per layer per ``step()`` (counted with the
            layer's preconditioning, where the real loop spends it).
        iteration_overhead_seconds: Host time per iteration outside K-FAC (loop, zero_grad).
        grad_bucket_bytes: DDP's bucket cap (25 MiB).
        first_grad_bucket_bytes: DDP's first bucket cap (1 MiB).
        factor_bucket_bytes: The factor exchange's bucket cap (``bucket_cap_mb``, 64 MiB).
        single_queue: Run every collective through one FIFO queue, as Horovod (the SPD-KFAC
            authors' runtime) does; False gives pipelined factor buckets a channel of
            their own, as this project's second process group does.
        broadcast_buffers: DDP's ``broadcast_buffers``: rank 0's buffers are broadcast,
            blocking, at the start of every forward (Horovod does not).
        overlap: Share of the link rate a collective keeps while a participant computes
            (1: free overlap of communication and computation; see
            :func:`~spdkfac.sim.engine.simulate`).
        contention: Share of its speed a rank's computation loses while one of its
            transfers moves (gloo copying on the same CPU cores; NCCL kernels on the GPU).
        broadcast_overlap: ``overlap`` of broadcasts (None: ``overlap``).
        broadcast_contention: ``contention`` of broadcasts (None: ``contention``).
        rank_spread: Relative standard deviation of the ranks' compute speeds (a
            straggler model: rank r's compute takes ``1 + rank_spread·z_r`` times longer,
            ``z`` spread as normal quantiles).
        jitter: Relative standard deviation of a rank's compute from one iteration to the
            next, independent across ranks (what makes ranks wait for each other at
            collectives even when they are equally fast on average); simulated by
            drawing iterations (:func:`~spdkfac.sim.simulator.simulate_strategy`).
        phase_jitter: ``jitter`` of the compute of one phase (``inverse_compute``,
            ``forward_backward``, ...; :data:`~spdkfac.sim.timeline.JITTER_PHASES`), drawn
            independently of the others; phases not listed use ``jitter``.
        contention_spread: Relative standard deviation of the contention a rank suffers
            from one iteration to the next (independent across ranks; drawn like
            ``jitter``): communication threads slow some iterations of some ranks far
            more than others, so ranks drift apart while factors travel.
        spans: Seconds of named pieces measured inside a profiled run of the real code
            (:class:`~spdkfac.sim.profiled.ProfiledCompute`), used instead of the models.
        spans_for: ``(model, batch size, example shape)`` ``spans`` were measured on.
        notes: Free-form remarks for reports.
    """

    name: str
    description: str
    device: DeviceModel
    factor: FactorTimeModel
    factor_layers_for: tuple[str, int, tuple[int, ...]] | None = None
    inverse: PolynomialInverseModel
    communication: Network
    planning: Network | None = None
    bytes_per_element: int = 4
    bookkeeping: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    bookkeeping_scale: float = 1.0
    hook_overhead_seconds: float = 0.0
    issue_overhead_seconds: float = 0.0
    layer_step_overhead_seconds: float = 0.0
    iteration_overhead_seconds: float = 0.0
    grad_bucket_bytes: int = 25 * 2**20
    first_grad_bucket_bytes: int = 2**20
    factor_bucket_bytes: int = 64 * 2**20
    single_queue: bool = False
    broadcast_buffers: bool = True
    overlap: float = 1.0
    contention: float = 0.0
    broadcast_overlap: float | None = None
    broadcast_contention: float | None = None
    rank_spread: float = 0.0
    jitter: float = 0.0
    phase_jitter: Mapping[str, float] = field(default_factory=dict)
    contention_spread: float = 0.0
    spans: Mapping[str, float] = field(default_factory=dict)
    spans_for: tuple[str, int, tuple[int, ...]] | None = None
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        primitives = {
            str(name): tuple(
                check_number(f"bookkeeping[{str(name)!r}]", value, low_inclusive=True)
                for value in (overhead, per_element)
            )
            for name, (overhead, per_element) in self.bookkeeping.items()
        }
        object.__setattr__(self, "bookkeeping", MappingProxyType(primitives))
        spans = {
            str(name): check_number(f"spans[{str(name)!r}]", seconds, low_inclusive=True)
            for name, seconds in self.spans.items()
        }
        object.__setattr__(self, "spans", MappingProxyType(spans))
        for name in (
            "hook_overhead_seconds",
            "issue_overhead_seconds",
            "layer_step_overhead_seconds",
            "iteration_overhead_seconds",
        ):
            check_number(name, getattr(self, name), low_inclusive=True)
        for name in ("grad_bucket_bytes", "first_grad_bucket_bytes", "factor_bucket_bytes"):
            check_int(name, getattr(self, name))
        check_number("bookkeeping_scale", self.bookkeeping_scale)
        # Shares and relative deviations: (name, value, upper bound, bound included).
        bounded: list[tuple[str, float | None, float, bool]] = [
            ("overlap", self.overlap, 1.0, True),
            ("contention", self.contention, 1.0, False),
            ("broadcast_overlap", self.broadcast_overlap, 1.0, True),
            ("broadcast_contention", self.broadcast_contention, 1.0, False),
            ("rank_spread", self.rank_spread, 0.5, False),
            ("contention_spread", self.contention_spread, 2.0, True),
            ("jitter", self.jitter, 0.5, False),
        ]
        phases = {str(phase): value for phase, value in self.phase_jitter.items()}
        bounded += [(f"phase_jitter[{phase!r}]", v, 0.5, False) for phase, v in phases.items()]
        for name, value, high, inclusive in bounded:
            if value is not None:
                check_number(name, value, low_inclusive=True, high=high, high_inclusive=inclusive)
        phases = {phase: float(value) for phase, value in phases.items()}
        object.__setattr__(self, "phase_jitter", MappingProxyType(phases))

    def jitter_of(self, phase: str) -> float:
        """The relative standard deviation of ``phase``'s compute per iteration."""
        return self.phase_jitter.get(phase, self.jitter)

    def cost_model(self, world_size: int) -> CostModel:
        """The :class:`CostModel` a real run on this hardware would plan with.

        Its broadcast and all-reduce are :class:`~spdkfac.sim.network.CollectiveCost` s at
        ``world_size``: the placement's broadcast-or-invert test and the fusion's merge rule
        see the cheapest algorithm for each message, so plans follow the world size.
        """
        network = self.planning or self.communication
        return CostModel(
            inverse=self.inverse,
            broadcast=network.cost(CollectiveOp.BROADCAST, world_size),
            allreduce=network.cost(CollectiveOp.ALL_REDUCE, world_size),
            bytes_per_element=self.bytes_per_element,
        )

    def collective(self, op: CollectiveOp, world_size: int) -> CollectiveCost:
        """What ``op`` takes on ``world_size`` ranks of this hardware."""
        return self.communication.cost(op, world_size)

    def factor_seconds(self, workload: Workload, layer: LayerSpec, kind: str) -> float:
        """Seconds of ``layer``'s A or G product in ``workload`` (plus the hook overhead)."""
        flops = layer.a_flops if kind == "A" else layer.g_flops
        measured = self.factor_layers_for == (
            workload.model,
            workload.batch_size,
            workload.input_shape,
        )
        name = layer.name if measured else "\0unmeasured"
        return self.factor.seconds(name, "A" if kind == "A" else "G", flops)

    def with_calibration(self, calibration: CalibrationFile, *, source: str) -> Hardware:
        """These costs with a calibration file's inverse, collectives and factor times.

        The file's per-layer factor times apply to the model, batch size and input size
        recorded in its metadata (``spdkfac calibrate --model``).
        """
        communication = self.communication
        measured = {size: pair for size, pair in calibration.communication.items() if size > 1}
        if measured:
            communication = communication.calibrated(measured)
        factor, layers_for = self.factor, self.factor_layers_for
        if calibration.factor is not None:
            factor = calibration.factor
            meta = calibration.metadata
            model, batch, size = meta.get("model"), meta.get("batch_size"), meta.get("input_size")
            layers_for = None
            if isinstance(model, str) and isinstance(batch, int) and isinstance(size, int):
                layers_for = (model, batch, (3, size, size))
        return replace(
            self,
            name=f"{self.name}+{source}",
            inverse=calibration.inverse,
            communication=communication,
            factor=factor,
            factor_layers_for=layers_for,
            bytes_per_element=calibration.bytes_per_element,
        )
