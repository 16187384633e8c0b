"""Tests for the LR schedules, momentum tied to the LR and applying them to optimizers."""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch

from spdkfac.training.lr_schedules import (
    apply_to_optimizer,
    cosine_lr,
    momentum_for_lr,
    polynomial_lr,
    step_lr,
)

__all__: list[str] = []

SPE = 10  # steps per epoch


def _poly_reference(
    step: int,
    *,
    base: float,
    start: float,
    end: float,
    power: float,
    warm: float = 0.0,
    warm_lr: float = 0.0,
) -> float:
    e = step / SPE
    if e < warm:
        return warm_lr + (base - warm_lr) * e / warm
    if e < start:
        return base
    if e < end:
        return base * (1 - (e - start) / (end - start)) ** power
    return 0.0


def _boundary_steps(*epochs: float) -> list[int]:
    steps = {0, 1}
    for epoch in epochs:
        at = round(epoch * SPE)
        steps.update({max(at - 1, 0), at, at + 1})
    return sorted(steps)


@pytest.mark.parametrize(
    ("base", "start", "end", "power"), [(8.18e-3, 1.0, 53.0, 11.0), (3.0e-2, 1.5, 49.5, 3.5)]
)
def test_polynomial_lr_matches_osawa(base: float, start: float, end: float, power: float) -> None:
    schedule = polynomial_lr(
        base, steps_per_epoch=SPE, epoch_start=start, epoch_end=end, power=power
    )
    for step in _boundary_steps(start, (start + end) / 2, end, end + 5):
        expected = _poly_reference(step, base=base, start=start, end=end, power=power)
        assert schedule(step) == pytest.approx(expected, rel=1e-12, abs=0.0), step
    assert schedule(round(start * SPE)) == base
    assert schedule(round(end * SPE)) == 0.0
    assert schedule(round(end * SPE) - 1) > 0.0
    assert pickle.loads(pickle.dumps(schedule)) == schedule


def test_polynomial_lr_warmup() -> None:
    schedule = polynomial_lr(
        0.1,
        steps_per_epoch=SPE,
        epoch_start=2,
        epoch_end=4,
        power=2,
        warmup_epochs=1.5,
        warmup_start_lr=0.01,
    )
    assert schedule(0) == pytest.approx(0.01)
    assert schedule(5) == pytest.approx(0.01 + 0.09 * 0.5 / 1.5)
    assert schedule(14) == pytest.approx(0.01 + 0.09 * 1.4 / 1.5)
    assert schedule(15) == 0.1
    assert schedule(30) == pytest.approx(0.1 * 0.5**2)
    for step in range(50):
        expected = _poly_reference(step, base=0.1, start=2, end=4, power=2, warm=1.5, warm_lr=0.01)
        assert schedule(step) == pytest.approx(expected, rel=1e-12, abs=0.0)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"steps_per_epoch": 0}, "steps_per_epoch"),
        ({"epoch_start": -1.0}, "epoch_start"),
        ({"epoch_end": 1.0}, "epoch_end"),
        ({"power": 0.0}, "power"),
        ({"warmup_epochs": 2.0}, "epoch_start must be >= warmup_epochs"),
        ({"warmup_start_lr": -0.1}, "warmup_start_lr"),
    ],
)
def test_polynomial_lr_rejects(kwargs: dict[str, Any], name: str) -> None:
    options: dict[str, Any] = {
        "steps_per_epoch": SPE,
        "epoch_start": 1.0,
        "epoch_end": 3.0,
        "power": 2.0,
    }
    options.update(kwargs)
    with pytest.raises(ValueError, match=name):
        polynomial_lr(0.1, **options)
    with pytest.raises(ValueError, match="base_lr"):
        polynomial_lr(0.0, steps_per_epoch=SPE, epoch_start=1, epoch_end=3, power=2)


def test_cosine_lr() -> None:
    schedule = cosine_lr(0.4, steps_per_epoch=SPE, total_epochs=5, min_lr=0.02, warmup_epochs=1)
    assert schedule(0) == 0.0
    assert schedule(5) == pytest.approx(0.2)
    assert schedule(10) == pytest.approx(0.4)
    assert schedule(30) == pytest.approx(0.02 + 0.38 * 0.5)
    assert schedule(49) == pytest.approx(0.02 + 0.38 * 0.5 * (1 + math.cos(math.pi * 3.9 / 4)))
    assert schedule(50) == 0.02
    assert schedule(500) == 0.02
    with pytest.raises(ValueError, match="total_epochs"):
        cosine_lr(0.4, steps_per_epoch=SPE, total_epochs=1, warmup_epochs=1)
    with pytest.raises(ValueError, match="min_lr"):
        cosine_lr(0.4, steps_per_epoch=SPE, total_epochs=3, min_lr=0.5)


def test_step_lr() -> None:
    schedule = step_lr(
        0.1,
        steps_per_epoch=SPE,
        milestones=[1.5, 3],
        gamma=0.1,
        warmup_epochs=1,
        warmup_start_lr=0.05,
    )
    got = [schedule(s) for s in (0, 5, 10, 14, 15, 29, 30, 1000)]
    expected = [0.05, 0.075, 0.1, 0.1, 0.01, 0.01, 0.001, 0.001]
    assert got == pytest.approx(expected, rel=1e-12)
    assert step_lr(0.2, steps_per_epoch=1, milestones=[])(10**6) == 0.2
    for milestones, name in [
        ([3, 3], "strictly increasing"),
        ([0.5], "milestones"),
        ("12", "sequence"),
    ]:
        with pytest.raises(ValueError, match=name):
            step_lr(0.1, steps_per_epoch=SPE, milestones=milestones, warmup_epochs=1)
    with pytest.raises(ValueError, match="gamma"):
        step_lr(0.1, steps_per_epoch=SPE, milestones=[1], gamma=0)


def test_momentum_for_lr_follows_adjust_momentum() -> None:
    lr = polynomial_lr(
        1.0,
        steps_per_epoch=SPE,
        epoch_start=1,
        epoch_end=3,
        power=2,
        warmup_epochs=0.5,
        warmup_start_lr=0.1,
    )
    momentum = momentum_for_lr(0.9, lr)
    for step in range(40):
        now, before = lr(step), lr(step - 1) if step else None
        decreased = before is not None and before > 0 and now < before
        expected = 0.9 * now / before if decreased and before else 0.9
        assert momentum(step) == pytest.approx(expected, rel=1e-12), step
    assert momentum(3) == 0.9  # warm-up: LR rises
    assert momentum(10) == 0.9  # flat
    assert momentum(11) < 0.9  # decaying
    assert momentum(30) == 0.0  # η drops to 0 from > 0
    assert momentum(31) == 0.9  # η_{t-1} == 0


def test_momentum_for_lr_step_drops() -> None:
    momentum = momentum_for_lr(0.8, step_lr(1.0, steps_per_epoch=SPE, milestones=[2]))
    assert [momentum(s) for s in (0, 19, 20, 21)] == pytest.approx([0.8, 0.8, 0.08, 0.8])
    with pytest.raises(ValueError, match="base_momentum"):
        momentum_for_lr(1.0, lambda step: 0.1)
    with pytest.raises(ValueError, match="lr_schedule"):
        momentum_for_lr(0.9, 0.1)  # type: ignore[arg-type]


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]


def test_apply_to_optimizer_sgd_and_adam() -> None:
    first, second = _params()
    sgd = torch.optim.SGD(
        [{"params": [first]}, {"params": [second], "lr": 5.0}], lr=1.0, momentum=0.5
    )
    lr: Callable[[int], float] = lambda step: 0.1 * step  # noqa: E731
    apply_to_optimizer(sgd, 3, lr=lr, momentum=0.7)
    assert [(g["lr"], g["momentum"]) for g in sgd.param_groups] == [
        (pytest.approx(0.3), 0.7),
        (pytest.approx(0.3), 0.7),
    ]
    first.grad = torch.ones(2)
    sgd.step()
    torch.testing.assert_close(first.detach(), torch.full((2,), 0.7))
    adam = torch.optim.Adam(_params(), lr=1e-3, betas=(0.9, 0.95))
    apply_to_optimizer(adam, 0, momentum=lambda step: 0.8)
    assert adam.param_groups[0]["betas"] == (0.8, 0.95)
    assert adam.param_groups[0]["lr"] == 1e-3


def test_apply_to_optimizer_rejects() -> None:
    sgd = torch.optim.SGD(_params(), lr=1.0, momentum=0.5)
    with pytest.raises(ValueError, match="step"):
        apply_to_optimizer(sgd, -1, lr=0.1)
    with pytest.raises(ValueError, match="lr"):
        apply_to_optimizer(sgd, 0, lr=lambda step: -1.0)
    with pytest.raises(ValueError, match="momentum"):
        apply_to_optimizer(sgd, 0, momentum=1.0)
    adagrad = torch.optim.Adagrad(_params(), lr=0.1)
    with pytest.raises(ValueError, match="neither 'momentum' nor 'betas'"):
        apply_to_optimizer(adagrad, 0, lr=0.5, momentum=0.9)
    assert adagrad.param_groups[0]["lr"] == 0.1  # nothing applied on error
