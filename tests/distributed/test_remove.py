"""``remove()`` under DDP: the preconditioner's own process groups are destroyed, and
DDP's own all-reduce averages the gradients of the steps after it, also after an
owner-computes strategy reduced them to their owners only."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from distributed_helper import run_distributed
from parallel_cases import batch, bounds, grads
from spdkfac import KFACPreconditioner
from tiny_models import conv_net


def _groups() -> int:
    return len(c10d._world.pg_map)  # private, but the only count torch keeps


#: Strategy options -> process groups the preconditioner creates.
CASES = (
    ({"strategy": "spd-kfac", "comm_scheduler": "priority"}, 2),  # scheduler, pipeline
    ({"strategy": "osawa"}, 0),  # buckets reduced to owners by the DDP hook
)


def _worker(rank: int, world_size: int, options: dict[str, str]) -> dict[str, object]:
    torch.manual_seed(0)
    model = conv_net().double()
    ddp = DistributedDataParallel(model)
    before = _groups()
    precond = KFACPreconditioner(ddp, damping=0.05, kl_clip=None, lr=0.1, **options)
    created = _groups() - before
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    low, high = bounds(rank, world_size)
    for step in range(4):
        if step == 2:
            precond.remove()
        optimizer.zero_grad()
        inputs, targets = batch(step)
        F.cross_entropy(ddp(inputs[low:high][..., :4, :4]), targets[low:high]).backward()
        if step < 2:
            assert precond.step()
        optimizer.step()
    return {"created": created, "left": _groups() - before, "grads": grads(model)}


@pytest.mark.parametrize(("options", "groups"), CASES)
def test_remove_releases_the_groups_it_created_and_ddp_averages_again(
    options: dict[str, str], groups: int
) -> None:
    first, second = run_distributed(_worker, 2, options, timeout=60)
    assert first["created"] == second["created"] == groups
    assert first["left"] == second["left"] == 0
    # The ranks trained on different halves of the batch: equal gradients after remove()
    # mean DDP averaged them.
    for name, grad in first["grads"].items():
        torch.testing.assert_close(grad, second["grads"][name])
