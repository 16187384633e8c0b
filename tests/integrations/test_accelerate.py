"""KFACOptimizer through Hugging Face ``accelerate``: ``Accelerator().prepare(model,
optimizer, dataloader)`` on 2 CPU processes (gloo), equal to the hand-written DDP loop and
to single-process K-FAC on the global batch (float64); ``save_state`` / ``load_state``
resume it exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from distributed_helper import run_distributed
from spdkfac import KFACOptimizer, KFACPreconditioner

pytest.importorskip("accelerate", reason="accelerate is not installed")

OPTIONS = {"damping": 0.01, "factor_update_steps": 1, "inv_update_steps": 2}
STEPS = 3
SAVED_AT = 2  # steps before accelerator.save_state
PER_RANK = 4  # rows per rank and step: a global batch of 8 at world 2


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _rows() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(11)
    inputs = torch.randn(2 * STEPS * PER_RANK, 5, generator=g, dtype=torch.float64)
    return inputs, torch.randn(2 * STEPS * PER_RANK, 3, generator=g, dtype=torch.float64)


def _base(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _params(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _accelerated(folder: str) -> tuple[dict[str, Tensor], int]:
    from accelerate import Accelerator

    # --8<-- [start:accelerate]
    accelerator = Accelerator(cpu=True)
    model = _net()
    optimizer = KFACOptimizer(model, _base(model), **OPTIONS)
    loader = DataLoader(TensorDataset(*_rows()), batch_size=PER_RANK)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, (inputs, targets) in enumerate(loader):
        optimizer.zero_grad()
        accelerator.backward(F.mse_loss(model(inputs), targets))
        optimizer.step()
        if step + 1 == SAVED_AT:
            accelerator.save_state(folder)
    # --8<-- [end:accelerate]
    assert isinstance(model, DistributedDataParallel)
    return _params(model.module), optimizer.optimizer.preconditioner.steps


def _resumed(folder: str) -> dict[str, Tensor]:
    """A fresh model and wrapper (other initial weights) resumed from ``save_state``."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = _net(seed=1)
    optimizer = KFACOptimizer(model, _base(model), **OPTIONS)
    loader = DataLoader(TensorDataset(*_rows()), batch_size=PER_RANK)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # --8<-- [start:accelerate-resume]
    accelerator.load_state(folder)
    for inputs, targets in accelerator.skip_first_batches(loader, SAVED_AT):
        optimizer.zero_grad()
        accelerator.backward(F.mse_loss(model(inputs), targets))
        optimizer.step()
    # --8<-- [end:accelerate-resume]
    assert optimizer.optimizer.preconditioner.steps == STEPS
    return _params(model.module)


def _prepared_first() -> dict[str, Tensor]:
    """The model prepared (wrapped in DDP) before the wrapper is built over it: the
    preconditioner then leaves the gradient averaging to DDP."""
    from accelerate import Accelerator

    # --8<-- [start:accelerate-ddp-first]
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_net())
    optimizer = KFACOptimizer(model, _base(model), **OPTIONS)
    loader = DataLoader(TensorDataset(*_rows()), batch_size=PER_RANK)
    optimizer, loader = accelerator.prepare(optimizer, loader)
    # --8<-- [end:accelerate-ddp-first]
    for inputs, targets in loader:
        optimizer.zero_grad()
        accelerator.backward(F.mse_loss(model(inputs), targets))
        optimizer.step()
    assert isinstance(model, DistributedDataParallel)
    return _params(model.module)


def _by_hand_ddp(rank: int, world_size: int) -> dict[str, Tensor]:
    """accelerate's sharding by hand: rank r takes batch ``world_size * step + r``."""
    model = DistributedDataParallel(_net())
    optimizer = _base(model)
    precond = KFACPreconditioner(model, optimizer=optimizer, **OPTIONS)
    inputs, targets = _rows()
    for step in range(STEPS):
        begin = (world_size * step + rank) * PER_RANK
        optimizer.zero_grad()
        F.mse_loss(
            model(inputs[begin : begin + PER_RANK]), targets[begin : begin + PER_RANK]
        ).backward()
        if precond.step():
            optimizer.step()
    return _params(model.module)


def _rank(rank: int, world_size: int, folder: str) -> dict[str, object]:
    params, steps = _accelerated(folder)
    return {
        "accelerate": params,
        "resumed": _resumed(folder),
        "prepared first": _prepared_first(),
        "steps": steps,
        "by_hand": _by_hand_ddp(rank, world_size),
    }


def _single_process() -> dict[str, Tensor]:
    model = _net()
    optimizer = _base(model)
    precond = KFACPreconditioner(model, optimizer=optimizer, **OPTIONS)
    inputs, targets = _rows()
    for step in range(STEPS):
        rows = slice(2 * step * PER_RANK, 2 * (step + 1) * PER_RANK)
        optimizer.zero_grad()
        F.mse_loss(model(inputs[rows]), targets[rows]).backward()
        if precond.step():
            optimizer.step()
    return _params(model)


def test_prepare_at_world_two_equals_hand_written_ddp_loop_and_resumes(tmp_path: Path) -> None:
    # The variables torchrun (or ``accelerate launch``) would set beside RANK and WORLD_SIZE.
    env = {"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    results = run_distributed(_rank, 2, str(tmp_path / "state"), timeout=120, env=env)
    reference = _single_process()
    for result in results:
        assert result["steps"] == STEPS
        for name, expected in result["by_hand"].items():
            for run in ("accelerate", "prepared first", "resumed"):
                torch.testing.assert_close(
                    result[run][name], expected, rtol=1e-9, atol=1e-12, msg=f"{run} {name}"
                )
            torch.testing.assert_close(expected, reference[name], rtol=1e-9, atol=1e-12, msg=name)
