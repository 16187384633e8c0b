"""Pure planner of which rank computes each block's factor statistics within a group of
ranks that read the same batch (a tensor-parallel group: its ranks capture the same
whole inputs and output gradients, so one of them forming a block's statistics is
enough).

:func:`plan_factor_split` assigns every block to exactly one rank of the group, greedy
largest first by the block's Gram cost (:func:`gram_cost`: ``d_in² + d_out²`` for a
Kronecker block), each to the least loaded rank (ties: the lower rank). It is a function of
replicated inputs only (the blocks in registration order, the group size), so every rank
builds the same :class:`FactorSplit` without communicating. The ranks that do not compute a
block send zeros with weight 0 to the factor exchange, which divides by the summed
weights: the average comes out the same as when every rank of the group computed it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FactorShare", "FactorSplit", "gram_cost", "plan_factor_split"]


def gram_cost(statistics: Sequence[tuple[tuple[int, ...], bool]]) -> float:
    """The relative cost of forming a block's statistics from the same rows, from each
    statistic's ``(shape, symmetric)``: ``d²`` per symmetric ``[d, d]`` one (a Gram
    product), its elements per other one (a diagonal or a per-channel statistic)."""
    cost = 0.0
    for shape, square in statistics:
        elements = 1
        for side in shape:
            elements *= side
        cost += float(shape[0] * shape[0] if square else elements)
    return cost


@dataclass(frozen=True)
class FactorSplit:
    """Which rank of each group computes each block's factor statistics. Build with
    :func:`plan_factor_split`; validated on construction.

    Attributes:
        group_size: Ranks per group that read the same batch (1: every rank computes
            every block, as without tensor parallelism).
        blocks: The blocks' names, in the order given to the planner.
        costs: Each block's Gram cost (:func:`gram_cost`), aligned with ``blocks``.
        owners: The rank within the group computing each block, aligned with ``blocks``.
    """

    group_size: int
    blocks: tuple[str, ...]
    costs: tuple[float, ...]
    owners: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if not len(self.blocks) == len(self.costs) == len(self.owners):
            raise ValueError("blocks, costs and owners must align")
        if len(set(self.blocks)) != len(self.blocks):
            raise ValueError("every block must appear exactly once in a factor split")
        for name, owner in zip(self.blocks, self.owners, strict=True):
            if not 0 <= owner < self.group_size:
                raise ValueError(
                    f"owner of {name!r} must be in [0, {self.group_size}), got {owner}"
                )

    def owner(self, block: str) -> int:
        """The rank within the group computing ``block``'s statistics."""
        return self.owners[self.blocks.index(block)]

    def blocks_of(self, rank: int) -> frozenset[str]:
        """The blocks whose statistics rank ``rank`` of the group computes."""
        pairs = zip(self.blocks, self.owners, strict=True)
        return frozenset(block for block, owner in pairs if owner == rank)

    def loads(self) -> tuple[float, ...]:
        """Summed Gram cost per rank of the group."""
        loads = [0.0] * self.group_size
        for cost, owner in zip(self.costs, self.owners, strict=True):
            loads[owner] += cost
        return tuple(loads)

    def describe(self) -> str:
        """A short human-readable summary: why each rank computes what it does."""
        if self.group_size == 1:
            return f"factor split: none, every rank computes all {len(self.blocks)} blocks"
        total = sum(self.costs) or 1.0
        shares = ", ".join(f"{100 * load / total:.0f}%" for load in self.loads())
        return (
            f"factor split over groups of {self.group_size}: {len(self.blocks)} blocks, "
            f"greedy largest first by d_in² + d_out², per-rank share of the Gram cost "
            f"[{shares}]"
        )


@dataclass(frozen=True)
class FactorShare:
    """One rank's part of a :class:`FactorSplit`.

    Attributes:
        split: The group's split (the same on every rank).
        rank: This rank's index within its group.
    """

    split: FactorSplit
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.split.group_size:
            raise ValueError(f"rank must be in [0, {self.split.group_size}), got {self.rank}")

    @classmethod
    def whole(cls, blocks: Sequence[tuple[str, float]]) -> FactorShare:
        """Every block computed here: a rank that shares its batch with no other."""
        return cls(plan_factor_split(blocks, 1), 0)

    def computes(self, block: str) -> bool:
        """Whether this rank forms ``block``'s statistics (others send zeros, weight 0)."""
        return self.split.owner(block) == self.rank


def plan_factor_split(blocks: Sequence[tuple[str, float]], group_size: int) -> FactorSplit:
    """Give each block to one rank of a group of ``group_size`` (module docstring).

    Greedy largest first (ties: registration order) onto the least loaded rank (ties: the
    lower rank), so the most loaded rank carries at most the least loaded one's load plus
    the largest block's cost.

    Args:
        blocks: ``(name, cost)`` per block, in the same order on every rank.
        group_size: Ranks per group that read the same batch.

    Raises:
        ValueError: ``group_size`` below 1, a negative or non-finite cost, a repeated name.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    for name, cost in blocks:
        if not 0.0 <= cost < float("inf"):
            raise ValueError(f"cost of block {name!r} must be finite and >= 0, got {cost}")
    owners = [0] * len(blocks)
    loads = [(0.0, rank) for rank in range(group_size)]
    for index in sorted(range(len(blocks)), key=lambda i: (-blocks[i][1], i)):
        load, rank = heapq.heappop(loads)
        owners[index] = rank
        heapq.heappush(loads, (load + blocks[index][1], rank))
    return FactorSplit(
        group_size,
        tuple(name for name, _ in blocks),
        tuple(float(cost) for _, cost in blocks),
        tuple(owners),
    )
