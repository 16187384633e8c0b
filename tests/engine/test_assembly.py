"""The assembler's tables: every axis value a strategy row holds is a registered object,
and every final-stage policy builds a stage."""

from __future__ import annotations

import pytest
from torch import nn

from spdkfac import KFACConfig, KFACPreconditioner
from spdkfac.engine.assembly import FINAL_STAGES
from spdkfac.planning.broadcasts import BROADCAST_POLICIES
from spdkfac.planning.final import FINAL_POLICIES
from spdkfac.planning.fusion import FUSION_POLICIES
from spdkfac.planning.placement import PLACEMENT_POLICIES
from spdkfac.planning.schedule import SCHEDULER_POLICIES
from spdkfac.strategies import STRATEGIES, AutoStrategy


def test_every_final_policy_builds_a_stage() -> None:
    assert set(FINAL_STAGES) == set(FINAL_POLICIES.values())


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_row_is_a_tuple_of_registered_axis_objects(name: str) -> None:
    row = STRATEGIES[name]
    assert row.fusion is FUSION_POLICIES[row.fusion.name]  # type: ignore[union-attr]
    assert row.placement_policy is PLACEMENT_POLICIES[row.placement]  # type: ignore[index]
    assert row.broadcasts == BROADCAST_POLICIES[row.broadcasts.name]
    assert row.final is FINAL_POLICIES[row.final.name]
    assert row.scheduler is SCHEDULER_POLICIES[row.scheduler.name]
    assert row.rows == (row,) and row.first is row


def test_auto_is_its_own_type_with_the_candidate_rows() -> None:
    config = KFACConfig(strategy="auto", auto_candidates=("d-kfac", "osawa"))
    selection = config.selection
    assert isinstance(selection, AutoStrategy)
    assert [row.name for row in selection.rows] == ["d-kfac", "osawa"]
    assert selection.first.name == "d-kfac" == config.composition.name
    priority = KFACConfig(strategy="auto", comm_scheduler="priority").selection
    assert all(row.scheduler.orders_traffic for row in priority.rows)
    assert not isinstance(KFACConfig(strategy="osawa").selection, AutoStrategy)


def test_a_single_rank_creates_no_group_and_remove_closes_the_assembler() -> None:
    precond = KFACPreconditioner(nn.Linear(3, 2), strategy="auto", lr=0.1)
    assembler = precond._assembler
    assert assembler.groups == [] and assembler.scheduler is None and assembler.hooks is None
    precond.remove()
    assert assembler.groups == []
