"""The printed cost model reads back (``benchmarks/sim/validate_sim.py`` simulates from it)."""

from __future__ import annotations

import pytest

from spdkfac.bench.costs import describe_cost_model, read_cost_model
from spdkfac.costmodel import AlphaBetaModel, CostModel, PolynomialInverseModel


def test_a_described_cost_model_reads_back_to_its_printed_precision() -> None:
    model = CostModel(
        inverse=PolynomialInverseModel(c0=2.345e-4, c2=0.0, c3=1.2345e-10),
        broadcast=AlphaBetaModel(alpha=1.23456e-4, beta=8.0e-9),
        allreduce=AlphaBetaModel(alpha=0.0, beta=0.0),
    )
    read = read_cost_model(describe_cost_model(model, "test"))
    inverse = read.inverse
    assert (inverse.c0, inverse.c2) == (pytest.approx(2.35e-4), 0.0)
    assert inverse.c3 == pytest.approx(1.23e-10)
    assert read.broadcast.alpha == pytest.approx(1.23e-4, rel=1e-3)
    assert read.broadcast.beta == pytest.approx(8.0e-9)
    assert (read.allreduce.alpha, read.allreduce.beta) == (0.0, 0.0)


@pytest.mark.parametrize("key", ["inverse", "broadcast", "all-reduce"])
def test_an_entry_not_in_the_printed_form_is_named(key: str) -> None:
    zero = AlphaBetaModel(alpha=0.0, beta=0.0)
    described = describe_cost_model(
        CostModel(
            inverse=PolynomialInverseModel(c0=0.0, c2=0.0, c3=1e-9), broadcast=zero, allreduce=zero
        ),
        "test",
    )
    described[key] = "fitted on the moon"
    with pytest.raises(ValueError, match="fitted on the moon"):
        read_cost_model(described)
