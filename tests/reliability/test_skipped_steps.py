"""A skipped step leaves no trace (M17): a non-finite gradient on one rank at step K,
then finite steps, ends with the state and parameters of the run that never saw that
batch — factors, inverses and the stateful forms' moments (eigen-Adam, Adam grafting),
under the owner strategies as under spd-kfac, plain, DDP and FSDP2, at worlds 1 and 2."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_helper import run_distributed
from fsdp_cases import conv_net, full_params, shard
from parallel_cases import batch, bounds
from spdkfac import KFACPreconditioner

BAD_STEP, STEPS = 2, 5
FORMS: tuple[dict[str, Any], ...] = (
    {"inverse_method": "eigen-adam", "kl_clip": None},
    {"grafting": "adam"},
    {},  # stateless control
)
CASES = [
    (strategy, form)
    for strategy in ("osawa", "layer-paths", "spd-kfac")
    for form in FORMS
    if strategy != "spd-kfac" or form
]


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Tensor]]:
    if isinstance(value, Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{path}/{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _leaves(item, f"{path}/{index}")


def _wrap(model: nn.Module, layout: str, world_size: int) -> nn.Module:
    if layout == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        return shard(model, init_device_mesh("cpu", (world_size,)))
    return model


def _run(rank: int, world_size: int, layout: str, options: dict[str, Any], poison: bool) -> Any:
    """Train STEPS steps; with ``poison`` the last rank's gradient at BAD_STEP is NaN
    (the step must be skipped everywhere), without it that batch is left out."""
    model = _wrap(conv_net(), layout, world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"damping": 0.05, "kl_clip": 1e-2, **options}
    precond = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1, **options)
    begin, end = bounds(rank, world_size)
    applied = []
    for step in range(STEPS):
        if step == BAD_STEP and not poison:
            continue
        optimizer.zero_grad()
        images, labels = batch(step)
        F.cross_entropy(model(images[begin:end]), labels[begin:end]).backward()
        if step == BAD_STEP and rank == world_size - 1:
            grad = next(p for p in model.parameters() if p.grad is not None).grad
            assert grad is not None
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[:1] = float("nan")
        applied.append(precond.step())
        if applied[-1]:
            optimizer.step()
    state = {k: v.detach().clone() for k, v in _leaves(precond.state_dict())}
    return applied, state, full_params(model), precond.skipped_steps


def _worker(rank: int, world_size: int, layout: str) -> list[str]:
    checked = []
    for strategy, form in CASES:
        options = {"strategy": strategy, **form}
        label = f"{layout} {world_size} {options}"
        applied, state, params, skipped = _run(rank, world_size, layout, options, True)
        _, clean_state, clean_params, _ = _run(rank, world_size, layout, options, False)
        assert applied == [True, True, False, True, True], label
        assert skipped == 1, label
        assert state.keys() == clean_state.keys(), label
        for key, expected in clean_state.items():
            torch.testing.assert_close(
                state[key].double(), expected.double(), rtol=1e-9, atol=1e-12,
                msg=f"{label} {key}",
            )  # fmt: skip
        for name, expected in clean_params.items():
            torch.testing.assert_close(params[name], expected, rtol=1e-9, atol=1e-12)
        checked.append(label)
    if dist.is_initialized():
        dist.barrier()
    return checked


def test_a_skipped_step_leaves_no_trace_at_one_rank() -> None:
    results = run_distributed(_worker, 1, "plain", timeout=180)
    assert len(results[0]) == len(CASES)


@pytest.mark.parametrize("layout", ["plain", "ddp", "fsdp"])
def test_a_skipped_step_leaves_no_trace_at_two_ranks(layout: str) -> None:
    results = run_distributed(_worker, 2, layout, timeout=240)
    assert all(len(r) == len(CASES) for r in results)
