"""Fusion planners on synthetic timelines (no processes)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from merge_cases import all_splits, random_stream
from spdkfac.costmodel import AlphaBetaModel
from spdkfac.planning.fusion import (
    FusionPlan,
    communication_starts,
    merge_groups,
    plan_after_backward,
    plan_layerwise,
    plan_optimal,
    plan_threshold,
)

KEYS = [f"l{i}" for i in range(6)]


def _contiguous(groups: list[tuple[str, ...]], order: list[str]) -> bool:
    flat = [key for group in groups for key in group]
    return flat == order


def test_compute_far_longer_than_communication_means_no_merges() -> None:
    sizes = dict.fromkeys(KEYS, 100)
    ready = [float(i) for i in range(len(KEYS))]  # one second apart
    model = AlphaBetaModel(alpha=1e-3, beta=1e-9)  # about a millisecond each
    assert merge_groups(KEYS, sizes, ready, model) == [(k,) for k in KEYS]


def test_startup_dominated_tiny_factors_are_merged() -> None:
    sizes = dict.fromkeys(KEYS, 10)
    ready = [i * 1e-6 for i in range(len(KEYS))]  # a microsecond apart
    model = AlphaBetaModel(alpha=1e-3, beta=1e-9)
    assert merge_groups(KEYS, sizes, ready, model) == [tuple(KEYS)]


def test_communication_start_recurrence() -> None:
    # τ_c(1) = r_1; τ_c(l) = max(τ_c(l−1) + t_c(l−1), r_l)
    assert communication_starts([0.0, 0.5, 3.0, 3.2], [1.0, 1.0, 1.0, 1.0]) == [0.0, 1.0, 3.0, 4.0]


def test_worked_example() -> None:
    # α = 1, β = 0 (every all-reduce costs 1 s), ready at 0, 0.5 and 3 s.
    # l=0: slot 1 is ready at 0.5 < 0 + 1 (before slot 0 would finish) and waits
    #      0.5 - 0 < α -> merge; the merged all-reduce starts at 0.5 and ends at 1.5.
    # l=1: slot 2 is ready at 3 >= 1.5 -> close the group.
    model = AlphaBetaModel(alpha=1.0, beta=0.0)
    groups = merge_groups(["a", "b", "c"], dict.fromkeys("abc", 1), [0.0, 0.5, 3.0], model)
    assert groups == [("a", "b"), ("c",)]
    # Slot 1 ready at 0.9 but it would wait 0.9 >= α·0.8: no merge when α = 0.8.
    groups = merge_groups(["a", "b"], dict.fromkeys("ab", 1), [0.0, 0.9], AlphaBetaModel(0.8, 0.0))
    assert groups == [("a",), ("b",)]
    # A busy channel: slot 1 is ready while slot 0 is still queued behind earlier work.
    assert communication_starts([0.0, 0.2, 0.3], [1.0, 0.0, 1.0])[2] == 1.0


@pytest.mark.parametrize("seed", range(20))
def test_every_slot_in_exactly_one_contiguous_bucket(seed: int) -> None:
    rng = random.Random(seed)
    count = rng.randint(1, 12)
    a_keys = [f"a{i}" for i in range(count)]
    g_keys = [f"g{i}" for i in reversed(range(count))]
    sizes = {k: rng.randint(1, 5000) for k in a_keys + g_keys}
    model = AlphaBetaModel(alpha=rng.uniform(1e-5, 1e-3), beta=rng.uniform(1e-10, 1e-8))
    a_ready = sorted(rng.uniform(0, 0.01) for _ in a_keys)
    g_ready = sorted(rng.uniform(0, 0.01) for _ in g_keys)
    plans = [
        plan_after_backward(a_keys, g_keys, sizes, 3000),
        plan_layerwise(a_keys, g_keys),
        plan_threshold(a_keys, g_keys, sizes, 3000),
        plan_optimal(a_keys, g_keys, sizes, a_ready, g_ready, model),
    ]
    for plan in plans:
        assert list(plan.slots) == a_keys + g_keys, plan.policy
        # A and G never share a bucket.
        for bucket in plan.buckets:
            assert {k[0] for k in bucket} in ({"a"}, {"g"})
    threshold = plans[2]
    for bucket in threshold.buckets:
        assert len(bucket) == 1 or sum(sizes[k] for k in bucket) <= 3000
    assert plans[0].eager is False and all(p.eager for p in plans[1:])


def test_plan_validation() -> None:
    with pytest.raises(ValueError, match="exactly one bucket"):
        FusionPlan("x", (("a",), ("a",)), eager=True)
    with pytest.raises(ValueError, match="unique"):
        plan_layerwise(["a"], ["a"])
    with pytest.raises(ValueError, match="cap"):
        plan_threshold(["a"], ["b"], {"a": 1, "b": 1}, 0)


def test_dp_merge_is_the_best_split_and_never_worse_than_eq15() -> None:
    from spdkfac.planning.merge import groups_end, merge_dp, merge_groups

    model = AlphaBetaModel(alpha=5e-4, beta=8e-9)
    for seed in range(40):
        order, sizes, ready = random_stream(seed, 2 + seed % 7)
        best = min(groups_end(g, order, sizes, ready, model) for g in all_splits(order))
        groups = merge_dp(order, sizes, ready, model)
        assert [key for group in groups for key in group] == order
        assert groups_end(groups, order, sizes, ready, model) == pytest.approx(best)
        greedy = merge_groups(order, sizes, ready, model)
        assert (
            groups_end(groups, order, sizes, ready, model)
            <= groups_end(greedy, order, sizes, ready, model) + 1e-12
        )


def test_dp_policy_plans_like_threshold_until_measured() -> None:
    from spdkfac.planning.fusion import FUSION_POLICIES, FusionInputs

    inputs = FusionInputs(
        a_order=("a1", "a2"),
        g_order=("g2", "g1"),
        sizes={"a1": 10, "a2": 10, "g1": 10, "g2": 10},
        bucket_cap_elements=15,
        allreduce=AlphaBetaModel(alpha=1e-3, beta=1e-9),
    )
    policy = FUSION_POLICIES["dp"]
    assert policy.eager and policy.measured
    assert policy.plan(inputs).buckets == FUSION_POLICIES["threshold"].plan(inputs).buckets
    measured = policy.plan(replace(inputs, a_ready=(0.0, 1e-5), g_ready=(0.1, 0.1 + 1e-5)))
    # Ready 10 µs apart with α = 1 ms: each stream is one bucket.
    assert measured.policy == "dp"
    assert measured.buckets == (("a1", "a2"), ("g2", "g1"))
