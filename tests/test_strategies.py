"""The one strategy table, its policy registries and the options that name them."""

from __future__ import annotations

import inspect
from dataclasses import fields
from typing import get_args

import pytest
from torch import nn

from spdkfac import KFACConfig, KFACPreconditioner
from spdkfac.costmodel import DEFAULT_COST_MODEL
from spdkfac.layers.batchnorm import BATCHNORM_MODES
from spdkfac.planning.fusion import FACTOR_EXCHANGES, FUSION_POLICIES, FusionInputs
from spdkfac.planning.placement import PLACEMENT_POLICIES, PLACEMENTS, FactorSpec, plan_inversions
from spdkfac.strategies import ALGORITHMS, SGD, STRATEGIES, STRATEGY_NAMES, compose
from spdkfac.types import FactorExchangeName, NormalizationMode, PlacementName, StrategyName


def test_option_names_and_registries_agree() -> None:
    assert get_args(FactorExchangeName) == FACTOR_EXCHANGES
    assert get_args(PlacementName) == PLACEMENTS
    assert get_args(StrategyName) == STRATEGY_NAMES == (*ALGORITHMS, "auto")
    assert get_args(NormalizationMode) == BATCHNORM_MODES
    assert all(name == policy.name for name, policy in FUSION_POLICIES.items())
    assert all(name == policy.name for name, policy in PLACEMENT_POLICIES.items())


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_row_is_reached_by_its_options(name: str) -> None:
    strategy = STRATEGIES[name]
    options = strategy.options
    assert options is not None and strategy.base in ALGORITHMS
    config = KFACConfig(**options)  # type: ignore[arg-type]
    composed = config.composition
    assert composed.fusion == strategy.fusion
    assert composed.placement_policy == strategy.placement_policy
    assert composed.broadcasts == strategy.broadcasts


def test_algorithms_compose_the_papers_policies() -> None:
    expected = {
        "d-kfac": ("after-backward", "replicated", "per-factor"),
        "mpd-kfac": ("after-backward", "round-robin", "per-factor"),
        "spd-kfac": ("optimal", "balanced", "fused"),
    }
    for name, (exchange, placement, fuse) in expected.items():
        row = STRATEGIES[name]
        assert (row.factor_exchange, row.placement, row.broadcasts.name) == (
            exchange,
            placement,
            fuse,
        )
    assert not SGD.uses_kfac and SGD.options is None


def test_a_new_row_is_one_composition() -> None:
    row = compose(
        "mine", "mpd-kfac", "round-robin with layer-wise exchange", factor_exchange="layerwise"
    )
    assert (row.factor_exchange, row.placement) == ("layerwise", "round-robin")
    assert row.options == {"strategy": "mpd-kfac", "factor_exchange": "layerwise"}


def test_optimal_plans_as_threshold_until_measured() -> None:
    sizes = {"a/A": 10, "b/A": 10, "b/G": 6, "a/G": 6}
    inputs = FusionInputs(
        a_order=("a/A", "b/A"),
        g_order=("b/G", "a/G"),
        sizes=sizes,
        bucket_cap_elements=15,
        allreduce=DEFAULT_COST_MODEL.allreduce,
    )
    assert FUSION_POLICIES["optimal"].plan(inputs).buckets == (
        FUSION_POLICIES["threshold"].plan(inputs).buckets
    )
    assert FUSION_POLICIES["after-backward"].plan(inputs).eager is False


def test_placement_by_name_or_policy_is_the_same_plan() -> None:
    specs = [FactorSpec("a", "A", 64), FactorSpec("a", "G", 512), FactorSpec("b", "A", 8)]
    for name, policy in PLACEMENT_POLICIES.items():
        assert plan_inversions(specs, 2, name) == plan_inversions(specs, 2, policy)


def test_config_and_keyword_options_build_the_same_preconditioner() -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    config = KFACConfig(damping=0.2, strategy="d-kfac", kl_clip=None)
    by_config = KFACPreconditioner(model, config=config)
    by_config.remove()  # one preconditioner per model at a time
    by_keywords = KFACPreconditioner(model, damping=0.2, strategy="d-kfac", kl_clip=None)
    by_keywords.remove()
    assert by_config.config == by_keywords.config == config
    # Keyword options given with config= replace its fields.
    assert KFACPreconditioner(model, config=config, damping=0.5).config.damping == 0.5
    with pytest.raises(TypeError, match="dampng"):
        KFACPreconditioner(model, dampng=0.1)


def test_signature_lists_every_option_once() -> None:
    parameters = inspect.signature(KFACPreconditioner).parameters
    options = [option.name for option in fields(KFACConfig)]
    assert [name for name in parameters if name in options] == options
    assert parameters["damping"].default == 0.1
    assert parameters["inv_update_steps"].default == 10
    assert parameters["factor_options"].default == KFACConfig().factor_options
    assert parameters["model"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
