"""Fusion planners: which factors travel together in one all-reduce, and when it starts.

A plan is an ordered tuple of buckets; each bucket is a run of consecutive factor slots in
hook order (A factors in forward order, then G factors in backward order). Every rank
launches buckets strictly in plan order, so the collectives are identical on every rank
even when hooks fire in a different order. Planners are pure functions of replicated
inputs (slot order, sizes, measured ready times shared from rank 0, α-β model).

The ``optimal`` planner is SPD-KFAC's dynamic tensor fusion (Eq. 15 as the authors
implemented it, ALGORITHMS.md §2): walking the slots in readiness order, slot l is merged
into the bucket of slot l+1 when l+1 becomes ready before l's all-reduce would finish
*and* waiting for it costs less than the start-up time a merge saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spdkfac.costmodel import AlphaBetaModel

__all__ = [
    "FACTOR_EXCHANGES",
    "FusionPlan",
    "communication_starts",
    "merge_groups",
    "plan_after_backward",
    "plan_layerwise",
    "plan_optimal",
    "plan_threshold",
]

FACTOR_EXCHANGES: tuple[str, ...] = ("after-backward", "layerwise", "threshold", "optimal")


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
    sizes: dict[str, int],
    bucket_cap_elements: int,
) -> FusionPlan:
    """D-KFAC's exchange: everything at ``step()``, in buckets of at most the cap."""
    plan = plan_threshold(a_order, g_order, sizes, bucket_cap_elements)
    return FusionPlan("after-backward", plan.buckets, eager=False)


def plan_layerwise(a_order: Sequence[str], g_order: Sequence[str]) -> FusionPlan:
    """One all-reduce per factor, launched as soon as the factor is ready (no fusion)."""
    _check_order(a_order, g_order)
    return FusionPlan("layerwise", tuple((key,) for key in [*a_order, *g_order]), eager=True)


def _fill(order: Sequence[str], sizes: dict[str, int], cap: int) -> list[tuple[str, ...]]:
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
    sizes: dict[str, int],
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


def communication_starts(ready: Sequence[float], durations: Sequence[float]) -> list[float]:
    """τ_c: τ_c(1) = r_1, τ_c(l) = max(τ_c(l−1) + t_c(l−1), r_l) (one channel, in order)."""
    starts: list[float] = []
    for index, ready_at in enumerate(ready):
        if index == 0:
            starts.append(ready_at)
        else:
            starts.append(max(starts[-1] + durations[index - 1], ready_at))
    return starts


def merge_groups(
    order: Sequence[str],
    sizes: dict[str, int],
    ready: Sequence[float],
    model: AlphaBetaModel,
    bytes_per_element: int = 4,
) -> list[tuple[str, ...]]:
    """Eq. 15's greedy single pass over one stream (A in forward or G in backward order).

    Args:
        order: Slot keys in the order they become ready.
        sizes: Elements per slot (packed triangles).
        ready: Ready time r_l of each slot (seconds, any common origin).
        model: All-reduce cost ``α + β·bytes``.
        bytes_per_element: Bytes of one communicated element.

    Returns:
        Contiguous groups of slot keys.
    """
    if len(order) != len(ready):
        raise ValueError("order and ready must have the same length")
    if not order:
        return []
    alpha = model.alpha
    elements = [sizes[key] for key in order]

    def cost(count: int) -> float:
        return model.predict(count * bytes_per_element) if count else 0.0

    durations = [cost(count) for count in elements]
    starts = communication_starts(ready, durations)
    groups: list[tuple[str, ...]] = []
    current: list[str] = []
    for index in range(len(order) - 1):
        current.append(order[index])
        ready_next = ready[index + 1]
        finish = starts[index] + durations[index]
        if ready_next < finish and (
            starts[index] > ready_next or ready_next - starts[index] < alpha
        ):
            # Merge: slot index travels with slot index+1 (its own start-up is saved).
            elements[index + 1] += elements[index]
            elements[index] = 0
            durations[index] = 0.0
            durations[index + 1] = cost(elements[index + 1])
            starts = communication_starts(ready, durations)
        else:
            groups.append(tuple(current))
            current = []
    current.append(order[-1])
    groups.append(tuple(current))
    return groups


def plan_optimal(
    a_order: Sequence[str],
    g_order: Sequence[str],
    sizes: dict[str, int],
    a_ready: Sequence[float],
    g_ready: Sequence[float],
    model: AlphaBetaModel,
    bytes_per_element: int = 4,
) -> FusionPlan:
    """SPD-KFAC's dynamic tensor fusion: Eq. 15 on A (forward order) and G (backward order).

    ``a_ready`` / ``g_ready`` are the measured times each factor is handed to the exchange
    (forward and backward respectively; rank 0's, shared so every rank plans alike).
    """
    _check_order(a_order, g_order)
    buckets = merge_groups(a_order, sizes, a_ready, model, bytes_per_element) + merge_groups(
        g_order, sizes, g_ready, model, bytes_per_element
    )
    return FusionPlan("optimal", tuple(buckets), eager=True)
