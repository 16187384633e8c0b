"""The priority planner (pure): the order its rule prescribes, chunk sizes, the baseline."""

from __future__ import annotations

import pytest

from schedule_cases import EXPECTED, HAND_MADE, ONE_MS
from spdkfac.costmodel import AlphaBetaModel
from spdkfac.planning.schedule import (
    FACTORS,
    GRADIENTS,
    MIN_CHUNK_ELEMENTS,
    ScheduledCall,
    chunk_elements_for,
    plan_fifo,
    plan_priority,
)


def test_hand_made_order() -> None:
    schedule = plan_priority(HAND_MADE, ONE_MS, bytes_per_element=4, chunk_elements=4)
    assert schedule.order == EXPECTED
    assert schedule.predicted_end == pytest.approx(9e-3)
    assert schedule.sizes(FACTORS) == (12, 7)
    assert schedule.sizes(GRADIENTS) == (6, 5)


def test_urgent_bucket_preempts_between_chunks() -> None:
    # Both gradient buckets wait: the first layers' (index 1) goes first.
    calls = (
        ScheduledCall(FACTORS, 0, 8, 0.0),
        ScheduledCall(GRADIENTS, 0, 4, 0.5e-3),
        ScheduledCall(GRADIENTS, 1, 4, 0.5e-3),
    )
    order = plan_priority(calls, ONE_MS, bytes_per_element=4, chunk_elements=4).order
    assert order == ((FACTORS, 0, 0), (GRADIENTS, 1, 0), (GRADIENTS, 0, 0), (FACTORS, 0, 1))


def test_gradients_end_sooner_than_fifo_on_a_slow_link() -> None:
    link = AlphaBetaModel(alpha=1e-4, beta=1e-8)  # 100 MB/s
    calls = (
        ScheduledCall(FACTORS, 0, 4_000_000, 0.0),  # 160 ms of factors
        ScheduledCall(GRADIENTS, 0, 100_000, 0.01),
    )
    chunk = chunk_elements_for(link, 4)
    priority = plan_priority(calls, link, bytes_per_element=4, chunk_elements=chunk)
    fifo = plan_fifo(calls, link, bytes_per_element=4)
    assert fifo.order == ((FACTORS, 0, 0), (GRADIENTS, 0, 0))
    # The gradient bucket waits at most one factor chunk instead of the whole bucket.
    before = priority.order.index((GRADIENTS, 0, 0))
    waited = before * link.predict(chunk * 4)
    assert waited < 0.01 + 2 * link.predict(chunk * 4)
    # The price: a start-up time per chunk, a tenth of each chunk's time by design.
    assert fifo.predicted_end < priority.predicted_end <= fifo.predicted_end / (1 - 0.1) + 1e-3


def test_chunk_size_from_the_model() -> None:
    link = AlphaBetaModel(alpha=1e-4, beta=1e-8)
    elements = chunk_elements_for(link, 4)
    # α is a tenth of the chunk's time: α = 0.1 (α + β n b).
    assert pytest.approx(0.1 * link.predict(elements * 4), rel=1e-3) == 1e-4
    assert chunk_elements_for(AlphaBetaModel(alpha=1e-9, beta=1e-8), 4) == MIN_CHUNK_ELEMENTS
    with pytest.raises(ValueError, match="startup_share"):
        chunk_elements_for(link, 4, startup_share=1.5)


def test_invalid_calls() -> None:
    with pytest.raises(ValueError, match="stream"):
        ScheduledCall("inverses", 0, 1, 0.0)
    with pytest.raises(ValueError, match="numbered"):
        plan_priority(
            (ScheduledCall(FACTORS, 1, 4, 0.0),), ONE_MS, bytes_per_element=4, chunk_elements=4
        )
    with pytest.raises(ValueError, match="chunk_elements"):
        plan_priority(HAND_MADE, ONE_MS, bytes_per_element=4, chunk_elements=0)
