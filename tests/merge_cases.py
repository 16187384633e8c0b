"""Random factor streams and every way to split them, for the merge rules' exhaustive checks.

Used by ``tests/planning/test_fusion.py`` and ``tests/planning/test_merge_priority.py``;
also a fusion policy that records what it is asked to plan.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from spdkfac.planning.fusion import FusionInputs, FusionPlan, FusionPolicy

__all__ = ["PolicySpy", "all_splits", "random_stream"]


@dataclass(frozen=True, eq=False)
class PolicySpy:
    """A measured policy planning around gradients that keeps every input it is given and
    plans as ``delegate``."""

    delegate: FusionPolicy
    seen: list[FusionInputs] = field(default_factory=list)
    name: str = "spy"
    eager: bool = True
    measured: bool = True
    around_gradients: bool = True

    def plan(self, inputs: FusionInputs) -> FusionPlan:
        self.seen.append(inputs)
        return self.delegate.plan(inputs)


def random_stream(seed: int, count: int) -> tuple[list[str], dict[str, int], list[float]]:
    """``count`` slots: keys in order, elements each, sorted ready times (seconds)."""
    rng = random.Random(seed)
    order = [f"s{i}" for i in range(count)]
    sizes = {key: rng.choice([10, 100, 1_000, 50_000, 400_000]) for key in order}
    ready = sorted(rng.uniform(0.0, 0.02) for _ in order)
    return order, sizes, ready


def all_splits(order: list[str]) -> list[list[tuple[str, ...]]]:
    """Every split of ``order`` into contiguous groups."""
    splits = []
    for mask in range(2 ** (len(order) - 1)):
        groups, current = [], [order[0]]
        for index, key in enumerate(order[1:]):
            if mask >> index & 1:
                groups.append(tuple(current))
                current = []
            current.append(key)
        splits.append([*groups, tuple(current)])
    return splits
