"""Sharded models spdkfac does not support get a ``ValueError`` naming what is supported,
on every rank and before any collective: FSDP1 and a model ``fully_shard``-ed after the
preconditioner was built (tensor-parallel forms: tests/distributed/test_tensor_parallel.py).
And an FSDP2 step issues no DTensor collective of its own (every gather is the
Communicator's)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distributed_helper import run_distributed
from fsdp_cases import conv_net, global_part, shard
from parallel_cases import batch
from spdkfac import KFACPreconditioner


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()


def _refused(build: Callable[[], Any]) -> str:
    try:
        build()
    except ValueError as error:
        return str(error)
    return "accepted"


def _fsdp1(mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(_mlp(), device_id=torch.device("cpu"))


def _inputs_worker(rank: int, world_size: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    out = {
        "fsdp1": _refused(lambda: KFACPreconditioner(_fsdp1(mesh))),
    }
    # Sharded after the preconditioner was built: refused at the first step.
    model = conv_net()
    precond = KFACPreconditioner(model, lr=0.1)
    shard(model, mesh)
    inputs, targets = batch(0)
    begin, end = global_part("conv", rank, world_size)
    F.cross_entropy(model(inputs[begin:end]), targets[begin:end]).backward()
    out["after"] = _refused(precond.step)
    return out


def test_unsupported_sharding_is_refused_naming_what_is_supported() -> None:
    for out in run_distributed(_inputs_worker, 2, timeout=120):
        assert "FullyShardedDataParallel (FSDP1" in out["fsdp1"], out["fsdp1"]
        assert "supported: FSDP2" in out["fsdp1"], out["fsdp1"]
        assert "replaced after KFACPreconditioner(model) was built" in out["after"], out["after"]
        assert "fully_shard" in out["after"]


def _no_dtensor_collective_worker(rank: int, world_size: int, strategy: str) -> dict[str, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (world_size,))
    model = shard(conv_net(), mesh)
    precond = KFACPreconditioner(model, strategy=strategy, lr=0.1)
    counts = {}
    for step in range(2):
        model.zero_grad()
        inputs, targets = batch(step)
        begin, end = global_part("conv", rank, world_size)
        F.cross_entropy(model(inputs[begin:end]), targets[begin:end]).backward()
        mode = CommDebugMode()
        with mode:
            assert precond.step()
        counts[f"step {step}"] = sum(
            n for op, n in mode.get_comm_counts().items() if "functional" in str(op)
        )
    return counts


def test_a_step_issues_no_dtensor_collective_of_its_own() -> None:
    for strategy in ("d-kfac", "osawa"):
        for out in run_distributed(_no_dtensor_collective_worker, 2, strategy):
            assert out == {"step 0": 0, "step 1": 0}, (strategy, out)
