"""A tensor-parallel run's model and preconditioner state through
``torch.distributed.checkpoint``: saved under FSDP2 × TP (2 × 2, d-kfac and osawa), loaded
into fresh ones there and under tensor parallelism alone (world 2, one data-parallel
rank: another dp size), training continuing as the uninterrupted run."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_helper import run_distributed
from spdkfac import KFACPreconditioner
from tp_cases import CLASSES, OPTIONS, block, parallelize, tp_batch

SAVED_AT = 2  # steps before the checkpoint
MORE = 2  # steps after it
STRATEGIES = ("d-kfac", "osawa")


def _full(tensor: Tensor) -> Tensor:
    full = getattr(tensor, "full_tensor", None)
    value = full() if full is not None else tensor
    assert isinstance(value, Tensor)
    return value.detach().clone()


def _run(model: nn.Module, strategy: str, part: tuple[int, int]) -> tuple[Any, ...]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no optimizer state
    precond = KFACPreconditioner(model, optimizer=optimizer, strategy=strategy, **OPTIONS)
    return model, precond, optimizer, part


def _steps(run: tuple[Any, ...], steps: range) -> None:
    model, precond, optimizer, (begin, end) = run
    for step in steps:
        optimizer.zero_grad()
        inputs, targets = tp_batch(step)
        logits = model(inputs[begin:end])
        F.cross_entropy(logits.reshape(-1, CLASSES), targets[begin:end].reshape(-1)).backward()
        assert precond.step()
        optimizer.step()


def _resume(run: tuple[Any, ...], path: str) -> dict[str, Tensor]:
    model, precond = run[0], run[1]
    state = {"model": model.state_dict(), "kfac": precond.dcp_state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    precond.load_dcp_state_dict(state["kfac"])
    _steps(run, range(SAVED_AT, SAVED_AT + MORE))
    return {n: _full(p) for n, p in model.named_parameters()}


def _fsdp_tp(mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(parallelize(block(), mesh["tp"], sequence=True), mesh=mesh["dp"])
    assert isinstance(model, nn.Module)
    return model


def _save_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    part = (2 * dp, 2 * dp + 2)
    out: dict[str, Any] = {}
    for strategy in STRATEGIES:
        path = os.path.join(root, strategy)
        run = _run(_fsdp_tp(mesh), strategy, part)
        _steps(run, range(SAVED_AT))
        state = {"model": run[0].state_dict(), "kfac": run[1].dcp_state_dict()}
        dcp.save(state, checkpoint_id=path)
        _steps(run, range(SAVED_AT, SAVED_AT + MORE))
        out[f"{strategy}/uninterrupted"] = {n: _full(p) for n, p in run[0].named_parameters()}
        out[f"{strategy}/resumed"] = _resume(_run(_fsdp_tp(mesh), strategy, part), path)
    return out


def _tp_resume_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    out = {}
    for strategy in STRATEGIES:
        run = _run(parallelize(block(), mesh, sequence=True), strategy, (0, 4))
        out[strategy] = _resume(run, os.path.join(root, strategy))
    return out


def test_tensor_parallel_state_round_trips_through_dcp(tmp_path: Any) -> None:
    root = str(tmp_path)
    saved = run_distributed(_save_worker, 4, root, timeout=240)
    resumed = run_distributed(_tp_resume_worker, 2, root, timeout=240)
    for strategy in STRATEGIES:
        expected = saved[0][f"{strategy}/uninterrupted"]
        finals = [out[f"{strategy}/resumed"] for out in saved] + [out[strategy] for out in resumed]
        for index, final in enumerate(finals):
            assert set(final) == set(expected)
            for name, value in expected.items():
                torch.testing.assert_close(
                    final[name], value, rtol=1e-9, atol=1e-11, msg=f"{strategy} {index} {name}"
                )
