"""Learning-rate and momentum schedules of the training recipe, and setting them.

Linear warm-up, step, cosine and Osawa et al.'s polynomial decay, as functions of the
optimizer step on the fractional epoch; momentum tied to the LR; and
:func:`apply_to_optimizer`, which writes a schedule's value into an optimizer. The K-FAC
schedules (damping warm-up, stale refresh intervals) are in :mod:`spdkfac.schedules`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from spdkfac.support.checks import check_int, check_number

__all__ = ["apply_to_optimizer", "cosine_lr", "momentum_for_lr", "polynomial_lr", "step_lr"]

# The schedules are small frozen dataclasses rather than closures so that they pickle
# (spawned workers receive the config), compare by value and print their parameters.


def _momentum(name: str, value: object) -> float:
    return check_number(name, value, low=0.0, low_inclusive=True, high=1.0, high_inclusive=False)


@dataclass(frozen=True)
class _Warmup:
    """Linear warm-up shared by the LR schedules: from ``start_lr`` to ``base_lr``."""

    base_lr: float
    steps_per_epoch: int
    epochs: float
    start_lr: float

    def epoch(self, step: int) -> float:
        return check_int("step", step, low=0) / self.steps_per_epoch

    def lr(self, epoch: float) -> float | None:
        """The warm-up LR at ``epoch``, or None once the warm-up is over."""
        if epoch >= self.epochs:
            return None
        return self.start_lr + (self.base_lr - self.start_lr) * epoch / self.epochs


def _warmup(
    base_lr: float, steps_per_epoch: int, warmup_epochs: float, warmup_start_lr: float
) -> _Warmup:
    steps_per_epoch = check_int("steps_per_epoch", steps_per_epoch, low=1)
    epochs = check_number("warmup_epochs", warmup_epochs, low_inclusive=True)
    start_lr = check_number("warmup_start_lr", warmup_start_lr, low_inclusive=True)
    return _Warmup(check_number("base_lr", base_lr), steps_per_epoch, epochs, start_lr)


@dataclass(frozen=True)
class _PolynomialLR:
    warmup: _Warmup
    epoch_start: float
    epoch_end: float
    power: float

    def __call__(self, step: int) -> float:
        epoch = self.warmup.epoch(step)
        warm = self.warmup.lr(epoch)
        if warm is not None:
            return warm
        if epoch < self.epoch_start:
            return self.warmup.base_lr
        if epoch >= self.epoch_end:
            return 0.0
        fraction = (epoch - self.epoch_start) / (self.epoch_end - self.epoch_start)
        return self.warmup.base_lr * math.pow(1.0 - fraction, self.power)


def polynomial_lr(
    base_lr: float,
    *,
    steps_per_epoch: int,
    epoch_start: float,
    epoch_end: float,
    power: float,
    warmup_epochs: float = 0.0,
    warmup_start_lr: float = 0.0,
) -> Callable[[int], float]:
    """Osawa et al.'s polynomial decay, on the fractional epoch ``e = step/steps_per_epoch``.

    ``η(e) = η₀`` for ``e < e_start``; ``η₀·(1 − (e − e_start)/(e_end − e_start))^p`` for
    ``e < e_end``; 0 after. An optional linear warm-up from ``warmup_start_lr`` to ``η₀``
    over the first ``warmup_epochs`` replaces the flat part there (Osawa et al. use none).
    Osawa et al. 2019 (CVPR, Sec. 4.3 and Table 3) give their values, e.g. η₀ = 8.18e-3,
    e_start = 1, e_end = 53, p = 11 at batch 4K.

    Args:
        base_lr: η₀, > 0.
        steps_per_epoch: Optimizer steps per epoch, an int >= 1.
        epoch_start: e_start, >= ``warmup_epochs``.
        epoch_end: e_end, > ``epoch_start``.
        power: p, > 0.
        warmup_epochs: Length of the linear warm-up in epochs, >= 0.
        warmup_start_lr: LR at step 0 when warming up, >= 0.

    Returns:
        A picklable ``schedule(step) -> η``.

    Raises:
        ValueError: If an argument is out of range (also for a negative step when called).
    """
    warmup = _warmup(base_lr, steps_per_epoch, warmup_epochs, warmup_start_lr)
    start = check_number("epoch_start", epoch_start, low_inclusive=True)
    if start < warmup.epochs:
        raise ValueError(f"epoch_start must be >= warmup_epochs ({warmup.epochs}), got {start!r}")
    end = check_number("epoch_end", epoch_end, low=start, low_inclusive=False)
    return _PolynomialLR(warmup, start, end, check_number("power", power))


@dataclass(frozen=True)
class _CosineLR:
    warmup: _Warmup
    total_epochs: float
    min_lr: float

    def __call__(self, step: int) -> float:
        epoch = self.warmup.epoch(step)
        warm = self.warmup.lr(epoch)
        if warm is not None:
            return warm
        if epoch >= self.total_epochs:
            return self.min_lr
        fraction = (epoch - self.warmup.epochs) / (self.total_epochs - self.warmup.epochs)
        cosine = 0.5 * (1.0 + math.cos(math.pi * fraction))
        return self.min_lr + (self.warmup.base_lr - self.min_lr) * cosine


def cosine_lr(
    base_lr: float,
    *,
    steps_per_epoch: int,
    total_epochs: float,
    min_lr: float = 0.0,
    warmup_epochs: float = 0.0,
    warmup_start_lr: float = 0.0,
) -> Callable[[int], float]:
    """Cosine decay after a linear warm-up, for the SGD baseline.

    With ``w`` = ``warmup_epochs`` and ``E`` = ``total_epochs``: linear from
    ``warmup_start_lr`` to ``base_lr`` for ``e < w``; then
    ``min_lr + (base_lr − min_lr)·(1 + cos(π·(e − w)/(E − w)))/2`` for ``e < E``;
    ``min_lr`` after.

    Args:
        base_lr: Peak LR, > 0.
        steps_per_epoch: Optimizer steps per epoch, an int >= 1.
        total_epochs: E, > ``warmup_epochs``.
        min_lr: Final LR, in [0, ``base_lr``].
        warmup_epochs: As in :func:`polynomial_lr`.
        warmup_start_lr: As in :func:`polynomial_lr`.

    Returns:
        A picklable ``schedule(step) -> η``.

    Raises:
        ValueError: As :func:`polynomial_lr`.
    """
    warmup = _warmup(base_lr, steps_per_epoch, warmup_epochs, warmup_start_lr)
    total = check_number("total_epochs", total_epochs, low=warmup.epochs, low_inclusive=False)
    floor = check_number("min_lr", min_lr, low_inclusive=True)
    if floor > warmup.base_lr:
        raise ValueError(f"min_lr must be <= base_lr ({warmup.base_lr}), got {min_lr!r}")
    return _CosineLR(warmup, total, floor)


@dataclass(frozen=True)
class _StepLR:
    warmup: _Warmup
    milestones: tuple[float, ...]
    gamma: float

    def __call__(self, step: int) -> float:
        epoch = self.warmup.epoch(step)
        warm = self.warmup.lr(epoch)
        if warm is not None:
            return warm
        passed = sum(1 for milestone in self.milestones if epoch >= milestone)
        return self.warmup.base_lr * self.gamma**passed


def step_lr(
    base_lr: float,
    *,
    steps_per_epoch: int,
    milestones: Sequence[float],
    gamma: float = 0.1,
    warmup_epochs: float = 0.0,
    warmup_start_lr: float = 0.0,
) -> Callable[[int], float]:
    """Piecewise-constant decay after a linear warm-up, for the SGD baseline.

    Linear from ``warmup_start_lr`` to ``base_lr`` for ``e < warmup_epochs``; then
    ``base_lr·gamma^k`` where ``k`` is the number of milestones ``<= e``.

    Args:
        base_lr: LR after the warm-up, > 0.
        steps_per_epoch: Optimizer steps per epoch, an int >= 1.
        milestones: Strictly increasing epochs (may be fractional), each >= ``warmup_epochs``.
        gamma: Factor applied at each milestone, > 0.
        warmup_epochs: As in :func:`polynomial_lr`.
        warmup_start_lr: As in :func:`polynomial_lr`.

    Returns:
        A picklable ``schedule(step) -> η``.

    Raises:
        ValueError: As :func:`polynomial_lr`.
    """
    warmup = _warmup(base_lr, steps_per_epoch, warmup_epochs, warmup_start_lr)
    if isinstance(milestones, (str, bytes)) or not isinstance(milestones, Sequence):
        raise ValueError(f"milestones must be a sequence of epochs, got {milestones!r}")
    points = tuple(
        check_number("milestones", m, low=warmup.epochs, low_inclusive=True) for m in milestones
    )
    if any(later <= earlier for earlier, later in itertools.pairwise(points)):
        raise ValueError(f"milestones must be strictly increasing, got {list(milestones)!r}")
    return _StepLR(warmup, points, check_number("gamma", gamma))


@dataclass(frozen=True)
class _MomentumForLR:
    base_momentum: float
    lr_schedule: Callable[[int], float]

    def __call__(self, step: int) -> float:
        check_int("step", step, low=0)
        if step == 0:
            return self.base_momentum
        current, previous = self.lr_schedule(step), self.lr_schedule(step - 1)
        # previous <= 0 means nothing to keep the ratio with: fall back to m₀.
        if previous > 0 and current < previous:
            return self.base_momentum * max(current, 0.0) / previous
        return self.base_momentum


def momentum_for_lr(
    base_momentum: float, lr_schedule: Callable[[int], float]
) -> Callable[[int], float]:
    """Osawa et al.'s ``adjust_momentum``: shrink momentum with each LR decrease.

    ``m_t = m₀·η_t/η_{t−1}`` when ``η_t < η_{t−1}``, else ``m₀`` (also at step 0 and when
    ``η_{t−1} <= 0``). It is meant for the update ``v ← m·v − η·ĝ; w ← w + v`` of their
    Chainer code, where the LR sits *inside* the velocity: while η does not rise, the
    adjustment makes that update equal to ``u ← m₀·u + ĝ; w ← w − η·u``. That is what
    ``torch.optim.SGD`` does with a constant ``m₀``, since it applies the LR *outside* its
    buffer; feeding this schedule to ``torch.optim.SGD`` shrinks the old velocity twice.

    Args:
        base_momentum: m₀, in [0, 1).
        lr_schedule: ``schedule(step) -> η``, e.g. from :func:`polynomial_lr`.

    Returns:
        A ``schedule(step) -> m`` (picklable when ``lr_schedule`` is).

    Raises:
        ValueError: If an argument is out of range (also for a negative step when called).
    """
    if not callable(lr_schedule):
        raise ValueError(f"lr_schedule must be callable, got {lr_schedule!r}")
    return _MomentumForLR(_momentum("base_momentum", base_momentum), lr_schedule)


def apply_to_optimizer(
    optimizer: torch.optim.Optimizer,
    step: int,
    *,
    lr: float | Callable[[int], float] | None = None,
    momentum: float | Callable[[int], float] | None = None,
) -> None:
    """Set every parameter group's LR and momentum from schedules evaluated at ``step``.

    Momentum goes to ``momentum`` (SGD, RMSprop) or to ``betas[0]`` (Adam-like).

    Args:
        optimizer: Any ``torch.optim`` optimizer.
        step: Step at which to evaluate the schedules, an int >= 0.
        lr: A number or ``schedule(step) -> η`` (>= 0); None leaves the LR alone.
        momentum: A number or ``schedule(step) -> m`` (in [0, 1)); None leaves it alone.

    Raises:
        ValueError: If ``step`` or a schedule's value is out of range, or momentum is given
            for a group that has neither ``momentum`` nor ``betas``.
    """
    check_int("step", step, low=0)
    lr_value = None if lr is None else lr(step) if callable(lr) else lr
    if lr_value is not None:
        lr_value = check_number("lr", lr_value, low_inclusive=True)
    m_value = None if momentum is None else momentum(step) if callable(momentum) else momentum
    if m_value is not None:
        m_value = _momentum("momentum", m_value)
        for index, group in enumerate(optimizer.param_groups):
            if "betas" not in group and "momentum" not in group:
                raise ValueError(
                    f"momentum was given but param group {index} of {type(optimizer).__name__} "
                    "has neither 'momentum' nor 'betas'"
                )
    for group in optimizer.param_groups:
        if lr_value is not None:
            group["lr"] = lr_value
        if m_value is not None:
            if "betas" in group:
                group["betas"] = (m_value, *tuple(group["betas"])[1:])
            else:
                group["momentum"] = m_value
