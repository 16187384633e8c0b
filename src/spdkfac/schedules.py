"""Osawa et al.'s K-FAC schedules (damping warm-up, stale refresh intervals), and the
evaluation of any float-or-callable hyperparameter at a step.

Each schedule is a function of the preconditioner's step counter that a
:class:`~spdkfac.KFACPreconditioner` option takes (``damping``, ``factor_update_steps``,
``inv_update_steps``). The learning-rate schedules and weight rescaling of the training
recipe live in :mod:`spdkfac.training.lr_schedules` and :mod:`spdkfac.training.rescaling`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from spdkfac.support.checks import check_int, check_number
from spdkfac.types import FloatSchedule, IntSchedule

__all__ = ["damping_warmup", "resolve_float", "resolve_interval", "stale_interval"]


def resolve_float(name: str, schedule: FloatSchedule, step: int, *, allow_zero: bool) -> float:
    """Evaluate a float-or-callable hyperparameter at ``step`` and validate the result."""
    value = schedule(step) if callable(schedule) else schedule
    try:
        return check_number(name, value, low_inclusive=allow_zero)
    except ValueError as error:
        if callable(schedule):
            raise ValueError(f"{error} (returned by the schedule at step {step})") from None
        raise


def resolve_interval(name: str, schedule: IntSchedule, step: int) -> int:
    """Evaluate an int-or-callable refresh interval at ``step`` and validate the result."""
    value = schedule(step) if callable(schedule) else schedule
    try:
        return check_int(name, value)
    except ValueError as error:
        if callable(schedule):
            raise ValueError(f"{error} (returned by the schedule at step {step})") from None
        raise


# The schedules are small frozen dataclasses rather than closures so that they pickle
# (spawned workers receive the config), compare by value and print their parameters.


@dataclass(frozen=True)
class _DampingWarmup:
    initial: float
    target: float
    warmup_steps: int

    def __call__(self, step: int) -> float:
        check_int("step", step, low=0)
        if step >= self.warmup_steps:
            return self.target
        remaining = 1.0 - step / self.warmup_steps
        return self.target + (self.initial - self.target) * remaining


def damping_warmup(initial: float, target: float, warmup_steps: int) -> Callable[[int], float]:
    """Damping that moves linearly from ``initial`` to ``target`` over ``warmup_steps``.

    ``γ(t) = target + (initial − target)·max(0, 1 − t/T_w)``. Osawa et al. start with a
    large damping while the Fisher changes fast and lower it afterwards; their equation is
    lost from the text we have and their code has no warm-up, so this linear form is a
    **reconstruction** (Osawa et al. 2019, CVPR, Sec. 4.2 "Warmup damping"), not their
    exact rule. Either direction
    is accepted (the surviving text also says "γ_target > γ(0)").

    Args:
        initial: γ at step 0, > 0.
        target: γ from step ``warmup_steps`` on, > 0.
        warmup_steps: T_w, an int >= 0; 0 gives a constant ``target``.

    Returns:
        A picklable ``schedule(step) -> γ`` for :attr:`KFACConfig.damping`.

    Raises:
        ValueError: If an argument is out of range (also for a negative step when called).
    """
    warmup_steps = check_int("warmup_steps", warmup_steps, low=0)
    return _DampingWarmup(
        check_number("initial", initial), check_number("target", target), warmup_steps
    )


@dataclass(frozen=True)
class _StaleInterval:
    early: int
    late: int
    switch_step: int
    growth_steps: int

    def __call__(self, step: int) -> int:
        check_int("step", step, low=0)
        if step < self.switch_step:
            return self.early
        if self.growth_steps == 0:
            return self.late
        doublings = 1 + (step - self.switch_step) // self.growth_steps
        # early·2^k exceeds late once k reaches late's bit length; cap k to keep it cheap.
        doublings = min(doublings, self.late.bit_length())
        return min(self.late, self.early << doublings)


def stale_interval(
    early: int, late: int, switch_step: int, *, growth_steps: int = 0
) -> Callable[[int], int]:
    """Refresh interval that is short early in training and long ("stale") later.

    Osawa et al. observed that the Fisher changes quickly during roughly the first 500
    iterations and slowly afterwards, so its factors can be refreshed less and less often
    ("stale statistics") with no loss of accuracy. Their exact per-epoch rule is lost from
    the text we have; this is the shape they describe: ``early`` before ``switch_step``;
    from ``switch_step`` on, ``min(late, early·2^(1 + ⌊(t − switch_step)/growth_steps⌋))``
    (doubling every ``growth_steps`` steps, starting at the switch), or ``late`` at once
    when ``growth_steps`` is 0.

    A refresh fires when ``step % interval(step) == 0``; refreshes are evenly spaced within
    each phase when ``switch_step`` and ``growth_steps`` are multiples of ``late``.

    Args:
        early: Interval before the switch, an int >= 1.
        late: Final interval, an int >= ``early``.
        switch_step: First step of the growth phase, an int >= 0.
        growth_steps: Steps between doublings, an int >= 0 (0: jump straight to ``late``).

    Returns:
        A picklable ``schedule(step) -> interval`` for ``factor_update_steps`` or
        ``inv_update_steps`` of :class:`~spdkfac.config.KFACConfig`.

    Raises:
        ValueError: If an argument is out of range (also for a negative step when called).
    """
    early = check_int("early", early, low=1)
    late = check_int("late", late, low=1)
    if late < early:
        raise ValueError(f"late must be >= early ({early}), got {late!r}")
    return _StaleInterval(
        early,
        late,
        check_int("switch_step", switch_step, low=0),
        check_int("growth_steps", growth_steps, low=0),
    )
