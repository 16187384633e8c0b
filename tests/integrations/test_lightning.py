"""KFACOptimizer under PyTorch Lightning's automatic optimization: ``configure_optimizers``
returns the wrapper and Lightning passes the closure; one process and DDP at world 2
(gloo), and a checkpoint round trip, against the hand-written loop in float64."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from distributed_helper import run_distributed
from spdkfac import KFACOptimizer, KFACPreconditioner

L = pytest.importorskip("lightning", reason="lightning (PyTorch Lightning) is not installed")

OPTIONS = {"damping": 0.01, "factor_update_steps": 1, "inv_update_steps": 2}
BATCH = 8  # rows of one global batch
STEPS = 4  # two epochs of two batches


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()


def _rows() -> tuple[Tensor, Tensor]:
    """One epoch: two global batches of ``BATCH`` rows."""
    g = torch.Generator().manual_seed(7)
    inputs = torch.randn(2 * BATCH, 5, generator=g, dtype=torch.float64)
    return inputs, torch.randn(2 * BATCH, 3, generator=g, dtype=torch.float64)


# --8<-- [start:lightning]
class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        return F.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> Any:
        base = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.1)
        # Over the model Lightning trains (DDP's wrapper under strategy="ddp"): the
        # preconditioner then leaves the gradient averaging to DDP.
        optimizer = KFACOptimizer(self.trainer.strategy.model, base, **OPTIONS)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def fit(
    module: Regression, epochs: int, loader: DataLoader, ckpt: Path | None = None, **trainer: Any
) -> Any:
    lightning = L.Trainer(
        max_epochs=epochs, precision="64-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **trainer,
    )  # fmt: skip
    lightning.fit(module, loader, ckpt_path=ckpt)
    return lightning


# --8<-- [end:lightning]


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(*_rows()), batch_size=BATCH)


def _by_hand(steps: int) -> nn.Module:
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    pre = KFACPreconditioner(model, optimizer=opt, **OPTIONS)
    inputs, targets = _rows()
    for step in range(steps):
        rows = slice((step % 2) * BATCH, (step % 2 + 1) * BATCH)
        opt.zero_grad()
        F.mse_loss(model(inputs[rows]), targets[rows]).backward()
        if pre.step():
            opt.step()
        sched.step()
    return model


def _close(expected: nn.Module, actual: nn.Module) -> None:
    torch.testing.assert_close(
        list(expected.parameters()), list(actual.parameters()), rtol=1e-9, atol=1e-12
    )


def test_automatic_optimization_equals_hand_written_loop_and_resumes(tmp_path: Path) -> None:
    module = Regression()
    trainer = fit(module, 2, _loader(), accelerator="cpu", devices=1)
    assert trainer.global_step == STEPS
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, KFACOptimizer)
    assert optimizer.preconditioner.steps == STEPS
    _close(_by_hand(STEPS), module.net)
    # A checkpoint after the first epoch, resumed into a fresh module: the same run.
    first = Regression()
    cut = fit(first, 1, _loader(), accelerator="cpu", devices=1)
    cut.save_checkpoint(tmp_path / "epoch1.ckpt")
    saved = torch.load(tmp_path / "epoch1.ckpt", weights_only=False)
    assert saved["optimizer_states"][0]["preconditioner"]["steps"] == 2
    resumed = Regression()
    again = fit(resumed, 2, _loader(), tmp_path / "epoch1.ckpt", accelerator="cpu", devices=1)
    assert again.optimizers[0].preconditioner.steps == STEPS
    _close(module.net, resumed.net)


def _ddp_rank(rank: int, world_size: int) -> dict[str, Tensor]:
    built_over = []
    init = KFACOptimizer.__init__

    def recording(self: KFACOptimizer, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        built_over.append(type(model))
        init(self, model, *args, **kwargs)

    KFACOptimizer.__init__ = recording  # type: ignore[method-assign]
    module = Regression()
    # Each rank half of each global batch, in order (Lightning's own sampler shuffles).
    dataset = TensorDataset(*_rows())
    sampler = DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=BATCH // world_size, sampler=sampler)
    trainer = fit(
        module, 2, loader, accelerator="cpu", devices=world_size, strategy="ddp",
        use_distributed_sampler=False,
    )  # fmt: skip
    assert isinstance(trainer.strategy, L.pytorch.strategies.DDPStrategy)
    assert trainer.world_size == world_size and trainer.global_step == STEPS
    # The recipe built the wrapper over DDP's module, so DDP alone averages the gradients.
    assert built_over == [nn.parallel.DistributedDataParallel]
    return {name: p.detach().clone() for name, p in module.net.named_parameters()}


def test_ddp_two_processes_equal_single_process_loop() -> None:
    """strategy="ddp" at world 2 under the repository's process helper: Lightning's own
    launcher re-runs ``sys.argv`` (pytest) in new processes, so the ranks are started here
    with torchelastic's variables and Lightning joins the process group they hold."""
    env = {"GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    results = run_distributed(_ddp_rank, 2, timeout=120, env=env)
    expected = dict(_by_hand(STEPS).named_parameters())
    for params in results:
        for name, value in params.items():
            torch.testing.assert_close(value, expected[name].detach(), rtol=1e-9, atol=1e-12)
