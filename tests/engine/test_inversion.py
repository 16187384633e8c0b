"""Grouping and ordering of inverse broadcasts (pure), and the local inverse phase."""

from __future__ import annotations

import pytest
import torch
from torch.futures import Future

from spdkfac.comm import LocalCommunicator
from spdkfac.comm.base import completed
from spdkfac.engine import inversion
from spdkfac.engine.inversion import invert_factors
from spdkfac.forms import DampedInverse
from spdkfac.linalg import damped_inverse, pack_triu, packed_size
from spdkfac.planning.broadcasts import broadcast_groups
from spdkfac.planning.placement import EVERY_RANK, FactorSpec, Plan
from spdkfac.profiling import Phase, Profiler, span_name


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


def _spd(dim: int, seed: int) -> torch.Tensor:
    x = torch.randn(
        dim + 3, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    product = x.T @ x
    return (product + product.T) / 2  # exactly symmetric on any CPU (XᵀX need not be)


def _same_sized_plan(owners: list[int]) -> Plan:
    dims = [6, 6, 9, 6, 9, 6]
    specs = tuple(FactorSpec(f"l{i}", "A", dim) for i, dim in enumerate(dims))
    return Plan("test", max(2, max(owners) + 1), specs, tuple(owners), (1.0,) * len(dims))


@pytest.mark.parametrize("packed", [False, True], ids=["full", "packed"])
def test_batched_phase_equals_one_call_per_factor(packed: bool) -> None:
    plan = _same_sized_plan([0] * 6)
    full = {spec.key: _spd(spec.dim, index) for index, spec in enumerate(plan.factors)}
    factors = {key: pack_triu(f) if packed else f for key, f in full.items()}
    calls: list[int] = []

    class Counting(DampedInverse):
        def compute_batch(self, stack: torch.Tensor, damping: float) -> list[torch.Tensor | None]:
            calls.append(stack.shape[0])
            return super().compute_batch(stack, damping)

    outcome = invert_factors(factors, plan, LocalCommunicator(), 0.1, Counting("cholesky"))
    assert sorted(calls) == [2, 4]  # one call per dimension
    assert not outcome.failed
    for key, factor in full.items():
        torch.testing.assert_close(
            outcome.inverses[key], damped_inverse(factor, 0.1), rtol=1e-12, atol=1e-12
        )
        assert torch.equal(factors[key], pack_triu(factor) if packed else factor)  # untouched


def test_a_failing_member_of_a_batch_falls_back_alone() -> None:
    plan = _same_sized_plan([0] * 6)
    factors = {spec.key: pack_triu(_spd(spec.dim, i)) for i, spec in enumerate(plan.factors)}
    factors["l1/A"] = pack_triu(-torch.eye(6, dtype=torch.float64))  # needs 100x damping
    factors["l3/A"] = torch.full((packed_size(6),), float("nan"), dtype=torch.float64)
    previous = {"l3/A": torch.ones(6, 6, dtype=torch.float64)}
    with pytest.warns(RuntimeWarning) as caught:
        outcome = invert_factors(factors, plan, LocalCommunicator(), 0.1, previous=previous)
    messages = [str(warning.message) for warning in caught]
    assert any("100x the damping" in message for message in messages)
    assert any("inverting l3/A failed" in message for message in messages)
    assert outcome.failed == {"l3/A"}
    torch.testing.assert_close(outcome.inverses["l1/A"], torch.eye(6, dtype=torch.float64) / 9)
    assert torch.equal(outcome.inverses["l3/A"], previous["l3/A"])
    torch.testing.assert_close(
        outcome.inverses["l5/A"], damped_inverse(_spd(6, 5), 0.1), rtol=1e-12, atol=1e-12
    )


def test_batches_still_give_each_factor_its_span() -> None:
    plan = _same_sized_plan([0] * 6)
    factors = {spec.key: _spd(spec.dim, i) for i, spec in enumerate(plan.factors)}
    profiler = Profiler(enabled=True)
    invert_factors(factors, plan, LocalCommunicator(), 0.1, profiler=profiler)
    names = [event.name for event in profiler.events()]
    assert sorted(names) == sorted(span_name(Phase.INVERSE_COMPUTE, key) for key in factors)


class _SecondOfTwo(LocalCommunicator):
    """Rank 1 of 2 whose collectives complete at once (a receive keeps its buffer)."""

    @property
    def rank(self) -> int:
        return 1

    @property
    def world_size(self) -> int:
        return 2

    def broadcast(self, tensor: torch.Tensor, src: int) -> Future[torch.Tensor]:
        return completed(tensor)


def test_only_the_factors_a_rank_inverts_are_unpacked(monkeypatch: pytest.MonkeyPatch) -> None:
    owners = [0, 1, EVERY_RANK, 0, 1, 0]
    plan = _same_sized_plan(owners)
    factors = {spec.key: pack_triu(_spd(spec.dim, i)) for i, spec in enumerate(plan.factors)}
    unpacked: list[int] = []
    real = inversion.unpack_triu

    def recording(packed: torch.Tensor, dim: int, **kwargs: torch.Tensor) -> torch.Tensor:
        unpacked.append(id(packed))
        return real(packed, dim, **kwargs)

    monkeypatch.setattr(inversion, "unpack_triu", recording)
    outcome = invert_factors(factors, plan, _SecondOfTwo(), 0.1)
    mine = {key for key, owner in zip(factors, owners, strict=True) if owner in (1, EVERY_RANK)}
    assert {key for key, f in factors.items() if id(f) in unpacked} == mine
    assert set(outcome.inverses) == set(factors)  # the others' arrive by broadcast
    dims = {spec.key: spec.dim for spec in plan.factors}
    for key in mine:
        expected = damped_inverse(real(factors[key], dims[key]), 0.1)
        torch.testing.assert_close(outcome.inverses[key], expected)
