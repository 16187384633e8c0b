"""``make_optimizers``: the KL clip reads the scheduled lr from the optimizer; data limits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from spdkfac.cli.main import build_parser
from spdkfac.cli.train import _config_from_args
from spdkfac.config import KFACConfig
from spdkfac.preconditioner import KFACPreconditioner
from spdkfac.training.config import LR_SCHEDULES, TrainConfig
from spdkfac.training.loop import cross_entropy_pass, train_step
from spdkfac.training.lr_schedules import apply_to_optimizer
from spdkfac.training.setup import (
    LR_SCHEDULE_BUILDERS,
    configure_cpu,
    load_datasets,
    make_optimizers,
)

__all__: list[str] = []


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def test_the_clip_sees_the_scheduled_lr_exactly_as_the_old_callable() -> None:
    # A tight KL clip, so every step is clipped and the lr enters every update.
    kfac = KFACConfig(damping=0.1, kl_clip=1e-5, inv_update_steps=2)
    config = TrainConfig(model="mlp", lr=0.5, lr_schedule="cosine", warmup_epochs=1.0,
                         epochs=2, kfac=kfac)  # fmt: skip
    steps_per_epoch = 3
    ours = _model()
    lr_fn, optimizer, precond = make_optimizers(config, ours, steps_per_epoch)
    assert precond is not None and precond.config.lr is None  # read from the optimizer
    theirs = _model()
    reference = torch.optim.SGD(theirs.parameters(), lr=lr_fn(0), momentum=0.9,
                                weight_decay=config.weight_decay)  # fmt: skip
    old = KFACPreconditioner(theirs, damping=0.1, kl_clip=1e-5, inv_update_steps=2, lr=lr_fn)
    generator = torch.Generator().manual_seed(1)
    for step in range(2 * steps_per_epoch):
        inputs = torch.randn(5, 6, generator=generator)
        targets = torch.randint(0, 3, (5,), generator=generator)
        for model, opt, kfac in ((ours, optimizer, precond), (theirs, reference, old)):
            train_step(model, opt, kfac, [cross_entropy_pass(model, inputs, targets)])
            apply_to_optimizer(opt, step + 1, lr=lr_fn)  # what the trainer does
    assert lr_fn(1) != lr_fn(4)  # the schedule moved
    for mine, expected in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(mine, expected)


def test_every_lr_schedule_has_a_builder() -> None:
    assert set(LR_SCHEDULE_BUILDERS) == set(LR_SCHEDULES)


def test_train_limit_keeps_the_first_images(tiny_fashion_mnist: Path) -> None:
    full, *_ = load_datasets(TrainConfig(data=str(tiny_fashion_mnist)))
    limited, test, classes, channels, size = load_datasets(
        TrainConfig(data=str(tiny_fashion_mnist), train_limit=40)
    )
    assert len(limited) == 40 and len(test) == 64 and (classes, channels, size) == (10, 1, 28)
    for part, whole in zip(limited.tensors, full.tensors, strict=True):
        assert torch.equal(part, whole[:40])
    with pytest.raises(ValueError, match="train_limit applies to image datasets only"):
        TrainConfig(model="gpt", dataset="text", train_limit=10)


def test_subnormal_floats_are_flushed_unless_the_run_keeps_them() -> None:
    assert TrainConfig().flush_denormal
    args = build_parser().parse_args(["train", "--no-flush-denormal"])
    assert _config_from_args(args).flush_denormal is False
    threads = torch.get_num_threads()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormal floats")
    torch.set_flush_denormal(False)

    def kept() -> bool:
        return torch.tensor([1e-323], dtype=torch.float64).item() > 0

    with configure_cpu(None, flush_denormal=False):
        assert kept()
        with configure_cpu(threads + 1, flush_denormal=True):
            assert not kept()
            assert torch.get_num_threads() == threads + 1
        assert kept()  # both as before the block again
        assert torch.get_num_threads() == threads
