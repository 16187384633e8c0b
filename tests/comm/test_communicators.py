"""Communicator collectives on real gloo ranks, and the local one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed_helper import run_distributed
from spdkfac.comm import LocalCommunicator, TorchDistributedCommunicator, make_communicator


def _collectives(rank: int, world_size: int) -> dict[str, object]:
    comm = TorchDistributedCommunicator()
    summed = comm.all_reduce_sum(torch.full((3,), float(rank + 1)))
    averaged = comm.all_reduce_average(torch.full((2,), float(rank)))
    maximum = comm.all_reduce_max(torch.tensor([float(rank), -float(rank)]))
    last = world_size - 1
    broadcasted = comm.broadcast(torch.full((4,), float(rank * 10)), src=last)
    gathered = comm.all_gather(torch.tensor([rank, rank * rank]))
    return {
        "rank": comm.rank,
        "sum": summed.wait(),
        "avg": averaged.wait(),
        "max": maximum.wait(),
        "bcast": broadcasted.wait(),
        "gather": gathered.wait(),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_distributed_collectives(world_size: int) -> None:
    results = run_distributed(_collectives, world_size)
    total = sum(range(1, world_size + 1))
    for rank, out in enumerate(results):
        assert out["rank"] == rank
        torch.testing.assert_close(out["sum"], torch.full((3,), float(total)))
        torch.testing.assert_close(out["avg"], torch.full((2,), (world_size - 1) / 2))
        torch.testing.assert_close(out["max"], torch.tensor([world_size - 1.0, 0.0]))
        torch.testing.assert_close(out["bcast"], torch.full((4,), float((world_size - 1) * 10)))
        assert [t.tolist() for t in out["gather"]] == [[r, r * r] for r in range(world_size)]


def _subgroup(rank: int, world_size: int) -> str:
    group = dist.new_group(ranks=[0, 1])
    try:
        comm = TorchDistributedCommunicator(group)
    except ValueError as error:
        result = f"error: {error}"
    else:
        value = comm.broadcast(torch.tensor([float(rank + 5)]), src=1).wait()
        result = f"ok {comm.rank}/{comm.world_size} {value.item()}"
    # Every rank waits for the others: a rank leaving early closes the store while the
    # subgroup's members may still be connecting (gloo connectFullMesh under load).
    dist.barrier()
    return result


def test_subgroup_and_non_member() -> None:
    results = run_distributed(_subgroup, 3)
    assert results[0] == "ok 0/2 6.0" and results[1] == "ok 1/2 6.0"
    assert results[2].startswith("error: process_group: this rank (2) is not a member")


def _disjoint_duplicates(rank: int, world_size: int) -> float:
    # Two data-parallel groups {0, 2} and {1, 3}, as on a 2 × 2 (dp, tp) mesh: each rank
    # duplicates only its own group, so the duplicate must not wait for the whole world.
    groups = [dist.new_group(ranks=[0, 2]), dist.new_group(ranks=[1, 3])]
    copy = TorchDistributedCommunicator(groups[rank % 2]).duplicate()
    value = copy.all_reduce_average(torch.tensor([float(rank)])).wait().item()
    dist.barrier()
    return value


def test_ranks_of_different_subgroups_duplicate_their_own_groups() -> None:
    assert run_distributed(_disjoint_duplicates, 4, timeout=60) == [1.0, 2.0, 1.0, 2.0]


def test_local_communicator_and_factory() -> None:
    comm = make_communicator()
    assert isinstance(comm, LocalCommunicator)
    tensor = torch.ones(2)
    assert comm.all_reduce_average(tensor).wait() is tensor
    assert comm.broadcast(tensor, 0).wait() is tensor
    assert comm.all_gather(tensor).wait() == [tensor]
    with pytest.raises(ValueError, match="src must be 0"):
        comm.broadcast(tensor, 1)
    with pytest.raises(ValueError, match="initialized"):
        TorchDistributedCommunicator()
