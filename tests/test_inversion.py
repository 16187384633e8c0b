"""Grouping and ordering of inverse broadcasts (pure), and the local inverse phase."""

from __future__ import annotations

import pytest
import torch

from spdkfac.comm import LocalCommunicator
from spdkfac.inversion import broadcast_groups, invert_factors
from spdkfac.linalg import damped_inverse, packed_size
from spdkfac.placement import EVERY_RANK, FactorSpec, Plan


def _plan() -> Plan:
    dims = [10, 20, 30, 5, 8, 12, 7]
    owners = [0, 1, 0, EVERY_RANK, 1, 0, 1]
    specs = tuple(FactorSpec(f"l{i}", "A", d) for i, d in enumerate(dims))
    return Plan("test", 2, specs, tuple(owners), (1.0,) * len(dims))


def test_one_broadcast_per_factor_interleaved_by_owner() -> None:
    plan = _plan()
    available = {spec.key: None for spec in plan.factors}
    groups = broadcast_groups(plan, available, 0)
    assert [(g.owner, g.keys) for g in groups] == [
        (0, ("l0/A",)),
        (1, ("l1/A",)),
        (0, ("l2/A",)),
        (1, ("l4/A",)),
        (0, ("l5/A",)),
        (1, ("l6/A",)),
    ]


def test_fused_groups_cover_each_communicated_factor_once_in_plan_order() -> None:
    plan = _plan()
    available = {spec.key: None for spec in plan.factors if spec.key != "l5/A"}
    threshold = packed_size(10) + packed_size(30)
    groups = broadcast_groups(plan, available, threshold)
    # Owner 0 reaches the threshold with l0 + l2; owner 1's three never do and go together.
    assert [(g.owner, g.keys) for g in groups] == [
        (0, ("l0/A", "l2/A")),
        (1, ("l1/A", "l4/A", "l6/A")),
    ]
    assert groups[0].elements == threshold
    smaller = broadcast_groups(plan, available, packed_size(20))
    assert [(g.owner, g.keys) for g in smaller] == [
        (0, ("l0/A", "l2/A")),
        (1, ("l1/A",)),
        (1, ("l4/A", "l6/A")),
    ]


def test_local_inverse_phase_inverts_everything() -> None:
    plan = _plan()
    factors = {}
    for spec in plan.factors:
        x = torch.randn(spec.dim + 3, spec.dim, generator=torch.Generator().manual_seed(spec.dim))
        factors[spec.key] = x.T @ x
    outcome = invert_factors(factors, plan, LocalCommunicator(), 0.1)
    assert set(outcome.inverses) == set(factors) and not outcome.failed
    for key, factor in factors.items():
        torch.testing.assert_close(outcome.inverses[key], damped_inverse(factor, 0.1))


def test_a_failed_inversion_keeps_the_previous_inverse() -> None:
    plan = _plan()
    factors = {spec.key: torch.eye(spec.dim) for spec in plan.factors}
    factors["l0/A"] = torch.full((10, 10), float("nan"))
    factors["l1/A"] = torch.full((20, 20), float("inf"))
    previous = {"l0/A": torch.ones(10, 10), "l1/A": None}
    with pytest.warns(RuntimeWarning, match="keeping its previous inverse"):
        outcome = invert_factors(factors, plan, LocalCommunicator(), 0.5, previous=previous)
    assert outcome.failed == {"l0/A", "l1/A"}
    assert torch.equal(outcome.inverses["l0/A"], torch.ones(10, 10))
    assert "l1/A" not in outcome.inverses  # no previous: the layer stays unpreconditioned
    torch.testing.assert_close(outcome.inverses["l2/A"], torch.eye(30) / 1.5)
