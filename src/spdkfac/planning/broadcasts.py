"""Broadcast grouping of communicated inverses, and the policy that sizes the groups.

SPD-KFAC (Shi, Zhang, Li 2021, Sec. 4.2) broadcasts each communicated inverse on its own.
:class:`FusedBroadcasts` packs an owner's consecutive results into one broadcast until its
bandwidth time outweighs the start-up time (the cost model's
:meth:`~spdkfac.costmodel.CostModel.broadcast_group_elements`), which saves per-message
start-up time when it dominates. Both are pure functions of the plan and of which factors
exist, replicated on every rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from spdkfac.costmodel import CostModel
from spdkfac.linalg import packed_size
from spdkfac.planning.placement import EVERY_RANK, Plan

__all__ = [
    "BROADCAST_POLICIES",
    "BroadcastGroup",
    "BroadcastPolicy",
    "FusedBroadcasts",
    "PerFactorBroadcasts",
    "broadcast_groups",
]


@dataclass(frozen=True)
class BroadcastGroup:
    """Results one owner sends in a single broadcast, concatenated in their wire format
    (packed triangles for damped inverses)."""

    owner: int
    keys: tuple[str, ...]
    dims: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def elements(self) -> int:
        """Length of the concatenated buffer."""
        return sum(self.sizes)


def broadcast_groups(
    plan: Plan,
    available: Mapping[str, object],
    min_group_elements: int = 0,
    wire_size: Callable[[int], int] = packed_size,
) -> list[BroadcastGroup]:
    """Communicated factors grouped into broadcasts, in the order every rank issues them.

    Each owner's factors are taken in plan order and packed into groups of at least
    ``min_group_elements`` elements (0: one broadcast per factor, as in the SPD-KFAC paper;
    larger values save per-message start-up time when it dominates). Owners' groups are
    interleaved (first group of every rank, then second, …) so all ranks start computing
    at once and each broadcast is issued as soon as its owner can have it ready. Depends
    only on the plan and on which factors exist, both replicated on every rank.
    ``wire_size`` gives a result's elements from its factor's side (the inverse form's).
    """
    per_owner: list[list[BroadcastGroup]] = [[] for _ in range(plan.world_size)]
    open_groups: list[list[tuple[str, int, int]]] = [[] for _ in range(plan.world_size)]
    for spec, owner in zip(plan.factors, plan.owners, strict=True):
        if owner == EVERY_RANK or spec.key not in available:
            continue
        members = open_groups[owner]
        members.append((spec.key, spec.dim, wire_size(spec.dim)))
        if sum(size for _, _, size in members) >= min_group_elements:
            per_owner[owner].append(_close(owner, members))
            open_groups[owner] = []
    for owner, members in enumerate(open_groups):
        if members:
            per_owner[owner].append(_close(owner, members))
    order: list[BroadcastGroup] = []
    for position in range(max((len(groups) for groups in per_owner), default=0)):
        order.extend(groups[position] for groups in per_owner if position < len(groups))
    return order


def _close(owner: int, members: list[tuple[str, int, int]]) -> BroadcastGroup:
    keys, dims, sizes = zip(*members, strict=True)
    return BroadcastGroup(owner, keys, dims, sizes)


class BroadcastPolicy(ABC):
    """How communicated inverses are grouped into broadcasts (a strategy axis)."""

    name: str

    @abstractmethod
    def min_group_elements(self, costs: CostModel) -> int:
        """Fewest elements a broadcast carries before it is closed (0: one per factor)."""

    def groups(
        self,
        plan: Plan,
        available: Mapping[str, object],
        costs: CostModel,
        wire_size: Callable[[int], int] = packed_size,
    ) -> list[BroadcastGroup]:
        """The broadcasts of ``plan`` in issue order (:func:`broadcast_groups`)."""
        return broadcast_groups(plan, available, self.min_group_elements(costs), wire_size)


@dataclass(frozen=True)
class PerFactorBroadcasts(BroadcastPolicy):
    """One broadcast per communicated factor (the SPD-KFAC paper)."""

    name: str = "per-factor"

    def min_group_elements(self, costs: CostModel) -> int:
        return 0


@dataclass(frozen=True)
class FusedBroadcasts(BroadcastPolicy):
    """An owner's consecutive results packed until bandwidth outweighs start-up time."""

    name: str = "fused"

    def min_group_elements(self, costs: CostModel) -> int:
        return costs.broadcast_group_elements()


#: Broadcast policy by name.
BROADCAST_POLICIES: Mapping[str, BroadcastPolicy] = MappingProxyType(
    {policy.name: policy for policy in (PerFactorBroadcasts(), FusedBroadcasts())}
)
