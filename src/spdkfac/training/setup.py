"""Building a run's pieces from its config: datasets, model, schedules, optimizers."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from spdkfac.data import load_fashion_mnist
from spdkfac.data.cifar10 import load_cifar10
from spdkfac.data.imagefolder import load_image_folder
from spdkfac.models import build_model
from spdkfac.preconditioner import KFACPreconditioner
from spdkfac.schedules import damping_warmup, stale_interval
from spdkfac.training.config import TrainConfig
from spdkfac.training.lr_schedules import cosine_lr, polynomial_lr, step_lr

__all__ = ["build_schedules", "load_datasets", "make_model", "make_optimizers"]

FloatFn = Callable[[int], float]
IntFn = Callable[[int], int]


def load_datasets(config: TrainConfig) -> tuple[TensorDataset, TensorDataset, int, int, int]:
    """(train, test, classes, channels, image size); a missing path names itself."""
    if config.dataset == "fashion-mnist":
        train = load_fashion_mnist(config.data, train=True)
        test = load_fashion_mnist(config.data, train=False)
        return train, test, 10, 1, 28
    if config.dataset == "cifar10":
        if config.data is None:
            raise FileNotFoundError("CIFAR-10 needs --data DIR with its python or binary batches")
        return (
            load_cifar10(config.data, train=True),
            load_cifar10(config.data, train=False),
            10,
            3,
            32,
        )
    if config.data is None:
        raise FileNotFoundError("imagefolder needs --data DIR with train/ and test/ class folders")
    train_set, classes = load_image_folder(f"{config.data}/train", size=config.image_size)
    test_set, _ = load_image_folder(f"{config.data}/test", size=config.image_size)
    return train_set, test_set, len(classes), 3, config.image_size


def make_model(config: TrainConfig, classes: int, channels: int, size: int) -> nn.Module:
    """The configured model for inputs of ``channels`` x ``size`` x ``size``."""
    return build_model(config.model, num_classes=classes, in_channels=channels, input_size=size)


def build_schedules(
    config: TrainConfig, steps_per_epoch: int
) -> tuple[FloatFn, float | FloatFn, int | IntFn, int | IntFn]:
    """(lr, damping, factor interval, inverse interval) as functions of the step.

    Raises:
        ValueError: When the options do not make a valid schedule (e.g. a polynomial decay
            starting before the warm-up ends).
    """
    warmup = config.warmup_epochs
    lr: FloatFn
    if config.lr_schedule == "polynomial":
        lr = polynomial_lr(
            config.lr,
            steps_per_epoch=steps_per_epoch,
            epoch_start=config.poly_start_epoch,
            epoch_end=config.poly_end_epoch or float(config.epochs),
            power=config.poly_power,
            warmup_epochs=warmup,
        )
    elif config.lr_schedule == "cosine":
        lr = cosine_lr(
            config.lr,
            steps_per_epoch=steps_per_epoch,
            total_epochs=float(config.epochs),
            warmup_epochs=warmup,
        )
    elif config.lr_schedule == "step":
        lr = step_lr(
            config.lr,
            steps_per_epoch=steps_per_epoch,
            milestones=config.milestones,
            gamma=config.lr_gamma,
            warmup_epochs=warmup,
        )
    else:
        lr = step_lr(
            config.lr,
            steps_per_epoch=steps_per_epoch,
            milestones=(),
            gamma=1.0,
            warmup_epochs=warmup,
        )
    damping: float | FloatFn = config.damping
    if config.damping_initial is not None and config.damping_warmup_steps > 0:
        damping = damping_warmup(
            config.damping_initial, config.damping, config.damping_warmup_steps
        )
    factor: int | IntFn = config.factor_update_steps
    inverse: int | IntFn = config.inv_update_steps
    if config.stale_switch_step is not None:
        factor = stale_interval(
            config.factor_update_steps,
            config.stale_factor_update_steps,
            config.stale_switch_step,
            growth_steps=config.stale_growth_steps,
        )
        inverse = stale_interval(
            config.inv_update_steps,
            config.stale_inv_update_steps,
            config.stale_switch_step,
            growth_steps=config.stale_growth_steps,
        )
    return lr, damping, factor, inverse


def make_optimizers(
    config: TrainConfig, model: nn.Module, steps_per_epoch: int
) -> tuple[FloatFn, torch.optim.SGD, KFACPreconditioner | None]:
    """(lr schedule, SGD, K-FAC or None) for ``model``, as the options ask.

    ``model`` is what the forward pass runs (wrapped in ``DistributedDataParallel`` under
    more than one rank); K-FAC is constructed on it, a collective when there are ranks.
    """
    lr, damping, factor_steps, inv_steps = build_schedules(config, steps_per_epoch)
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=lr(0),
        momentum=config.momentum,
        nesterov=config.nesterov,
        weight_decay=config.weight_decay,
    )
    if config.optimizer != "kfac":
        return lr, optimizer, None
    precond = KFACPreconditioner(
        model,
        damping=damping,
        factor_decay=config.factor_decay,
        factor_update_steps=factor_steps,
        inv_update_steps=inv_steps,
        kl_clip=config.kl_clip,
        lr=lr,
        strategy=config.strategy,
        accumulation_steps=config.accumulation_steps,
        batchnorm=None if config.batchnorm == "off" else config.batchnorm,
        batchnorm_damping_multiplier=config.batchnorm_damping_multiplier,
    )
    return lr, optimizer, precond
