"""Data-parallel K-FAC on gloo: every strategy equals single-process K-FAC on the full batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from distributed_helper import run_distributed
from parallel_cases import Branchy, batch, bounds, grads, params
from spdkfac import KFACPreconditioner

STRATEGIES = ("d-kfac", "mpd-kfac", "spd-kfac")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 3, 3, stride=2, bias=False)
        self.fc1 = nn.Linear(3 * 2 * 2, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.conv2(torch.tanh(self.conv(x))))
        return self.fc2(torch.tanh(self.fc1(x.flatten(1))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net().double()


def _options(**extra: object) -> dict[str, object]:
    return {"damping": 0.05, "kl_clip": 1e-2, "lr": 0.1, **extra}


def _shard(rank: int, world_size: int, step: int) -> tuple[Tensor, Tensor]:
    inputs, targets = batch(step)
    begin, end = bounds(rank, world_size)
    return inputs[begin:end], targets[begin:end]


def _strategies_worker(rank: int, world_size: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for strategy in STRATEGIES:
        model = DistributedDataParallel(_model())
        precond = KFACPreconditioner(model, strategy=strategy, **_options())  # type: ignore[arg-type]
        inputs, targets = _shard(rank, world_size, 0)
        F.cross_entropy(model(inputs), targets).backward()
        assert precond.step()
        out[f"{strategy}/grads"] = grads(model.module)
        out[f"{strategy}/plan"] = precond.plan.owners
        # 20 training steps with stale refreshes; replicas must stay bit-identical.
        model = DistributedDataParallel(_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        precond = KFACPreconditioner(
            model,
            strategy=strategy,
            **_options(factor_update_steps=2, inv_update_steps=3),  # type: ignore[arg-type]
        )
        for step in range(20):
            optimizer.zero_grad()
            inputs, targets = _shard(rank, world_size, step)
            F.cross_entropy(model(inputs), targets).backward()
            if precond.step():
                optimizer.step()
        out[f"{strategy}/params"] = params(model.module)
    return out


def _single_process_reference() -> dict[str, Tensor]:
    model = _model()
    precond = KFACPreconditioner(model, **_options())  # type: ignore[arg-type]
    inputs, targets = batch(0)
    F.cross_entropy(model(inputs), targets).backward()
    precond.step()
    return grads(model)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_strategy_matches_single_process_kfac(world_size: int) -> None:
    results = run_distributed(_strategies_worker, world_size, timeout=120)
    reference = _single_process_reference()
    for rank, out in enumerate(results):
        for strategy in STRATEGIES:
            grads = out[f"{strategy}/grads"]
            assert set(grads) == set(reference)
            for name, expected in reference.items():
                torch.testing.assert_close(
                    grads[name],
                    expected,
                    rtol=1e-9,
                    atol=1e-12,
                    msg=f"{strategy} {name} rank {rank}",
                )
            # Replicas are bit-identical after 20 steps.
            for name, value in out[f"{strategy}/params"].items():
                assert torch.equal(value, results[0][f"{strategy}/params"][name]), (
                    strategy,
                    name,
                    rank,
                )
    if world_size > 1:
        plans = {s: results[0][f"{s}/plan"] for s in STRATEGIES}
        assert set(plans["d-kfac"]) == {-1}
        assert -1 not in plans["mpd-kfac"]
        assert len(set(plans["mpd-kfac"])) == world_size


def _unused_layer_worker(rank: int, world_size: int) -> dict[str, Tensor | None]:
    torch.manual_seed(0)
    model = Branchy().double()
    precond = KFACPreconditioner(model, kl_clip=None)
    inputs = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    # The side branch runs on rank 0 only: its factors come from rank 0's examples alone.
    model(inputs, use_side=(rank == 0)).pow(2).mean().backward()
    precond.step()
    a_side, _ = precond.factors("side")
    a_trunk, _ = precond.factors("trunk")
    return {"side": a_side, "trunk": a_trunk, "inputs": inputs}


def test_layer_unused_on_one_rank_does_not_hang() -> None:
    results = run_distributed(_unused_layer_worker, 2)
    torch.testing.assert_close(results[0]["side"], results[1]["side"], rtol=0, atol=0)
    all_inputs = torch.cat([results[0]["inputs"], results[1]["inputs"]])
    augmented = torch.cat([all_inputs, torch.ones(8, 1, dtype=torch.float64)], dim=1)
    torch.testing.assert_close(results[0]["trunk"], augmented.T @ augmented / 8)


def _disagreeing_worker(rank: int, world_size: int, case: str) -> str:
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    options: dict[str, object] = {}
    if case == "config" and rank == 1:
        options["damping"] = 0.01
    if case == "layers" and rank == 1:
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    if case == "empty" and rank == 1:
        model = nn.Sequential(nn.BatchNorm1d(3))
    try:
        KFACPreconditioner(model, **options)  # type: ignore[arg-type]
    except ValueError as error:
        return f"ValueError: {error}"
    return "ok"


@pytest.mark.parametrize("case", ["config", "layers", "empty"])
def test_ranks_that_disagree_fail_on_every_rank(case: str) -> None:
    results = run_distributed(_disagreeing_worker, 2, case, timeout=60)
    assert all(r.startswith("ValueError") for r in results), results
    if case != "empty":
        assert all("ranks disagree" in r for r in results)


def _cost_model_worker(rank: int, world_size: int) -> tuple[int, ...]:
    from spdkfac.costmodel import DEFAULT_COST_MODEL, AlphaBetaModel, CostModel

    # Each rank "measured" a different link: rank 0's model must decide on every rank.
    beta = 1e-12 if rank == 0 else 1e-3
    costs = CostModel(
        DEFAULT_COST_MODEL.inverse, AlphaBetaModel(0.0, beta), AlphaBetaModel(0.0, beta)
    )
    model = nn.Sequential(nn.Linear(30, 40), nn.Linear(40, 20))
    return KFACPreconditioner(model, cost_model=costs).plan.owners


def test_plans_agree_when_cost_models_differ() -> None:
    owners = run_distributed(_cost_model_worker, 2)
    assert owners[0] == owners[1]
    assert -1 not in owners[0]  # rank 0's nearly free broadcasts: everything communicated


def _non_member_worker(rank: int, world_size: int) -> str:
    group = dist.new_group(ranks=[0, 1])
    if rank == 2:
        try:
            KFACPreconditioner(nn.Linear(2, 2), process_group=group)
        except ValueError as error:
            result = str(error)
        else:
            result = "no error"
    else:
        precond = KFACPreconditioner(nn.Linear(2, 2), process_group=group)
        result = f"ok {precond.communicator.world_size}"
    # No rank leaves (closing its connections) while the others still connect the
    # subgroup: under load an early exit failed their gloo connectFullMesh.
    dist.barrier()
    return result


def test_process_group_this_rank_is_not_in() -> None:
    results = run_distributed(_non_member_worker, 3)
    assert results[:2] == ["ok 2", "ok 2"]
    assert "not a member" in results[2]


def test_unknown_strategy_or_placement() -> None:
    with pytest.raises(ValueError, match="strategy must be one of"):
        KFACPreconditioner(nn.Linear(2, 2), strategy="kfac")
    with pytest.raises(ValueError, match="placement must be one of"):
        KFACPreconditioner(nn.Linear(2, 2), placement="random")
