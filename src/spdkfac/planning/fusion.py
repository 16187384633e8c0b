"""Fusion planners: which factors travel together in one all-reduce, and when it starts.

A plan is an ordered tuple of buckets; each bucket is a run of consecutive factor slots in
hook order (A factors in forward order, then G factors in backward order). Every rank
launches buckets strictly in plan order, so the collectives are identical on every rank
even when hooks fire in a different order. Planners are pure functions of replicated
inputs (slot order, sizes, measured ready times shared from rank 0, α-β model); each
policy object (:data:`FUSION_POLICIES`) wraps one planner behind ``plan(FusionInputs)``.

The ``optimal`` planner is SPD-KFAC's dynamic tensor fusion (Shi, Zhang, Li 2021, Eq. 15,
as the authors implemented it): walking the slots in readiness order, slot l is merged
into the bucket of slot l+1 when l+1 becomes ready before l's all-reduce would finish
*and* waiting for it costs less than the start-up time a merge saves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol, TypedDict

from spdkfac.costmodel import AlphaBetaModel
from spdkfac.planning.merge import Busy, communication_starts, merge_dp, merge_groups

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "FACTOR_EXCHANGES",
    "FUSION_POLICIES",
    "AfterBackward",
    "AroundGradients",
    "DPFusion",
    "FusionInputs",
    "FusionPlan",
    "FusionPolicy",
    "Layerwise",
    "OptimalFusion",
    "StreamMerge",
    "ThresholdFusion",
    "communication_starts",
    "merge_dp",
    "merge_groups",
    "plan_after_backward",
    "plan_dp",
    "plan_layerwise",
    "plan_optimal",
    "plan_threshold",
]


@dataclass(frozen=True)
class FusionPlan:
    """Buckets of factor slots, in launch order.

    Attributes:
        policy: Name of the planner that made it.
        buckets: Slot keys per bucket; every slot appears in exactly one bucket.
        eager: Launch a bucket as soon as it is complete (pipelined); False waits for
            ``step()`` (after-backward).
    """

    policy: str
    buckets: tuple[tuple[str, ...], ...]
    eager: bool

    def __post_init__(self) -> None:
        keys = [key for bucket in self.buckets for key in bucket]
        if len(set(keys)) != len(keys):
            raise ValueError("every factor slot must be in exactly one bucket")
        if any(not bucket for bucket in self.buckets):
            raise ValueError("buckets must not be empty")

    @property
    def slots(self) -> tuple[str, ...]:
        """Every slot, in launch order."""
        return tuple(key for bucket in self.buckets for key in bucket)


def _check_order(a_order: Sequence[str], g_order: Sequence[str]) -> None:
    if len(set(a_order) | set(g_order)) != len(a_order) + len(g_order):
        raise ValueError("factor slot keys must be unique")


def plan_after_backward(
    a_order: Sequence[str],
    g_order: Sequence[str],
    sizes: Mapping[str, int],
    bucket_cap_elements: int,
) -> FusionPlan:
    """D-KFAC's exchange: everything at ``step()``, in buckets of at most the cap."""
    plan = plan_threshold(a_order, g_order, sizes, bucket_cap_elements)
    return FusionPlan("after-backward", plan.buckets, eager=False)


def plan_layerwise(a_order: Sequence[str], g_order: Sequence[str]) -> FusionPlan:
    """One all-reduce per factor, launched as soon as the factor is ready (no fusion)."""
    _check_order(a_order, g_order)
    return FusionPlan("layerwise", tuple((key,) for key in [*a_order, *g_order]), eager=True)


def _fill(order: Sequence[str], sizes: Mapping[str, int], cap: int) -> list[tuple[str, ...]]:
    buckets: list[list[str]] = []
    total = 0
    for key in order:
        if not buckets or (total and total + sizes[key] > cap):
            buckets.append([])
            total = 0
        buckets[-1].append(key)
        total += sizes[key]
    return [tuple(bucket) for bucket in buckets]


def plan_threshold(
    a_order: Sequence[str],
    g_order: Sequence[str],
    sizes: Mapping[str, int],
    bucket_cap_elements: int,
) -> FusionPlan:
    """Horovod-style fusion: consecutive factors until the bucket cap; A and G apart."""
    _check_order(a_order, g_order)
    if bucket_cap_elements < 1:
        raise ValueError(f"bucket cap must be >= 1 element, got {bucket_cap_elements}")
    buckets = _fill(a_order, sizes, bucket_cap_elements) + _fill(
        g_order, sizes, bucket_cap_elements
    )
    return FusionPlan("threshold", tuple(buckets), eager=True)


#: A merge rule bound to one plan's sizes and link: one stream's slots (in stream order)
#: and their ready times to its buckets.
StreamMerge = Callable[[Sequence[str], Sequence[float]], list[tuple[str, ...]]]


def _plan_merged(
    policy: str,
    merge: StreamMerge,
    a_order: Sequence[str],
    g_order: Sequence[str],
    a_ready: Sequence[float],
    g_ready: Sequence[float],
) -> FusionPlan:
    """``merge`` on A (forward order) and G (backward order), buckets launched eagerly."""
    _check_order(a_order, g_order)
    buckets = merge(a_order, a_ready) + merge(g_order, g_ready)
    return FusionPlan(policy, tuple(buckets), eager=True)


def plan_optimal(
    a_order: Sequence[str],
    g_order: Sequence[str],
    sizes: Mapping[str, int],
    a_ready: Sequence[float],
    g_ready: Sequence[float],
    model: AlphaBetaModel,
    bytes_per_element: int = 4,
) -> FusionPlan:
    """SPD-KFAC's dynamic tensor fusion: Eq. 15 on A (forward order) and G (backward order).

    ``a_ready`` / ``g_ready`` are the measured times each factor is handed to the exchange
    (forward and backward respectively; rank 0's, shared so every rank plans alike).
    """

    def merge(order: Sequence[str], ready: Sequence[float]) -> list[tuple[str, ...]]:
        return merge_groups(order, sizes, ready, model, bytes_per_element)

    return _plan_merged("optimal", merge, a_order, g_order, a_ready, g_ready)


class AroundGradients(TypedDict, total=False):
    """The gradient chunks of a priority schedule, which :func:`plan_dp` plans around.

    Attributes:
        busy: Link intervals those chunks hold, on the clock of the ready times (empty:
            none).
        chunk_elements: Elements per chunk of that schedule (None: calls are not cut).
    """

    busy: Busy
    chunk_elements: int | None


def plan_dp(
    a_order: Sequence[str],
    g_order: Sequence[str],
    sizes: Mapping[str, int],
    a_ready: Sequence[float],
    g_ready: Sequence[float],
    model: AlphaBetaModel,
    bytes_per_element: int = 4,
    **around: Unpack[AroundGradients],
) -> FusionPlan:
    """:func:`~spdkfac.planning.merge.merge_dp` on A and G, like ``optimal``; around the
    gradient chunks of a priority schedule when ``busy`` holds them (``a_ready``,
    ``g_ready`` and ``busy`` then share one clock)."""

    def merge(order: Sequence[str], ready: Sequence[float]) -> list[tuple[str, ...]]:
        return merge_dp(order, sizes, ready, model, bytes_per_element, **around)

    return _plan_merged("dp", merge, a_order, g_order, a_ready, g_ready)


@dataclass(frozen=True)
class FusionInputs:
    """What a fusion policy plans from; every field is replicated on every rank.

    Attributes:
        a_order: Forward-time slots (A factors) in forward order.
        g_order: Backward-time slots (G factors) in backward order.
        sizes: Elements per slot (packed triangles).
        bucket_cap_elements: Bucket cap of the threshold-style policies.
        allreduce: All-reduce cost ``α + β·bytes`` (the ``optimal`` policy's oracle).
        bytes_per_element: Bytes of one communicated element.
        a_ready: Measured hand-over time of each A slot in ``a_order`` (rank 0's, shared),
            or None before any measurement; likewise ``g_ready`` for ``g_order``. Seconds
            from the pass's first hand-over.
        busy: Link intervals held by more urgent traffic on the same clock: the gradient
            chunks a priority schedule sends first (``comm_scheduler="priority"``; empty
            otherwise). Policies with ``around_gradients`` plan around them.
        chunk_elements: Elements per chunk of that schedule (None: calls are not cut).
    """

    a_order: tuple[str, ...]
    g_order: tuple[str, ...]
    sizes: Mapping[str, int]
    bucket_cap_elements: int
    allreduce: AlphaBetaModel
    bytes_per_element: int = 4
    a_ready: tuple[float, ...] | None = None
    g_ready: tuple[float, ...] | None = None
    busy: tuple[tuple[float, float], ...] = ()
    chunk_elements: int | None = None


class FusionPolicy(Protocol):
    """When and how factors are all-reduced: one ``plan`` from replicated inputs.

    Attributes:
        name: The name ``factor_exchange=`` takes.
        eager: Buckets launch from hooks (so they need a process group of their own to
            never interleave with DDP's gradient all-reduces).
        measured: The plan needs measured hand-over times (``inputs.a_ready``); until the
            first measurements the policy plans without them.
        around_gradients: The plan uses ``inputs.busy`` (the gradient chunks of a priority
            schedule), so the preconditioner measures them before planning.
    """

    @property
    def name(self) -> str: ...

    @property
    def eager(self) -> bool: ...

    @property
    def measured(self) -> bool: ...

    @property
    def around_gradients(self) -> bool: ...

    def plan(self, inputs: FusionInputs) -> FusionPlan:
        """The buckets for ``inputs``."""
        ...


@dataclass(frozen=True)
class AfterBackward:
    """D-KFAC: every factor all-reduced at ``step()``, in buckets of at most the cap."""

    name: str = "after-backward"
    eager: bool = False
    measured: bool = False
    around_gradients: bool = False

    def plan(self, inputs: FusionInputs) -> FusionPlan:
        return plan_after_backward(
            inputs.a_order, inputs.g_order, inputs.sizes, inputs.bucket_cap_elements
        )


@dataclass(frozen=True)
class Layerwise:
    """One all-reduce per factor as soon as its hook computed it (no fusion)."""

    name: str = "layerwise"
    eager: bool = True
    measured: bool = False
    around_gradients: bool = False

    def plan(self, inputs: FusionInputs) -> FusionPlan:
        return plan_layerwise(inputs.a_order, inputs.g_order)


@dataclass(frozen=True)
class ThresholdFusion:
    """Horovod-style: consecutive factors fused up to the cap, each bucket launched when full."""

    name: str = "threshold"
    eager: bool = True
    measured: bool = False
    around_gradients: bool = False

    def plan(self, inputs: FusionInputs) -> FusionPlan:
        return plan_threshold(
            inputs.a_order, inputs.g_order, inputs.sizes, inputs.bucket_cap_elements
        )


def _measured_plan(
    inputs: FusionInputs, planner: Callable[..., FusionPlan], **around: Unpack[AroundGradients]
) -> FusionPlan:
    """``planner`` on the measured hand-over times; :class:`ThresholdFusion`'s plan until
    there are some (what the preconditioner runs during the warm-up factor steps)."""
    if inputs.a_ready is None or inputs.g_ready is None:
        return ThresholdFusion().plan(inputs)
    return planner(
        inputs.a_order,
        inputs.g_order,
        inputs.sizes,
        inputs.a_ready,
        inputs.g_ready,
        inputs.allreduce,
        inputs.bytes_per_element,
        **around,
    )


@dataclass(frozen=True)
class OptimalFusion:
    """SPD-KFAC's dynamic tensor fusion (Shi, Zhang, Li 2021, the merge rule of Eq. 15),
    planned as :class:`ThresholdFusion` until hand-over times are measured."""

    name: str = "optimal"
    eager: bool = True
    measured: bool = True
    around_gradients: bool = False

    def plan(self, inputs: FusionInputs) -> FusionPlan:
        return _measured_plan(inputs, plan_optimal)


@dataclass(frozen=True)
class DPFusion:
    """The exact merge of :func:`~spdkfac.planning.merge.merge_dp` (PACE's dynamic program on
    Eq. 15's timeline, or on the priority schedule's when ``inputs.busy`` holds its
    gradient chunks); planned as :class:`ThresholdFusion` until hand-over times are
    measured."""

    name: str = "dp"
    eager: bool = True
    measured: bool = True
    around_gradients: bool = True

    def plan(self, inputs: FusionInputs) -> FusionPlan:
        return _measured_plan(
            inputs, plan_dp, busy=inputs.busy, chunk_elements=inputs.chunk_elements
        )


#: Every fusion policy by the name ``factor_exchange=`` takes.
FUSION_POLICIES: Mapping[str, FusionPolicy] = MappingProxyType(
    {
        policy.name: policy
        for policy in (
            AfterBackward(),
            Layerwise(),
            ThresholdFusion(),
            OptimalFusion(),
            DPFusion(),
        )
    }
)
FACTOR_EXCHANGES: tuple[str, ...] = tuple(FUSION_POLICIES)
