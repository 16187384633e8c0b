"""Tests for the damping warm-up and the stale refresh interval."""

from __future__ import annotations

import pickle

import pytest

from spdkfac.config import KFACConfig
from spdkfac.schedules import damping_warmup, stale_interval

__all__: list[str] = []


def _damping_reference(t: int, initial: float, target: float, warmup: int) -> float:
    if warmup == 0:
        return target
    return target + (initial - target) * max(0.0, 1.0 - t / warmup)


@pytest.mark.parametrize(("initial", "target"), [(1e-1, 1e-3), (1e-4, 2.5e-4)])
@pytest.mark.parametrize("warmup", [0, 1, 7, 100])
def test_damping_warmup_matches_formula(initial: float, target: float, warmup: int) -> None:
    schedule = damping_warmup(initial, target, warmup)
    for t in sorted({0, 1, warmup // 2, max(warmup - 1, 0), warmup, warmup + 1, 10 * warmup + 3}):
        assert schedule(t) == pytest.approx(_damping_reference(t, initial, target, warmup))


def test_damping_warmup_boundaries_and_config() -> None:
    schedule = damping_warmup(0.1, 0.001, 10)
    assert schedule(0) == pytest.approx(0.1)
    assert schedule(5) == pytest.approx(0.0505)
    assert schedule(10) == 0.001
    assert schedule(10**9) == 0.001
    config = KFACConfig(damping=schedule)
    assert config.damping_at(5) == pytest.approx(0.0505)
    assert pickle.loads(pickle.dumps(schedule)) == schedule


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((0.0, 1e-3, 10), "initial"),
        ((-1.0, 1e-3, 10), "initial"),
        ((float("nan"), 1e-3, 10), "initial"),
        ((1.0, 0.0, 10), "target"),
        ((1.0, float("inf"), 10), "target"),
        ((1.0, 1e-3, -1), "warmup_steps"),
        ((1.0, 1e-3, 2.5), "warmup_steps"),
        ((1.0, 1e-3, True), "warmup_steps"),
    ],
)
def test_damping_warmup_rejects(args: tuple[float, float, int], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        damping_warmup(*args)


def test_schedules_reject_negative_step() -> None:
    with pytest.raises(ValueError, match="step must be an int >= 0, got -1"):
        damping_warmup(1.0, 0.1, 5)(-1)
    with pytest.raises(ValueError, match="step"):
        stale_interval(1, 4, 10)(-3)


def _interval_reference(t: int, early: int, late: int, switch: int, growth: int) -> int:
    if t < switch:
        return early
    if growth == 0:
        return late
    interval = early
    for _ in range(switch, t + 1, growth):  # one doubling at the switch, then every `growth`
        interval = min(late, 2 * interval)
    return interval


@pytest.mark.parametrize(
    ("early", "late", "switch", "growth"),
    [(1, 8, 10, 5), (1, 8, 10, 0), (3, 10, 0, 2), (2, 2, 4, 3), (1, 100, 500, 1)],
)
def test_stale_interval_matches_reference(early: int, late: int, switch: int, growth: int) -> None:
    schedule = stale_interval(early, late, switch, growth_steps=growth)
    for t in range(switch + 12 * max(growth, 1) + 5):
        assert schedule(t) == _interval_reference(t, early, late, switch, growth), t


def test_stale_interval_table_and_large_steps() -> None:
    schedule = stale_interval(1, 8, 10, growth_steps=5)
    got = [schedule(t) for t in (0, 9, 10, 14, 15, 19, 20, 10**18)]
    assert got == [1, 1, 2, 2, 4, 4, 8, 8]
    assert stale_interval(1, 8, 10)(10) == 8
    assert stale_interval(3, 10, 0, growth_steps=1)(0) == 6


def test_stale_interval_drives_config_refreshes() -> None:
    config = KFACConfig(factor_update_steps=stale_interval(1, 4, 8, growth_steps=8))
    fired = [t for t in range(32) if config.is_factor_step(t)]
    # every step before 8, every 2nd for [8, 16), every 4th from 16 on
    assert fired == [*range(8), 8, 10, 12, 14, 16, 20, 24, 28]
    schedule = stale_interval(2, 16, 100, growth_steps=50)
    assert pickle.loads(pickle.dumps(schedule)) == schedule


@pytest.mark.parametrize(
    ("args", "kwargs", "name"),
    [
        ((0, 4, 10), {}, "early"),
        ((4, 2, 10), {}, "late must be >= early"),
        ((1, 4, -1), {}, "switch_step"),
        ((1, 4, 10), {"growth_steps": -1}, "growth_steps"),
        ((1.0, 4, 10), {}, "early"),
    ],
)
def test_stale_interval_rejects(
    args: tuple[int, int, int], kwargs: dict[str, int], name: str
) -> None:
    with pytest.raises(ValueError, match=name):
        stale_interval(*args, **kwargs)
