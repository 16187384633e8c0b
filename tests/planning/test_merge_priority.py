"""The ``dp`` merge on the priority schedule's timeline (``comm_scheduler="priority"``).

Factor buckets are planned around the link time the gradient chunks hold.
"""

from __future__ import annotations

import random

import pytest
import torch

from merge_cases import PolicySpy, all_splits, random_stream
from schedule_cases import ONE_MS
from spdkfac.comm import LocalCommunicator
from spdkfac.comm.pipeline import ExchangeSettings, FactorPipeline, FactorRoute
from spdkfac.comm.scheduler import CommScheduler
from spdkfac.costmodel import AlphaBetaModel
from spdkfac.planning.fusion import ThresholdFusion
from spdkfac.planning.merge import finish_after, groups_end, merge_dp
from spdkfac.planning.schedule import GRADIENTS, ScheduledCall, gradient_busy


def test_finish_after_pauses_in_busy_intervals() -> None:
    busy = ((2.0, 3.0), (4.0, 6.0))
    assert finish_after(0.0, 1.0, busy) == 1.0  # done before the first interval
    assert finish_after(0.0, 2.0, busy) == 2.0  # ends exactly where it begins
    assert finish_after(1.0, 2.0, busy) == 4.0  # 1→2, paused 2→3, 3→4
    assert finish_after(2.5, 0.5, busy) == 3.5  # launched inside an interval: waits
    assert finish_after(7.0, 1.0, busy) == 8.0
    assert finish_after(1.0, 2.0) == 3.0


def _random_busy(seed: int) -> tuple[tuple[float, float], ...]:
    rng = random.Random(1000 + seed)
    edges = sorted(rng.uniform(0.0, 0.03) for _ in range(2 * rng.randint(1, 3)))
    return tuple((edges[i], edges[i + 1]) for i in range(0, len(edges), 2))


def test_dp_around_busy_link_is_the_best_split() -> None:
    """Exhaustive search on the same timeline (pre-emption by ``busy``, one start-up per
    chunk): the program is exact, and planning on Eq. 15's timeline instead ends later
    in some windows (never sooner)."""
    model = AlphaBetaModel(alpha=5e-4, beta=8e-9)
    better = 0
    for seed in range(40):
        order, sizes, ready = random_stream(seed, 2 + seed % 7)
        busy = _random_busy(seed)

        def end(groups: list[tuple[str, ...]], *stream: object, busy: object = busy) -> float:
            return groups_end(groups, *stream, model, busy=busy, chunk_elements=100_000)  # type: ignore[arg-type]

        stream = (order, sizes, ready)
        groups = merge_dp(*stream, model, busy=busy, chunk_elements=100_000)
        assert [key for group in groups for key in group] == order
        assert end(groups, *stream) == pytest.approx(
            min(end(g, *stream) for g in all_splits(order))
        )
        unaware = end(merge_dp(*stream, model), *stream)
        assert end(groups, *stream) <= unaware + 1e-12
        better += end(groups, *stream) < unaware - 1e-9
    assert better > 0


def test_gradient_busy_follows_the_priority_rule() -> None:
    """Two gradient buckets, 1 ms per chunk: the first layers' bucket (index 1) pre-empts
    the other between chunks; the link is busy from 1 to 4 ms, then for the late one."""
    calls = (
        ScheduledCall(GRADIENTS, 0, 8, 1e-3),
        ScheduledCall(GRADIENTS, 1, 4, 1.5e-3),
    )
    busy = gradient_busy(calls, ONE_MS, bytes_per_element=4, chunk_elements=4)
    assert [pytest.approx(interval) for interval in busy] == [(1e-3, 4e-3)]
    late = (ScheduledCall(GRADIENTS, 0, 8, 1e-3), ScheduledCall(GRADIENTS, 1, 4, 10e-3))
    busy = gradient_busy(late, ONE_MS, bytes_per_element=4, chunk_elements=4)
    assert [pytest.approx(i) for i in busy] == [(1e-3, 3e-3), (10e-3, 11e-3)]


def test_pipeline_plans_around_the_recorded_gradient_calls() -> None:
    """The pipeline hands the policy the gradient intervals of its scheduler's recorded
    windows, on the clock of the factors' hand-over times, and the chunk size."""
    group = LocalCommunicator()
    model = AlphaBetaModel(alpha=1e-3, beta=1e-6)
    scheduler = CommScheduler(group, model, recorded_windows=2)
    gradients = scheduler.stream(GRADIENTS, group)
    spy = PolicySpy(ThresholdFusion())
    route = FactorRoute(spy, group, model, scheduler=scheduler)
    pipeline = FactorPipeline(
        route, [("a", 2)], [("g", 2)], settings=ExchangeSettings(warmup_steps=2)
    )
    for _ in range(2):
        pipeline.hand_over("a", torch.eye(2), 1.0)
        gradients.all_reduce_sum(torch.ones(250)).wait()  # a gradient bucket
        pipeline.hand_over("g", torch.eye(2), 1.0)
        pipeline.finish(local_ok=True)
    measured = spy.seen[-1]
    assert measured.chunk_elements == scheduler.chunk_elements
    assert len(measured.busy) == 1
    start, end = measured.busy[0]
    # 250 elements of 4 bytes in one chunk: α + β·1000.
    assert end - start == pytest.approx(model.predict(1000))
    assert measured.a_ready is not None and measured.g_ready is not None
    assert measured.a_ready[0] == 0.0 <= start <= measured.g_ready[0]
