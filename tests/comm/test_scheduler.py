"""The scheduler's run-time paths in one process (a group of one: collectives are local):
windows, planned and unplanned calls, a pass without gradient calls, bad input."""

from __future__ import annotations

import threading

import pytest
import torch

from schedule_cases import HAND_MADE, ONE_MS
from spdkfac.comm import LocalCommunicator
from spdkfac.comm.scheduler import CommScheduler
from spdkfac.planning.schedule import FACTORS, GRADIENTS, plan_priority

FACTOR_SIZES = [c.elements for c in HAND_MADE if c.stream == FACTORS]


def _planned() -> CommScheduler:
    scheduler = CommScheduler(LocalCommunicator(), ONE_MS, timeout=5.0)
    scheduler.adopt(plan_priority(HAND_MADE, ONE_MS, bytes_per_element=4, chunk_elements=4))
    return scheduler


def test_outside_a_window_every_call_goes_to_its_own_group() -> None:
    scheduler = _planned()
    stream = scheduler.stream(GRADIENTS, LocalCommunicator())
    tensor = torch.ones(6)
    assert stream.all_reduce_sum(tensor).wait() is tensor
    assert scheduler.admit(GRADIENTS, 6) is None
    assert not scheduler.planned


def test_a_planned_window_runs_every_call() -> None:
    scheduler = _planned()
    streams = {s: scheduler.stream(s, LocalCommunicator()) for s in (FACTORS, GRADIENTS)}
    scheduler.open_window(FACTOR_SIZES)
    assert scheduler.planned
    tensors = {(c.stream, c.index): torch.full((c.elements,), 2.0) for c in HAND_MADE}
    futures = [streams[s].all_reduce_sum(tensors[(s, i)]) for s, i in tensors]
    for future, tensor in zip(futures, tensors.values(), strict=True):
        assert future.wait() is tensor  # a group of one sums nothing else in
    # The factor stream's calls after its buckets (the weights) are not ordered.
    assert scheduler.admit(FACTORS, 3) is None
    scheduler.close_window()
    assert not scheduler.planned


def test_close_ends_the_dispatcher_and_later_windows_are_unplanned() -> None:
    scheduler = _planned()
    streams = {s: scheduler.stream(s, LocalCommunicator()) for s in (FACTORS, GRADIENTS)}
    before = set(threading.enumerate())
    scheduler.open_window(FACTOR_SIZES)
    dispatchers = [t for t in threading.enumerate() if t not in before]
    futures = [streams[c.stream].all_reduce_sum(torch.ones(c.elements)) for c in HAND_MADE]
    assert all(f.wait().sum() == c.elements for f, c in zip(futures, HAND_MADE, strict=True))
    scheduler.close_window()
    scheduler.close()
    assert dispatchers and not any(t.is_alive() for t in dispatchers)
    scheduler.open_window(FACTOR_SIZES)  # after close(): every call on its own group
    assert not scheduler.planned
    scheduler.close_window()


def test_close_in_a_window_stopped_part_way_does_not_wait_for_its_calls() -> None:
    scheduler = CommScheduler(LocalCommunicator(), ONE_MS, timeout=600.0)
    scheduler.adopt(plan_priority(HAND_MADE, ONE_MS, bytes_per_element=4, chunk_elements=4))
    gradients = scheduler.stream(GRADIENTS, LocalCommunicator())
    before = set(threading.enumerate())
    scheduler.open_window(FACTOR_SIZES)
    dispatchers = [t for t in threading.enumerate() if t not in before]
    handed = next(c for c in HAND_MADE if c.stream == GRADIENTS and c.index == 0)
    first = gradients.all_reduce_sum(torch.ones(handed.elements))
    scheduler.close()  # the rest of the pass never comes (an exception, say)
    assert first.wait().sum() == handed.elements
    assert dispatchers and not any(t.is_alive() for t in dispatchers)


def test_other_factor_buckets_make_the_window_unplanned() -> None:
    scheduler = _planned()
    scheduler.open_window([12, 8])
    assert not scheduler.planned
    scheduler.close_window()


def test_a_pass_without_gradient_calls_skips_them() -> None:
    scheduler = _planned()
    factors = scheduler.stream(FACTORS, LocalCommunicator())
    scheduler.open_window(FACTOR_SIZES)
    first = factors.all_reduce_sum(torch.ones(12))
    second = factors.all_reduce_sum(torch.ones(7))
    scheduler.end_of_gradients()  # DDP did not all-reduce in this pass
    assert first.wait().sum() == 12 and second.wait().sum() == 7
    scheduler.close_window()


def test_a_bucket_of_another_size_is_an_error() -> None:
    scheduler = _planned()
    scheduler.open_window(FACTOR_SIZES)
    with pytest.raises(
        RuntimeError, match="gradients call 0 moves 5 elements, the schedule planned 6"
    ):
        scheduler.admit(GRADIENTS, 5)


def test_records_plan_nothing_without_gradients() -> None:
    scheduler = CommScheduler(LocalCommunicator(), ONE_MS, recorded_windows=2)
    factors = scheduler.stream(FACTORS, LocalCommunicator())
    for _ in range(2):
        scheduler.open_window([4])
        factors.all_reduce_sum(torch.ones(4)).wait()
        scheduler.close_window()
    assert scheduler.plan_due()
    assert scheduler.plan(LocalCommunicator()) is None
    assert not scheduler.plan_due()  # nothing to order: not asked again


def test_records_plan_a_schedule() -> None:
    scheduler = CommScheduler(LocalCommunicator(), ONE_MS, recorded_windows=2)
    streams = {s: scheduler.stream(s, LocalCommunicator()) for s in (FACTORS, GRADIENTS)}
    for _ in range(2):
        scheduler.open_window([4])
        streams[FACTORS].all_reduce_sum(torch.ones(4)).wait()
        streams[GRADIENTS].all_reduce_sum(torch.ones(3)).wait()
        scheduler.close_window()
    schedule = scheduler.plan(LocalCommunicator())
    assert schedule is not None and scheduler.schedule is schedule
    assert schedule.sizes(FACTORS) == (4,) and schedule.sizes(GRADIENTS) == (3,)
    assert "priority schedule" in schedule.describe()


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="credits"):
        CommScheduler(LocalCommunicator(), ONE_MS, credits=0)
    with pytest.raises(ValueError, match="stream"):
        CommScheduler(LocalCommunicator(), ONE_MS).stream("inverses", LocalCommunicator())
