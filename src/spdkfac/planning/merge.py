"""Merge rules of the fusion planners: which consecutive slots of a stream share an all-reduce.

Eq. 15 of SPD-KFAC (Shi, Zhang, Li 2021), a greedy pass, and an exact dynamic program on
the same one-channel timeline (after PACE, Bao et al., INFOCOM 2020), which may also plan
around link time held by more urgent traffic: the gradient chunks a priority schedule
(:mod:`spdkfac.planning.schedule`) sends first. Pure functions of replicated inputs;
:mod:`spdkfac.planning.fusion` wraps them as policies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from spdkfac.costmodel import AlphaBetaModel
from spdkfac.planning.schedule import chunk_count

__all__ = ["Busy", "communication_starts", "finish_after", "groups_end", "merge_dp", "merge_groups"]

#: Link intervals ``(start, end)`` held by more urgent traffic, sorted and disjoint.
Busy = Sequence[tuple[float, float]]


def finish_after(start: float, work: float, busy: Busy = ()) -> float:
    """When ``work`` seconds of link time starting at ``start`` are done, if every interval
    of ``busy`` pre-empts it (the transfer pauses there and resumes after)."""
    now, left = start, work
    for begin, end in busy:
        if end <= now:
            continue
        if begin >= now + left:
            break
        left -= max(0.0, begin - now)
        now = max(now, end)
    return now + left


def _transfer_cost(
    model: AlphaBetaModel, bytes_per_element: int, chunk_elements: int | None
) -> Callable[[int], float]:
    """Link time of one call of ``n`` elements: ``α + β·bytes``, or one ``α`` per chunk
    when calls are cut into chunks of ``chunk_elements``."""

    def cost(elements: int) -> float:
        chunks = 1 if chunk_elements is None else chunk_count(elements, chunk_elements)
        return model.predict(elements * bytes_per_element) + (chunks - 1) * model.alpha

    return cost


def communication_starts(ready: Sequence[float], durations: Sequence[float]) -> list[float]:
    """τ_c: τ_c(1) = r_1, τ_c(l) = max(τ_c(l−1) + t_c(l−1), r_l) (one channel, in order)."""
    starts: list[float] = []
    for index, ready_at in enumerate(ready):
        if index == 0:
            starts.append(ready_at)
        else:
            starts.append(max(starts[-1] + durations[index - 1], ready_at))
    return starts


def _elements(order: Sequence[str], sizes: Mapping[str, int], ready: Sequence[float]) -> list[int]:
    if len(order) != len(ready):
        raise ValueError("order and ready must have the same length")
    return [sizes[key] for key in order]


def merge_groups(
    order: Sequence[str],
    sizes: Mapping[str, int],
    ready: Sequence[float],
    model: AlphaBetaModel,
    bytes_per_element: int = 4,
) -> list[tuple[str, ...]]:
    """Eq. 15's greedy single pass over one stream (A in forward or G in backward order).

    Args:
        order: Slot keys in the order they become ready.
        sizes: Elements per slot (packed triangles).
        ready: Ready time r_l of each slot (seconds, any common origin).
        model: All-reduce cost ``α + β·bytes``.
        bytes_per_element: Bytes of one communicated element.

    Returns:
        Contiguous groups of slot keys.
    """
    elements = _elements(order, sizes, ready)
    if not order:
        return []
    alpha = model.alpha

    def cost(count: int) -> float:
        return model.predict(count * bytes_per_element) if count else 0.0

    durations = [cost(count) for count in elements]
    starts = communication_starts(ready, durations)
    groups: list[tuple[str, ...]] = []
    current: list[str] = []
    for index in range(len(order) - 1):
        current.append(order[index])
        ready_next = ready[index + 1]
        finish = starts[index] + durations[index]
        if ready_next < finish and (
            starts[index] > ready_next or ready_next - starts[index] < alpha
        ):
            # Merge: slot index travels with slot index+1 (its own start-up is saved).
            elements[index + 1] += elements[index]
            elements[index] = 0
            durations[index] = 0.0
            durations[index + 1] = cost(elements[index + 1])
            starts = communication_starts(ready, durations)
        else:
            groups.append(tuple(current))
            current = []
    current.append(order[-1])
    groups.append(tuple(current))
    return groups


def groups_end(
    groups: Sequence[Sequence[str]],
    order: Sequence[str],
    sizes: Mapping[str, int],
    ready: Sequence[float],
    model: AlphaBetaModel,
    bytes_per_element: int = 4,
    *,
    busy: Busy = (),
    chunk_elements: int | None = None,
) -> float:
    """When the last of ``groups`` (contiguous runs of ``order``) ends on one channel: each
    launches once its last slot is ready and the channel is free (Eq. 15's timeline), and
    pauses wherever ``busy`` holds the link (see :func:`merge_dp`)."""
    ready_of = dict(zip(order, ready, strict=True))
    cost = _transfer_cost(model, bytes_per_element, chunk_elements)
    free = -math.inf
    for group in groups:
        launch = max(free, max(ready_of[key] for key in group))
        free = finish_after(launch, cost(sum(sizes[key] for key in group)), busy)
    return free


def merge_dp(
    order: Sequence[str],
    sizes: Mapping[str, int],
    ready: Sequence[float],
    model: AlphaBetaModel,
    bytes_per_element: int = 4,
    *,
    busy: Busy = (),
    chunk_elements: int | None = None,
) -> list[tuple[str, ...]]:
    """The contiguous groups of one stream whose last all-reduce ends first, exactly.

    After PACE's tensor-merging dynamic program (Bao et al., INFOCOM 2020, Sec. IV-B),
    with Eq. 15's oracle: one channel, buckets in order, each launched once its last slot is
    ready, costing ``α + β·bytes``. ``end[i]``, the earliest end of the first ``i`` slots,
    is ``min_j finish(max(end[j], r(j..i)), t(j..i))``: exact for this model, since a later
    prefix end never lets the rest end sooner. Eq. 15's greedy pass is one of the
    candidates, so its plan never ends sooner (O(n²), n: slots of the stream).

    With a priority schedule the oracle is that schedule's timeline instead: ``busy`` holds
    the link intervals of the more urgent (gradient) chunks, which pre-empt a bucket at a
    chunk boundary (:func:`finish_after`), and a bucket cut into ``chunk_elements`` pays one
    start-up per chunk. ``finish`` is still monotone in the launch time, so the program
    stays exact. A pre-empted bucket resumes right after the interval: the chunk a gradient
    waits for when it arrives mid-chunk is not modelled (at most one chunk's time).
    """
    elements = _elements(order, sizes, ready)
    count = len(order)
    if not count:
        return []
    cost = _transfer_cost(model, bytes_per_element, chunk_elements)

    end = [-math.inf] + [math.inf] * count
    cut = [0] * (count + 1)
    for stop in range(1, count + 1):
        latest = -math.inf
        total = 0
        for start in range(stop - 1, -1, -1):
            latest = max(latest, ready[start])
            total += elements[start]
            finish = finish_after(max(end[start], latest), cost(total), busy)
            if finish < end[stop]:
                end[stop], cut[stop] = finish, start
    groups: list[tuple[str, ...]] = []
    stop = count
    while stop:
        groups.append(tuple(order[cut[stop] : stop]))
        stop = cut[stop]
    return groups[::-1]
