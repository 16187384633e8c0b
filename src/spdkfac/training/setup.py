"""Building a run's pieces from its config: image datasets, model, schedules, optimizers.

(Text data is loaded by :class:`spdkfac.training.tasks.TextTask`.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from spdkfac.config import KFACConfig
from spdkfac.data import load_fashion_mnist
from spdkfac.data.cifar10 import load_cifar10
from spdkfac.data.imagefolder import load_image_folder
from spdkfac.preconditioner import KFACPreconditioner
from spdkfac.training.config import TrainConfig
from spdkfac.training.kfac_options import hidden_layers_only
from spdkfac.training.lr_schedules import cosine_lr, polynomial_lr, step_lr
from spdkfac.training.optimizer_table import OPTIMIZER_TABLE
from spdkfac.training.optimizers import BASE_OPTIMIZERS, build_base_optimizer, hidden_layers

__all__ = [
    "BASE_OPTIMIZERS",
    "IMAGE_LOADERS",
    "LR_SCHEDULE_BUILDERS",
    "VALIDATION_SEED",
    "build_schedules",
    "configure_cpu",
    "load_datasets",
    "make_optimizers",
    "schedule_epochs",
    "split_validation",
    "warmup_epochs",
]

FloatFn = Callable[[int], float]


@contextlib.contextmanager
def configure_cpu(threads: int | None, *, flush_denormal: bool) -> Iterator[None]:
    """Within the block: this process's intra-op threads (None: as they are) and whether the
    CPU treats subnormal floats as zero (``torch.set_flush_denormal``; where the CPU cannot,
    nothing changes); both are as before again after it. Subnormals cost tens of times a
    normal operation on x86 CPUs; a transformer's softmax can make them once its attention
    sharpens (a 2-rank GPT step under K-FAC grew from 52 to 69 ms over 600 steps here, and
    stayed at 50 ms with them flushed)."""
    threads_before = torch.get_num_threads()
    flushing_before = _flushing()
    if threads is not None:
        torch.set_num_threads(threads)
    torch.set_flush_denormal(flush_denormal)
    try:
        yield
    finally:
        torch.set_num_threads(threads_before)
        torch.set_flush_denormal(flushing_before)


def _flushing() -> bool:
    """Whether subnormal floats are flushed now (torch has no getter: a float64 subnormal
    reads as zero then)."""
    return torch.tensor([1e-323], dtype=torch.float64).item() == 0.0


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


def warmup_epochs(config: TrainConfig, steps_per_epoch: int) -> float:
    """The linear warm-up's length in epochs: ``warmup_steps`` when given, else
    ``warmup_epochs``."""
    if config.warmup_steps is not None:
        return config.warmup_steps / steps_per_epoch
    return config.warmup_epochs


def schedule_epochs(config: TrainConfig, steps_per_epoch: int) -> float:
    """Where a decaying schedule ends, in epochs: ``lr_schedule_steps`` when given (a
    schedule may end before the run, or within an epoch), else ``epochs``."""
    if config.lr_schedule_steps is not None:
        return config.lr_schedule_steps / steps_per_epoch
    return float(config.epochs)


#: Seed of the held-out permutation: every run (whatever its ``--seed``) holds out the same
#: examples, so the trials of a study are scored on one validation split.
VALIDATION_SEED = 0


def split_validation(train: TensorDataset, fraction: float) -> tuple[TensorDataset, TensorDataset]:
    """(train, validation): a fixed random ``fraction`` of the training examples held out.

    Both keep the examples' original order.

    Raises:
        ValueError: ``fraction`` leaves no example on one side.
    """
    count = round(len(train) * fraction)
    if not 0 < count < len(train):
        raise ValueError(
            f"val_split {fraction} of {len(train)} training examples holds out {count}; "
            "both sides need at least one"
        )
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(VALIDATION_SEED))
    held, kept = order[:count].sort().values, order[count:].sort().values
    return (
        TensorDataset(*(t[kept] for t in train.tensors)),
        TensorDataset(*(t[held] for t in train.tensors)),
    )


def _polynomial(config: TrainConfig, steps_per_epoch: int) -> FloatFn:
    return polynomial_lr(
        config.lr,
        steps_per_epoch=steps_per_epoch,
        epoch_start=config.poly_start_epoch,
        epoch_end=config.poly_end_epoch or schedule_epochs(config, steps_per_epoch),
        power=config.poly_power,
        warmup_epochs=warmup_epochs(config, steps_per_epoch),
    )


def _cosine(config: TrainConfig, steps_per_epoch: int) -> FloatFn:
    return cosine_lr(
        config.lr,
        steps_per_epoch=steps_per_epoch,
        total_epochs=schedule_epochs(config, steps_per_epoch),
        warmup_epochs=warmup_epochs(config, steps_per_epoch),
    )


def _step(config: TrainConfig, steps_per_epoch: int) -> FloatFn:
    return step_lr(
        config.lr,
        steps_per_epoch=steps_per_epoch,
        milestones=config.milestones,
        gamma=config.lr_gamma,
        warmup_epochs=warmup_epochs(config, steps_per_epoch),
    )


def _constant(config: TrainConfig, steps_per_epoch: int) -> FloatFn:
    return step_lr(
        config.lr,
        steps_per_epoch=steps_per_epoch,
        milestones=(),
        gamma=1.0,
        warmup_epochs=warmup_epochs(config, steps_per_epoch),
    )


#: The schedules of :data:`spdkfac.training.config.LR_SCHEDULES`, by name.
LR_SCHEDULE_BUILDERS: dict[str, Callable[[TrainConfig, int], FloatFn]] = {
    "constant": _constant,
    "step": _step,
    "cosine": _cosine,
    "polynomial": _polynomial,
}


def build_schedules(config: TrainConfig, steps_per_epoch: int) -> tuple[FloatFn, KFACConfig]:
    """(lr as a function of the step, the K-FAC options with ``kfac_schedules`` applied).

    Raises:
        ValueError: When the options do not make a valid schedule (e.g. a polynomial decay
            starting before the warm-up ends).
    """
    lr = LR_SCHEDULE_BUILDERS[config.lr_schedule](config, steps_per_epoch)
    return lr, config.kfac_schedules.applied_to(config.kfac)


def make_optimizers(
    config: TrainConfig, model: nn.Module, steps_per_epoch: int
) -> tuple[FloatFn, torch.optim.Optimizer, KFACPreconditioner | None]:
    """(lr schedule, base optimizer, K-FAC or None) for ``model``, as the options ask.

    ``model`` is what the forward pass runs (wrapped in ``DistributedDataParallel`` under
    more than one rank); K-FAC is constructed on it, a collective when there are ranks.
    """
    lr, kfac = build_schedules(config, steps_per_epoch)
    optimizer = build_base_optimizer(config, model, lr(0))
    if not config.uses_kfac:
        return lr, optimizer, None
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    if OPTIMIZER_TABLE[config.optimizer].hidden_only:
        kfac = hidden_layers_only(kfac, set(hidden_layers(inner)), inner)
    # The KL clip reads each layer's learning rate from the optimizer: the trainer sets
    # the schedule's lr(step) on it before every step, so the clip sees that rate.
    return lr, optimizer, KFACPreconditioner(model, config=kfac, optimizer=optimizer)
