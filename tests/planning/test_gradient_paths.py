"""The per-layer gradient-path planner: pure, checked against hand-computed costs."""

from __future__ import annotations

import pytest

from spdkfac.costmodel import AlphaBetaModel, CostModel, PolynomialInverseModel
from spdkfac.planning.final import LAYER_PATHS, OWNER_COMPUTES
from spdkfac.planning.paths import (
    OWNER,
    REPLICATED,
    LayerGradient,
    path_costs,
    plan_gradient_paths,
)
from spdkfac.planning.placement import EVERY_RANK, Balanced, FactorSpec, Plan
from spdkfac.strategies import STRATEGIES


def _model(beta: float) -> CostModel:
    """Inversions ``1e-9·d³``; broadcasts ``1e-4 + β·bytes``, all-reduces twice the β."""
    return CostModel(
        inverse=PolynomialInverseModel(c0=0.0, c2=0.0, c3=1e-9),
        broadcast=AlphaBetaModel(alpha=1e-4, beta=beta),
        allreduce=AlphaBetaModel(alpha=1e-4, beta=2 * beta),
    )


def _square(name: str, dim: int) -> LayerGradient:
    return LayerGradient(name, dim * dim, (FactorSpec(name, "A", dim), FactorSpec(name, "G", dim)))


SMALL, LARGE = _square("small", 4), _square("large", 400)


def test_costs_by_hand_on_a_fast_link() -> None:
    model = _model(1e-9)
    # small (n = 16, factors 4x4: inversions 6.4e-8 each, below a broadcast: both NCT):
    # replicated: all-gather 1e-4 + 64e-9, precondition 1e-9·16·8, two inversions,
    # factors all-reduced 2e-9·4·(10 + 10); owner: reduce-scatter 1e-4 + 64e-9, broadcast
    # 1e-4 + 64e-9, (precondition + inversions) / 2, factors reduce-scattered (half).
    small = path_costs(SMALL, 2, model)
    assert small.replicated == pytest.approx(1e-4 + 6.4e-8 + 1.28e-7 + 1.28e-7 + 1.6e-7)
    assert small.owner == pytest.approx(2e-4 + 1.28e-7 + 1.28e-7 + 8e-8)
    assert small.path == REPLICATED
    # large (n = 160000, inversions 0.064 each, a broadcast of 80200 elements 4.208e-4:
    # both CT on the replicated path, half an inversion each plus its broadcast).
    large = path_costs(LARGE, 2, model)
    assert large.replicated == pytest.approx(7.4e-4 + 0.128 + 2 * (0.032 + 4.208e-4) + 1.2832e-3)
    assert large.owner == pytest.approx(7.4e-4 + 7.4e-4 + 0.128 + 6.416e-4)
    assert large.path == OWNER


def test_small_layers_flip_when_the_link_slows_down() -> None:
    plan = plan_gradient_paths([SMALL, LARGE], 2, _model(1e-9), Balanced())
    assert dict(plan.paths) == {"small": REPLICATED, "large": OWNER}
    assert plan.placement.owner_layers == {"large"}
    # The owner gets both of its layer's factors; small's are inverted everywhere (NCT).
    assert plan.placement.owner_by_key == {
        "small/A": EVERY_RANK,
        "small/G": EVERY_RANK,
        "large/A": 0,
        "large/G": 0,
    }
    # At β = 1e-5 s/B the factors' all-reduce outweighs the extra start-ups: small's
    # replicated 7.4e-4 + 2.56e-7 + 1.6e-3, owner 2·7.4e-4 + 1.28e-7 + 8e-4.
    slow = path_costs(SMALL, 2, _model(1e-5))
    assert slow.replicated == pytest.approx(7.4e-4 + 2.56e-7 + 1.6e-3)
    assert slow.owner == pytest.approx(2 * 7.4e-4 + 1.28e-7 + 8e-4)
    flipped = plan_gradient_paths([SMALL, LARGE], 2, _model(1e-5), Balanced())
    assert dict(flipped.paths) == {"small": OWNER, "large": OWNER}


def test_owner_layers_are_balanced_over_the_ranks() -> None:
    layers = [SMALL, _square("mid", 200), LARGE]
    plan = plan_gradient_paths(layers, 2, _model(1e-9), Balanced()).placement
    # Largest owner work first onto the least-loaded rank.
    assert plan.owner("large", "A") == plan.owner("large", "G") == 0
    assert plan.owner("mid", "A") == plan.owner("mid", "G") == 1
    assert plan.owner_layers == {"large", "mid"}
    assert "2/3 layers" in plan_gradient_paths(layers, 2, _model(1e-9), Balanced()).describe()


def test_one_rank_keeps_every_layer_replicated() -> None:
    plan = plan_gradient_paths([SMALL, LARGE], 1, _model(1e-9), Balanced())
    assert dict(plan.paths) == {"small": REPLICATED, "large": REPLICATED}
    assert set(plan.placement.owners) == {EVERY_RANK}


def test_plans_and_layers_are_validated() -> None:
    spec = FactorSpec("l", "A", 3)
    with pytest.raises(ValueError, match="elements"):
        LayerGradient("l", 0, (spec,))
    with pytest.raises(ValueError, match="its own"):
        LayerGradient("other", 9, (spec,))
    with pytest.raises(ValueError, match="owner layer 'l'"):
        Plan("x", 2, (spec, FactorSpec("l", "G", 3)), (0, 1), (0.0, 0.0), frozenset({"l"}))


def test_the_final_policy_routes_owner_layers_factors_only() -> None:
    plan = plan_gradient_paths([SMALL, LARGE], 2, _model(1e-9), Balanced()).placement
    assert LAYER_PATHS.factor_owners(plan) == {
        "small/A": EVERY_RANK,
        "small/G": EVERY_RANK,
        "large/A": 0,
        "large/G": 0,
    }
    assert LAYER_PATHS.place(Balanced(), [SMALL, LARGE], 2, _model(1e-9)) == plan
    row = STRATEGIES["layer-paths"]
    assert row.final is LAYER_PATHS and row.placement == "balanced"
    with pytest.raises(ValueError, match="placement='balanced'"):
        OWNER_COMPUTES.check_placement("balanced", False, "osawa")
