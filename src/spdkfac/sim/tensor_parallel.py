"""FSDP2 × TP K-FAC priced α-β: what the tensor-parallel layout sends, next to FSDP2 alone.

On a ``(dp, tp)`` mesh of ``P = dp·tp`` ranks (``docs/distributed.md``, "Tensor
parallelism"), a model split by its plan (:data:`TP_PLANS`, by module-name suffix, as
:func:`spdkfac.comm.tensor_parallel_plan.parallelize_llama` splits the LLaMA) moves, per
iteration, beside what FSDP2 × TP AdamW moves too:

* K-FAC's capture (:func:`tensor_parallel_plan`, on factor steps): the whole input of each
  row-wise layer and the whole output gradient of each column-wise layer, one all-gather
  each over the ``tp`` group of ``tokens × width`` elements (the group's tokens: every
  rank of the group reads the same batch); a column-wise layer's input and a row-wise
  layer's output gradient arrive replicated, a row-wise embedding's input is token ids:
  nothing. One rank of the group forms each layer's factors over the group's ``tp`` times
  a rank's rows (:func:`factor_split`, as the layout splits them): the data-parallel
  simulation's factor compute on average, the most loaded rank's excess priced extra.
* K-FAC's gradient reads (every step, every strategy): each registered layer's gradient
  whole on every rank (``full_tensor`` over ``dp`` and ``tp``), an all-gather of its
  elements over the world (over ``dp`` only for a row-wise embedding, whose gradient
  DTensor leaves replicated over ``tp``); the writes keep the rank's shard locally (no
  collective).
* The factor all-reduce, inversions and inverse exchange: as the data-parallel simulation
  prices them at ``P`` ranks (the layout averages the factors over the world).

and what both optimizers move: FSDP2's per-unit all-gathers and reduce-scatters over the
``dp`` group of each rank's ``tp`` shard (:func:`~spdkfac.sim.fsdp.units`), and tensor
parallelism's own activation collectives, four per row-wise layer (Megatron's sequence
parallelism: the forward reduce-scatter of its output into the token-sharded stream and
the all-gather of the stream before the next column-wise group, their transposes in
backward), ``tokens × width`` each, exposed whole (no asynchronous TP).

The batch per rank stays the workload's: a ``dp`` group reads ``tp`` times it and each
rank computes its ``1/tp`` share, so the forward and backward compute per rank is the
data-parallel simulation's and the global batch is unchanged. Activations and gradients
are priced as float32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from spdkfac.planning.factor_split import FactorSplit, gram_cost, plan_factor_split
from spdkfac.sim.collectives import CollectiveOp
from spdkfac.sim.fsdp import (
    FsdpCollective,
    FsdpResult,
    fsdp_result,
    pass_compute_seconds,
    units,
)
from spdkfac.sim.hardware import Hardware
from spdkfac.sim.simulator import StrategyResult
from spdkfac.sim.strategies import STRATEGY_TABLE
from spdkfac.sim.workload import LayerSpec, Workload

__all__ = [
    "COLUMN",
    "EMBEDDING_ROW",
    "ROW",
    "TP_PLANS",
    "TensorParallelPlan",
    "TensorParallelResult",
    "TpLayer",
    "TpSplit",
    "check_tensor_parallel",
    "factor_split",
    "tensor_parallel_plan",
    "tensor_parallel_result",
]

_FLOAT32 = 4.0
#: Tensor parallelism's own collectives per row-wise layer (Megatron's sequence
#: parallelism): its output into the stream, the stream gathered for the next group, and
#: their transposes in backward.
_STREAM = (
    ("out", CollectiveOp.REDUCE_SCATTER),
    ("next in", CollectiveOp.ALL_GATHER),
    ("grad out", CollectiveOp.ALL_GATHER),
    ("grad next in", CollectiveOp.REDUCE_SCATTER),
)


@dataclass(frozen=True)
class TpSplit:
    """How a plan splits one layer.

    Attributes:
        name: ``"column"``, ``"row"`` or ``"embedding-row"``.
        gathers: The factor whose rows the capture all-gathers over ``tp`` (``"A"``: the
            input; ``"G"``: the output gradient; None: both arrive whole).
        stream: Whether its output is reduce-scattered into the token-sharded stream
            (a row-wise layer: tensor parallelism's own four collectives).
        gradient_sharded: Whether its gradient is sharded over ``tp`` (read whole over the
            world); DTensor's row-wise embedding backward leaves it replicated there, so
            its read gathers FSDP2's ``dp`` shards only.
    """

    name: str
    gathers: str | None
    stream: bool
    gradient_sharded: bool = True


COLUMN = TpSplit("column", "G", stream=False)
ROW = TpSplit("row", "A", stream=True)
EMBEDDING_ROW = TpSplit("embedding-row", None, stream=True, gradient_sharded=False)

#: Each model's tensor-parallel plan, by the last part of its layers' names
#: (torchtitan's LLaMA plan, as :func:`~spdkfac.comm.tensor_parallel_plan.parallelize_llama`).
TP_PLANS: Mapping[str, Mapping[str, TpSplit]] = {
    "llama": {
        "tok_embeddings": EMBEDDING_ROW,
        "wq": COLUMN,
        "wk": COLUMN,
        "wv": COLUMN,
        "wo": ROW,
        "w1": COLUMN,
        "w3": COLUMN,
        "w2": ROW,
        "output": COLUMN,
    }
}


@dataclass(frozen=True)
class TpLayer:
    """One registered layer under the plan.

    Attributes:
        name: The layer.
        split: How the plan splits it.
        capture_elements: What the capture all-gathers per factor step (the whole buffer).
        stream_elements: One of tensor parallelism's own collectives of it (0: none).
        gradient_elements: Its parameters' elements (the gradient read whole every step).
    """

    name: str
    split: TpSplit
    capture_elements: int
    stream_elements: int
    gradient_elements: int


@dataclass(frozen=True)
class TensorParallelPlan:
    """What the tensor-parallel layout moves per iteration (module docstring).

    Attributes:
        tp: Ranks per tensor-parallel group.
        layers: Every registered layer, in the workload's order.
        shard_elements: ``(unit, elements)`` each rank holds of every FSDP2 unit.
    """

    tp: int
    layers: tuple[TpLayer, ...]
    shard_elements: tuple[tuple[str, int], ...]

    @property
    def capture_elements(self) -> int:
        """Elements the capture all-gathers per factor step (whole buffers)."""
        return sum(layer.capture_elements for layer in self.layers)

    @property
    def gradient_elements(self) -> int:
        """Elements of the gradients read whole every step."""
        return sum(layer.gradient_elements for layer in self.layers)

    @property
    def tp_read_elements(self) -> int:
        """Elements of the gradients the reads gather over ``tp`` (whole buffers)."""
        return sum(layer.gradient_elements for layer in self.layers if layer.split.gradient_sharded)


def _split(plan: Mapping[str, TpSplit], name: str) -> TpSplit:
    split = plan.get(name.rsplit(".", 1)[-1])
    if split is None:
        raise ValueError(f"layer {name!r} has no place in the tensor-parallel plan")
    return split


def _layer(
    layer: LayerSpec, split: TpSplit, tp: int, numel: Mapping[str, int], stream_tokens: int
) -> TpLayer:
    tokens = tp * layer.rows  # the group's rows: tp times a rank's
    width = {"A": layer.a_dim, "G": layer.g_dim, None: 0}[split.gathers]
    gradient = sum(n for name, n in numel.items() if name.startswith(f"{layer.name}."))
    stream = tp * stream_tokens * layer.g_dim if split.stream else 0
    return TpLayer(layer.name, split, tokens * width, stream, gradient)


def tensor_parallel_plan(workload: Workload, tp: int) -> TensorParallelPlan:
    """What ``workload`` moves split over ``tp`` ranks by its model's plan (pure).

    Raises:
        ValueError: ``tp`` below 1, a model without a plan (naming it) or a layer the plan
            does not place.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an int >= 1, got {tp!r}")
    model = workload.model.lower()  # a sized variant ("llama-134m") takes its family's plan
    plan = TP_PLANS.get(model, TP_PLANS.get(model.partition("-")[0]))
    if plan is None:
        raise ValueError(
            f"model {workload.model!r} has no tensor-parallel plan; models with one: "
            f"{', '.join(TP_PLANS)}"
        )
    numel = dict(workload.parameters)
    # A rank's tokens (batch × sequence): an embedding's rows are not its output's tokens.
    tokens = workload.batch_size * math.prod(workload.input_shape)
    layers = tuple(
        _layer(layer, _split(plan, layer.name), tp, numel, tokens) for layer in workload.layers
    )
    split_names = {f"{layer.name}." for layer in layers}
    shards: dict[str, int] = {}
    for unit, _ in units(workload):
        shards[unit] = 0
    for name, n in workload.parameters:
        unit = name.rsplit(".", 1)[0] if "." in name else ""
        split = any(name.startswith(prefix) for prefix in split_names)
        shards[unit] += -(-n // tp) if split else n  # norms stay whole (replicated)
    return TensorParallelPlan(tp, layers, tuple(shards.items()))


def check_tensor_parallel(workload: Workload, world: int, tp: int | None) -> None:
    """Refuse (``ValueError``) a projection of ``workload`` on ``world`` ranks in groups of
    ``tp`` (None: no projection, nothing to refuse) that :func:`tensor_parallel_plan`
    refuses or whose ``tp`` does not divide ``world``."""
    if tp is None:
        return
    tensor_parallel_plan(workload, tp)
    if world % tp:
        raise ValueError(f"tp_size {tp} does not divide {world} workers")


def _priced(
    hardware: Hardware, group: int, label: str, op: CollectiveOp, elements: float
) -> FsdpCollective:
    nbytes = _FLOAT32 * elements
    seconds = hardware.collective(op, group).predict(nbytes)
    return FsdpCollective(label, op, nbytes, (group - 1) / group * nbytes, seconds, False)


def _pass_collectives(
    plan: TensorParallelPlan, hardware: Hardware, dp: int
) -> tuple[list[FsdpCollective], list[FsdpCollective]]:
    """FSDP2's over ``dp`` (each rank's ``tp`` shard of every unit) and tensor parallelism's
    own over ``tp``: what AdamW moves too."""
    fsdp: list[FsdpCollective] = []
    gather, scatter = CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER
    for unit, elements in plan.shard_elements if dp > 1 else ():
        fsdp.append(_priced(hardware, dp, f"forward all-gather {unit}", gather, elements))
        fsdp.append(_priced(hardware, dp, f"backward all-gather {unit}", gather, elements))
        fsdp.append(_priced(hardware, dp, f"grad reduce-scatter {unit}", scatter, elements))
    stream: list[FsdpCollective] = []
    for layer in plan.layers if plan.tp > 1 else ():
        for what, op in _STREAM if layer.stream_elements else ():
            label = f"tp {op.value} {layer.name} {what}"
            stream.append(_priced(hardware, plan.tp, label, op, layer.stream_elements))
    return fsdp, stream


def _kfac_collectives(
    plan: TensorParallelPlan, hardware: Hardware, world: int
) -> tuple[list[FsdpCollective], list[FsdpCollective]]:
    """K-FAC's capture all-gathers over ``tp`` (per factor step) and its whole-gradient
    reads over the world (every step)."""
    gather = CollectiveOp.ALL_GATHER
    capture = [
        _priced(hardware, plan.tp, f"capture {layer.split.gathers} {layer.name}", gather, n)
        for layer in plan.layers
        if (n := layer.capture_elements) and plan.tp > 1
    ]
    dp = world // plan.tp
    reads = [
        _priced(hardware, group, f"grad read {layer.name}", gather, layer.gradient_elements)
        for layer in plan.layers
        if (group := world if layer.split.gradient_sharded else dp) > 1 and layer.gradient_elements
    ]
    return capture, reads


@dataclass(frozen=True)
class TensorParallelResult:
    """A strategy's iteration under FSDP2 × TP, next to FSDP2 alone (module docstring).

    Attributes:
        fsdp: The same strategy under FSDP2 on all ``P`` ranks.
        plan: What the layout moves.
        collectives: Every priced collective of each step (FSDP2's over dp, TP's own,
            K-FAC's gradient reads).
        capture: K-FAC's capture all-gathers (on factor steps only).
        factor_update_steps: Steps per factor update.
        iteration_s: Projected iteration time.
        pass_exposed_s: FSDP2's pass collectives (over dp) beyond the compute.
        stream_s: Tensor parallelism's own activation collectives (exposed whole).
        capture_s: K-FAC's capture all-gathers, per iteration (over factor steps).
        reads_s: K-FAC's whole-gradient reads.
        factor_extra_s: What the most loaded rank of a group spends forming its layers'
            factors beyond the data-parallel simulation's factor products, per iteration
            (the split's imbalance; 0 with one rank per group).
        split: Which rank of a group forms each layer's factors.
    """

    fsdp: FsdpResult
    plan: TensorParallelPlan
    collectives: tuple[FsdpCollective, ...]
    capture: tuple[FsdpCollective, ...]
    factor_update_steps: int
    iteration_s: float
    pass_exposed_s: float
    stream_s: float
    capture_s: float
    reads_s: float
    factor_extra_s: float
    split: FactorSplit

    @property
    def bytes_per_rank(self) -> float:
        """What each rank sends per iteration (the capture's averaged over factor steps)."""
        captured = sum(collective.bytes_per_rank for collective in self.capture)
        return sum(c.bytes_per_rank for c in self.collectives) + captured / self.factor_update_steps


def factor_split(workload: Workload, tp: int) -> FactorSplit:
    """Which rank of a group of ``tp`` forms each layer's factors: the layout's planner on
    the blocks' Gram costs as the run computes them (an embedding's A is a diagonal)."""
    costs = []
    for layer in workload.layers:
        a_side = (layer.a_dim,) if layer.kind == "embedding" else (layer.a_dim, layer.a_dim)
        statistics = [(a_side, len(a_side) == 2), ((layer.g_dim, layer.g_dim), True)]
        costs.append((layer.name, gram_cost(statistics)))
    return plan_factor_split(costs, tp)


def _factor_extra(workload: Workload, hardware: Hardware, split: FactorSplit) -> float:
    """The most loaded rank's factor products over ``tp`` times a rank's rows, beyond the
    data-parallel simulation's (the average over the group)."""
    seconds = [
        sum(hardware.factor_seconds(workload, layer, kind) for kind in ("A", "G"))
        for layer in workload.layers
    ]
    loads = [0.0] * split.group_size
    for owner, layer_seconds in zip(split.owners, seconds, strict=True):
        loads[owner] += split.group_size * layer_seconds
    return max(0.0, max(loads) - sum(seconds))


def tensor_parallel_result(
    ddp: StrategyResult,
    workload: Workload,
    hardware: Hardware,
    tp: int,
    *,
    factor_update_steps: int = 1,
) -> TensorParallelResult:
    """The data-parallel simulation ``ddp`` (``P`` ranks) of ``workload`` under FSDP2 × TP
    with ``tp`` ranks per group (module docstring): its gradient all-reduce replaced by
    FSDP2's collectives over ``dp = P / tp``, tensor parallelism's own and, with K-FAC,
    the capture (every ``factor_update_steps``), the gradient reads and the factor
    split's imbalance.

    Raises:
        ValueError: ``tp`` does not divide ``P``, a strategy that is no row, or what
            :func:`tensor_parallel_plan` refuses.
    """
    world = ddp.world_size
    check_tensor_parallel(workload, world, tp)
    plan = tensor_parallel_plan(workload, tp)
    row = STRATEGY_TABLE.get(ddp.strategy)
    if row is None:
        raise ValueError(f"FSDP2 x TP projections take a strategy row, not {ddp.strategy!r}")
    fsdp, stream = _pass_collectives(plan, hardware, world // tp)
    capture, reads = _kfac_collectives(plan, hardware, world) if row.uses_kfac else ([], [])
    exposed = 0.0
    if fsdp:
        compute = pass_compute_seconds(workload, hardware, world)
        exposed = fsdp[0].seconds + max(0.0, sum(c.seconds for c in fsdp[1:]) - compute)
    stream_s = sum(c.seconds for c in stream)
    capture_s = sum(c.seconds for c in capture) / factor_update_steps
    reads_s = sum(c.seconds for c in reads)
    split = factor_split(workload, tp)
    extra = _factor_extra(workload, hardware, split) / factor_update_steps if row.uses_kfac else 0.0
    iteration = (
        ddp.iteration_s - ddp.breakdown["GradComm"] + exposed + stream_s + capture_s + reads_s
    ) + extra
    return TensorParallelResult(
        fsdp_result(ddp, workload, hardware),
        plan,
        (*fsdp, *stream, *reads),
        tuple(capture),
        factor_update_steps,
        iteration,
        exposed,
        stream_s,
        capture_s,
        reads_s,
        extra,
        split,
    )
