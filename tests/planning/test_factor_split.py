"""The factor split of a tensor-parallel group: a pure planner, checked without processes."""

from __future__ import annotations

import random

import pytest

from spdkfac.planning.factor_split import (
    FactorShare,
    FactorSplit,
    gram_cost,
    plan_factor_split,
)


def _random_blocks(rng: random.Random, count: int) -> list[tuple[str, float]]:
    return [
        (f"layer{i}", float(rng.randint(1, 512) ** 2 + rng.randint(1, 512) ** 2))
        for i in range(count)
    ]


def test_every_block_has_exactly_one_owner_and_the_loads_are_balanced() -> None:
    rng = random.Random(0)
    for _ in range(200):
        group = rng.randint(1, 8)
        blocks = _random_blocks(rng, rng.randint(0, 40))
        split = plan_factor_split(blocks, group)
        names = [name for name, _ in blocks]
        assert split.blocks == tuple(names)
        owned = [split.blocks_of(rank) for rank in range(group)]
        assert sorted(name for part in owned for name in part) == sorted(names)
        for name in names:
            assert [name in part for part in owned].count(True) == 1
        loads = split.loads()
        assert sum(loads) == pytest.approx(sum(cost for _, cost in blocks))
        largest = max((cost for _, cost in blocks), default=0.0)
        assert max(loads) <= min(loads) + largest


def test_greedy_largest_first_onto_the_least_loaded_rank() -> None:
    """Ties: the earlier block first, onto the lower rank."""
    blocks = [("a", 1.0), ("b", 5.0), ("c", 3.0), ("d", 3.0), ("e", 2.0)]
    # b→0 (5), c→1 (3), d→1 (6), e→0 (7), a→1 (7)
    assert plan_factor_split(blocks, 2).owners == (1, 0, 1, 1, 0)
    assert plan_factor_split(blocks, 1).owners == (0,) * 5
    # More ranks than blocks: the largest ones alone, ranks left empty.
    split = plan_factor_split(blocks[:2], 4)
    assert split.owners == (1, 0) and split.loads() == (5.0, 1.0, 0.0, 0.0)


def test_deterministic_and_pure() -> None:
    rng = random.Random(1)
    blocks = _random_blocks(rng, 25)
    kept = list(blocks)
    first = plan_factor_split(blocks, 4)
    assert blocks == kept  # the input is not touched
    assert plan_factor_split(list(blocks), 4) == first
    assert plan_factor_split(tuple(blocks), 4) == first
    with pytest.raises(AttributeError):
        first.owners = ()  # type: ignore[misc]


def test_gram_cost_is_d_in_squared_plus_d_out_squared() -> None:
    assert gram_cost([((9, 9), True), ((8, 8), True)]) == 81 + 64
    # A diagonal A (an embedding's counts) and a per-channel statistic: their elements.
    assert gram_cost([((100,), False), ((8, 8), True)]) == 100 + 64
    assert gram_cost([((8, 3), False)]) == 24


def test_shares() -> None:
    split = plan_factor_split([("a", 1.0), ("b", 5.0), ("c", 3.0)], 2)
    # b→0 (5), c→1 (3), a→1 (4)
    assert [FactorShare(split, 0).computes(name) for name in "abc"] == [False, True, False]
    assert [FactorShare(split, 1).computes(name) for name in "abc"] == [True, False, True]
    whole = FactorShare.whole([("a", 1.0), ("b", 5.0)])
    assert whole.split.group_size == 1 and whole.computes("a") and whole.computes("b")
    assert "greedy largest first" in split.describe() and "none" in whole.split.describe()


def test_refusals() -> None:
    with pytest.raises(ValueError, match="group_size must be an int >= 1, got 0"):
        plan_factor_split([("a", 1.0)], 0)
    with pytest.raises(ValueError, match="group_size must be an int >= 1, got True"):
        plan_factor_split([("a", 1.0)], True)
    with pytest.raises(ValueError, match="cost of block 'a' must be finite and >= 0"):
        plan_factor_split([("a", float("nan"))], 2)
    with pytest.raises(ValueError, match="cost of block 'a' must be finite and >= 0"):
        plan_factor_split([("a", -1.0)], 2)
    with pytest.raises(ValueError, match="exactly once"):
        plan_factor_split([("a", 1.0), ("a", 2.0)], 2)
    with pytest.raises(ValueError, match=r"owner of 'a' must be in \[0, 2\)"):
        FactorSplit(2, ("a",), (1.0,), (2,))
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        FactorShare(plan_factor_split([("a", 1.0)], 2), 2)
