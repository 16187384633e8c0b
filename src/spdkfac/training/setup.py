"""Building a run's pieces from its config: image datasets, model, schedules, optimizers.

(Text data is loaded by :class:`spdkfac.training.tasks.TextTask`.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from spdkfac.data import load_fashion_mnist
from spdkfac.data.cifar10 import load_cifar10
from spdkfac.data.imagefolder import load_image_folder
from spdkfac.preconditioner import KFACPreconditioner
from spdkfac.schedules import damping_warmup, stale_interval
from spdkfac.training.config import TrainConfig
from spdkfac.training.lr_schedules import cosine_lr, polynomial_lr, step_lr

__all__ = [
    "BASE_OPTIMIZERS",
    "IMAGE_LOADERS",
    "LR_SCHEDULE_BUILDERS",
    "build_schedules",
    "load_datasets",
    "make_optimizers",
]

FloatFn = Callable[[int], float]
IntFn = Callable[[int], int]


ImageSplits = tuple[TensorDataset, TensorDataset, int, int, int]


def _fashion_mnist(config: TrainConfig) -> ImageSplits:
    train = load_fashion_mnist(config.data, train=True)
    test = load_fashion_mnist(config.data, train=False)
    return train, test, 10, 1, 28


def _cifar10(config: TrainConfig) -> ImageSplits:
    if config.data is None:
        raise FileNotFoundError("CIFAR-10 needs --data DIR with its python or binary batches")
    train = load_cifar10(config.data, train=True)
    return train, load_cifar10(config.data, train=False), 10, 3, 32


def _image_folder(config: TrainConfig) -> ImageSplits:
    if config.data is None:
        raise FileNotFoundError("imagefolder needs --data DIR with train/ and test/ class folders")
    train_set, classes = load_image_folder(f"{config.data}/train", size=config.image_size)
    test_set, _ = load_image_folder(f"{config.data}/test", size=config.image_size)
    return train_set, test_set, len(classes), 3, config.image_size


#: The image datasets of :data:`spdkfac.training.config.DATASETS`, by name.
IMAGE_LOADERS: dict[str, Callable[[TrainConfig], ImageSplits]] = {
    "fashion-mnist": _fashion_mnist,
    "cifar10": _cifar10,
    "imagefolder": _image_folder,
}


def load_datasets(config: TrainConfig) -> ImageSplits:
    """(train, test, classes, channels, image size); a missing path names itself.

    With ``train_limit`` the training set is its first ``train_limit`` images.
    """
    train, test, classes, channels, size = IMAGE_LOADERS[config.dataset](config)
    if config.train_limit is not None:
        train = TensorDataset(*(t[: config.train_limit] for t in train.tensors))
    return train, test, classes, channels, size


def _polynomial(config: TrainConfig, steps_per_epoch: int) -> FloatFn:
    return polynomial_lr(
        config.lr,
        steps_per_epoch=steps_per_epoch,
        epoch_start=config.poly_start_epoch,
        epoch_end=config.poly_end_epoch or float(config.epochs),
        power=config.poly_power,
        warmup_epochs=config.warmup_epochs,
    )


def _cosine(config: TrainConfig, steps_per_epoch: int) -> FloatFn:
    return cosine_lr(
        config.lr,
        steps_per_epoch=steps_per_epoch,
        total_epochs=float(config.epochs),
        warmup_epochs=config.warmup_epochs,
    )


def _step(config: TrainConfig, steps_per_epoch: int) -> FloatFn:
    return step_lr(
        config.lr,
        steps_per_epoch=steps_per_epoch,
        milestones=config.milestones,
        gamma=config.lr_gamma,
        warmup_epochs=config.warmup_epochs,
    )


def _constant(config: TrainConfig, steps_per_epoch: int) -> FloatFn:
    return step_lr(
        config.lr,
        steps_per_epoch=steps_per_epoch,
        milestones=(),
        gamma=1.0,
        warmup_epochs=config.warmup_epochs,
    )


#: The schedules of :data:`spdkfac.training.config.LR_SCHEDULES`, by name.
LR_SCHEDULE_BUILDERS: dict[str, Callable[[TrainConfig, int], FloatFn]] = {
    "constant": _constant,
    "step": _step,
    "cosine": _cosine,
    "polynomial": _polynomial,
}


def build_schedules(
    config: TrainConfig, steps_per_epoch: int
) -> tuple[FloatFn, float | FloatFn, int | IntFn, int | IntFn]:
    """(lr, damping, factor interval, inverse interval) as functions of the step.

    Raises:
        ValueError: When the options do not make a valid schedule (e.g. a polynomial decay
            starting before the warm-up ends).
    """
    lr = LR_SCHEDULE_BUILDERS[config.lr_schedule](config, steps_per_epoch)
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


def _sgd(config: TrainConfig, params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        params,
        lr=lr,
        momentum=config.momentum,
        nesterov=config.nesterov,
        weight_decay=config.weight_decay,
    )


def _adamw(config: TrainConfig, params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=config.weight_decay)


#: The base optimizers of :data:`spdkfac.training.config.OPTIMIZERS`, by name.
BASE_OPTIMIZERS: dict[
    str, Callable[[TrainConfig, Iterable[nn.Parameter], float], torch.optim.Optimizer]
] = {
    "sgd": _sgd,
    "adamw": _adamw,
}


def make_optimizers(
    config: TrainConfig, model: nn.Module, steps_per_epoch: int
) -> tuple[FloatFn, torch.optim.Optimizer, KFACPreconditioner | None]:
    """(lr schedule, SGD or AdamW, K-FAC or None) for ``model``, as the options ask.

    ``model`` is what the forward pass runs (wrapped in ``DistributedDataParallel`` under
    more than one rank); K-FAC is constructed on it, a collective when there are ranks.
    """
    lr, damping, factor_steps, inv_steps = build_schedules(config, steps_per_epoch)
    optimizer = BASE_OPTIMIZERS[config.base_optimizer](config, model.parameters(), lr(0))
    if not config.uses_kfac:
        return lr, optimizer, None
    precond = KFACPreconditioner(
        model,
        damping=damping,
        factor_decay=config.factor_decay,
        factor_update_steps=factor_steps,
        inv_update_steps=inv_steps,
        kl_clip=config.kl_clip,
        # The KL clip reads each layer's learning rate from the optimizer: the trainer sets
        # the schedule's lr(step) on it before every step, so the clip sees that rate.
        optimizer=optimizer,
        strategy=config.strategy,
        accumulation_steps=config.accumulation_steps,
        batchnorm=None if config.batchnorm == "off" else config.batchnorm,
        batchnorm_damping_multiplier=config.batchnorm_damping_multiplier,
    )
    return lr, optimizer, precond
