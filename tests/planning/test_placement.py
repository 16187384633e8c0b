"""Inverse placement planners: pure functions, checked without processes."""

from __future__ import annotations

import itertools
import random

import pytest

from spdkfac.costmodel import DEFAULT_COST_MODEL, AlphaBetaModel, CostModel, PolynomialInverseModel
from spdkfac.forms import inverse_form
from spdkfac.planning.placement import (
    EVERY_RANK,
    PLACEMENTS,
    FactorSpec,
    Plan,
    broadcast_seconds,
    inversion_seconds,
    layer_owner_seconds,
    plan_balanced,
    plan_inversions,
    plan_replicated,
    plan_round_robin,
)

# Broadcasts cost nothing: every factor is communicated, so balancing is pure LPT.
ALL_COMMUNICATED = CostModel(
    inverse=PolynomialInverseModel(c0=0.0, c2=0.0, c3=1e-9),
    broadcast=AlphaBetaModel(alpha=0.0, beta=0.0),
    allreduce=AlphaBetaModel(alpha=0.0, beta=0.0),
)


def _random_specs(rng: random.Random, count: int, max_dim: int = 600) -> list[FactorSpec]:
    return [
        FactorSpec(f"layer{i // 2}", "A" if i % 2 == 0 else "G", rng.randint(1, max_dim))
        for i in range(count)
    ]


@pytest.mark.parametrize("placement", ["replicated", "round-robin", "balanced"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 7])
def test_every_factor_is_placed_exactly_once(placement: str, world_size: int) -> None:
    specs = _random_specs(random.Random(world_size), 21)
    plan = plan_inversions(specs, world_size, placement)
    assert [s.key for s in plan.factors] == [s.key for s in specs]
    assert len(plan.owners) == len(specs)
    for owner in plan.owners:
        assert owner == EVERY_RANK or 0 <= owner < world_size
    assert set(plan.owner_by_key) == {s.key for s in specs}


def test_replicated_and_round_robin() -> None:
    specs = _random_specs(random.Random(0), 7)
    assert set(plan_replicated(specs, 3).owners) == {EVERY_RANK}
    assert plan_round_robin(specs, 3).owners == (0, 1, 2, 0, 1, 2, 0)


def _makespan(costs: list[float], assignment: tuple[int, ...], ranks: int) -> float:
    loads = [0.0] * ranks
    for cost, rank in zip(costs, assignment, strict=True):
        loads[rank] += cost
    return max(loads)


@pytest.mark.parametrize("seed", range(30))
def test_balanced_is_within_the_lpt_bound_of_the_optimum(seed: int) -> None:
    rng = random.Random(seed)
    ranks = rng.choice([2, 3])
    specs = _random_specs(rng, rng.randint(2, 8))
    plan = plan_balanced(specs, ranks, ALL_COMMUNICATED)
    assert EVERY_RANK not in plan.owners
    costs = list(plan.predicted_seconds)
    optimum = min(
        _makespan(costs, assignment, ranks)
        for assignment in itertools.product(range(ranks), repeat=len(costs))
    )
    assert max(plan.loads()) == pytest.approx(_makespan(costs, plan.owners, ranks))
    assert max(plan.loads()) <= (4 / 3 - 1 / (3 * ranks)) * optimum * (1 + 1e-12)


def test_balanced_loads_are_predicted_times_not_dimensions() -> None:
    # One 400-dim factor costs more than eight 200-dim ones together (cubic), so LPT on
    # time gives it a rank of its own; balancing dimensions would pair it differently.
    specs = [FactorSpec("big", "A", 400)] + [FactorSpec(f"s{i}", "A", 200) for i in range(8)]
    plan = plan_balanced(specs, 2, ALL_COMMUNICATED)
    big_owner = plan.owner("big", "A")
    assert all(plan.owner(f"s{i}", "A") != big_owner for i in range(8))


def test_nct_exactly_when_compute_is_not_more_than_broadcast() -> None:
    specs = [FactorSpec(f"l{d}", "A", d) for d in (1, 8, 32, 64, 100, 128, 256, 577, 1024)]
    plan = plan_balanced(specs, 2, DEFAULT_COST_MODEL)
    for spec, owner in zip(specs, plan.owners, strict=True):
        cheaper_locally = DEFAULT_COST_MODEL.inverse_seconds(
            spec.dim
        ) <= DEFAULT_COST_MODEL.broadcast_seconds(spec.dim)
        assert (owner == EVERY_RANK) == cheaper_locally, spec
    assert EVERY_RANK in plan.owners and any(o != EVERY_RANK for o in plan.owners)


def test_plan_does_not_depend_on_listing_order() -> None:
    rng = random.Random(5)
    specs = [*_random_specs(rng, 30), FactorSpec("tie1", "A", 300), FactorSpec("tie2", "A", 300)]
    reference = dict(plan_balanced(specs, 3).owner_by_key)
    for _ in range(5):
        shuffled = specs[:]
        rng.shuffle(shuffled)
        assert dict(plan_balanced(shuffled, 3).owner_by_key) == reference


def test_more_ranks_than_factors() -> None:
    specs = [FactorSpec("a", "A", 500), FactorSpec("a", "G", 400), FactorSpec("b", "A", 300)]
    plan = plan_balanced(specs, 16, ALL_COMMUNICATED)
    assert sorted(plan.owners) == [0, 1, 2]
    assert sum(1 for load in plan.loads() if load == 0) == 13
    assert plan_round_robin(specs, 16).owners == (0, 1, 2)


def test_world_size_one_balanced_is_all_local() -> None:
    specs = _random_specs(random.Random(1), 6)
    assert set(plan_balanced(specs, 1).owners) == {EVERY_RANK}


def test_bad_inputs() -> None:
    specs = _random_specs(random.Random(2), 4)
    with pytest.raises(ValueError, match="placement must be one of"):
        plan_inversions(specs, 2, "greedy")
    with pytest.raises(ValueError, match="world_size"):
        plan_inversions(specs, 0, "balanced")
    with pytest.raises(ValueError, match="dim"):
        FactorSpec("x", "A", 0)
    with pytest.raises(ValueError, match="exactly once"):
        Plan("x", 2, (specs[0], specs[0]), (0, 1), (1.0, 1.0))
    with pytest.raises(ValueError, match="owner of"):
        Plan("x", 2, (specs[0],), (2,), (1.0,))
    with pytest.raises(ValueError, match="alpha"):
        AlphaBetaModel(alpha=-1.0, beta=0.0)


# A known rate per element: 1 s per broadcast element (bytes_per_element=1), and every
# inversion by the fit c0 seconds, so broadcast and compute costs read off exactly.
def _per_element(c0: float) -> CostModel:
    return CostModel(
        inverse=PolynomialInverseModel(c0=c0, c2=0.0, c3=0.0),
        broadcast=AlphaBetaModel(alpha=0.0, beta=1.0),
        allreduce=AlphaBetaModel(alpha=0.0, beta=0.0),
        bytes_per_element=1,
    )


@pytest.mark.parametrize("method", ["cholesky", "eigen", "eigen-basis"])
def test_specs_of_a_form_carry_its_wire_size_and_compute_scale(method: str) -> None:
    form = inverse_form(method)
    spec = FactorSpec.for_form("fc", "A", 10, form)
    expected = 110 if method == "eigen-basis" else 55  # d² + d, or d(d + 1)/2
    assert spec.wire_elements == form.wire_size(10) == expected
    assert spec.compute_scale == form.compute_scale
    model = _per_element(c0=2.0)
    assert broadcast_seconds(spec, model) == expected
    assert inversion_seconds(spec, model) == 2.0 * form.compute_scale
    # A spec without a form is a damped inverse by Cholesky, priced as before.
    assert FactorSpec("fc", "A", 10) == FactorSpec.for_form("fc", "A", 10, inverse_form("cholesky"))


def test_balanced_prices_an_eigen_basis_broadcast_at_d_squared_plus_d() -> None:
    """Same compute (scale 1), d = 10, inversion 80 s: a packed triangle's broadcast (55 s)
    is cheaper, so the factor is communicated; an eigen-basis (110 elements: 110 s) is
    not worth sending, so every rank computes it."""
    model = _per_element(c0=80.0)
    packed = FactorSpec("l", "A", 10)
    eigen_wire = FactorSpec("l", "A", 10, wire_elements=inverse_form("eigen-basis").wire_size(10))
    assert plan_balanced([packed], 2, model).owners == (0,)
    assert plan_balanced([eigen_wire], 2, model).owners == (EVERY_RANK,)


def test_every_planner_predicts_a_form_s_compute_time() -> None:
    """Inversion 30 s by the fit: a Cholesky result (scale 1, 55 s to send) stays local;
    the eigen-basis one costs 30·scale = 135 s > its 110 s broadcast: communicated."""
    model = _per_element(c0=30.0)
    basis = inverse_form("eigen-basis")
    cholesky = [FactorSpec("l", "A", 10), FactorSpec("l", "G", 10)]
    eigen = [FactorSpec.for_form(s.layer, s.kind, s.dim, basis) for s in cholesky]
    assert set(plan_balanced(cholesky, 2, model).owners) == {EVERY_RANK}
    assert sorted(plan_balanced(eigen, 2, model).owners) == [0, 1]
    for placement in PLACEMENTS:
        plain = plan_inversions(cholesky, 2, placement, model).predicted_seconds
        scaled = plan_inversions(eigen, 2, placement, model).predicted_seconds
        assert plain == (30.0, 30.0) and scaled == (30.0 * 4.5, 30.0 * 4.5), placement
    extra = layer_owner_seconds(eigen, model)["l"] - layer_owner_seconds(cholesky, model)["l"]
    assert extra == pytest.approx(2 * 30.0 * (basis.compute_scale - 1.0))
