"""The variant table, the presets and the choice of Fig. 10 baselines."""

from __future__ import annotations

import pytest

from spdkfac.bench.variants import (
    PRESETS,
    VARIANTS,
    after_backward_baseline,
    parse_variants,
    preconditioner_kwargs,
)
from spdkfac.config import KFACConfig
from spdkfac.strategies import AUTO_CANDIDATES, AutoStrategy


def test_table_builds_the_expected_kwargs() -> None:
    expected = {
        "sgd": None,
        "d-kfac": {"strategy": "d-kfac"},
        "mpd-kfac": {"strategy": "mpd-kfac"},
        "spd-kfac": {"strategy": "spd-kfac"},
        "osawa": {"strategy": "osawa"},
        "layer-paths": {"strategy": "layer-paths"},
        "osawa-pipelined": {"strategy": "osawa", "factor_exchange": "optimal"},
        "placement-only": {"strategy": "spd-kfac", "factor_exchange": "after-backward"},
        "pipelining-only": {"strategy": "d-kfac", "factor_exchange": "optimal"},
        "spd-kfac+priority": {"strategy": "spd-kfac", "comm_scheduler": "priority"},
        "osawa-pipelined+priority": {
            "strategy": "osawa",
            "factor_exchange": "optimal",
            "comm_scheduler": "priority",
        },
        "fusion:dp+priority": {
            "strategy": "spd-kfac",
            "factor_exchange": "dp",
            "comm_scheduler": "priority",
        },
        "fusion:after-backward": {"strategy": "spd-kfac", "factor_exchange": "after-backward"},
        "fusion:layerwise": {"strategy": "spd-kfac", "factor_exchange": "layerwise"},
        "fusion:threshold": {"strategy": "spd-kfac", "factor_exchange": "threshold"},
        "fusion:optimal": {"strategy": "spd-kfac", "factor_exchange": "optimal"},
        "fusion:dp": {"strategy": "spd-kfac", "factor_exchange": "dp"},
        "auto": {"strategy": "auto"},
    }
    assert {name: preconditioner_kwargs(name) for name in VARIANTS} == expected


def test_kwargs_are_copies_and_the_table_is_read_only() -> None:
    kwargs = preconditioner_kwargs("spd-kfac")
    assert kwargs is not None
    kwargs["strategy"] = "d-kfac"
    assert preconditioner_kwargs("spd-kfac") == {"strategy": "spd-kfac"}
    with pytest.raises(TypeError):
        VARIANTS["spd-kfac"].kfac["strategy"] = "d-kfac"  # type: ignore[index]


@pytest.mark.parametrize(
    ("name", "exchange", "placement"),
    [
        ("d-kfac", "after-backward", "replicated"),
        ("mpd-kfac", "after-backward", "round-robin"),
        ("spd-kfac", "optimal", "balanced"),
        ("placement-only", "after-backward", "balanced"),
        ("pipelining-only", "optimal", "replicated"),
        ("fusion:threshold", "threshold", "balanced"),
        ("sgd", None, None),
    ],
)
def test_resolved_policies(name: str, exchange: str | None, placement: str | None) -> None:
    assert VARIANTS[name].factor_exchange == exchange
    assert VARIANTS[name].placement == placement


def test_presets_expand_in_order_without_duplicates() -> None:
    assert PRESETS["main"] == (
        "sgd",
        "d-kfac",
        "mpd-kfac",
        "spd-kfac",
        "placement-only",
        "pipelining-only",
    )
    assert parse_variants("fig10, d-kfac,mpd-kfac,spd-kfac,d-kfac") == (
        "fusion:after-backward",
        "fusion:layerwise",
        "fusion:threshold",
        "fusion:optimal",
        "d-kfac",
        "mpd-kfac",
        "spd-kfac",
    )
    assert parse_variants("sgd,main")[:2] == ("sgd", "d-kfac")


def test_a_preset_wins_over_its_variant_and_the_prefix_names_the_variant_alone() -> None:
    assert parse_variants("auto") == PRESETS["auto"]
    assert len(PRESETS["osawa"]) > 1
    assert parse_variants("variant:auto") == ("auto",)
    assert parse_variants("d-kfac, variant:osawa, variant:d-kfac") == ("d-kfac", "osawa")


@pytest.mark.parametrize("text", ["", " , ", "sgd,adam", "fig9", "variant:main"])
def test_bad_variant_lists_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="variant"):
        parse_variants(text)


def test_after_backward_baselines() -> None:
    run = PRESETS["main"]
    assert after_backward_baseline("spd-kfac", run) == "placement-only"
    assert after_backward_baseline("pipelining-only", run) == "d-kfac"
    assert after_backward_baseline("d-kfac", run) == "d-kfac"
    assert after_backward_baseline("sgd", run) is None
    fig10 = parse_variants("fig10,spd-kfac")
    assert after_backward_baseline("fusion:layerwise", fig10) == "fusion:after-backward"
    assert after_backward_baseline("spd-kfac", fig10) == "fusion:after-backward"
    assert after_backward_baseline("spd-kfac", ("spd-kfac", "d-kfac")) is None


def test_auto_is_the_selection_a_preconditioner_makes() -> None:
    auto = VARIANTS["auto"]
    assert isinstance(auto.selection, AutoStrategy) and auto.row is None
    assert auto.selection == KFACConfig(strategy="auto").selection
    assert [row.name for row in auto.selection.rows] == list(AUTO_CANDIDATES)
    assert auto.chosen_online and auto.uses_kfac
    assert (auto.strategy, auto.factor_exchange, auto.placement) == ("auto", "auto", "auto")
    assert auto.description == (
        "auto: the fastest of d-kfac, spd-kfac, osawa, osawa-pipelined, mpd-kfac, measured "
        "online (its trial iterations come before the measured ones and are not counted)"
    )
    assert after_backward_baseline("auto", PRESETS["auto"]) is None
    assert after_backward_baseline("d-kfac", PRESETS["auto"]) == "d-kfac"
    assert [name for name, variant in VARIANTS.items() if variant.chosen_online] == ["auto"]
