"""Timing broadcast and all-reduce over a range of message sizes, on every rank at once."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from spdkfac.calibrate.timing import Budget, synchronize
from spdkfac.comm import Communicator, barrier
from spdkfac.support.checks import check_int

__all__ = ["CollectiveSamples", "measure_collectives"]


class CollectiveSamples(NamedTuple):
    """Measured ``(bytes, seconds)`` pairs of both collectives."""

    broadcast: list[tuple[int, float]]
    allreduce: list[tuple[int, float]]


def measure_collectives(
    comm: Communicator,
    sizes_bytes: Sequence[int],
    repeats: int,
    *,
    budget: Budget | None = None,
) -> CollectiveSamples:
    """Time broadcast and all-reduce of float32 messages of each size, on every rank.

    Every rank must call this with the same arguments. Each size gets one untimed warm-up
    of each collective, then ``repeats`` timed ones (up to 8x more below 1 MiB: small
    messages are cheap and their times noisy), each after a barrier so all ranks start
    together; broadcasts rotate their root over the ranks, as inverse owners do.
    One repeat's time is the slowest rank's (a broadcast root can return before the data
    has arrived, and the placement waits for the last receiver); the sample is the median
    over repeats. The result is identical on every rank. Sizes run smallest first; when
    ``budget`` runs out the larger ones are skipped.

    Args:
        comm: The group to measure.
        sizes_bytes: Message sizes in bytes (rounded down to whole float32 elements).
        repeats: Timed repetitions per size and collective (>= 1).
        budget: Optional shared time allowance.
    """
    check_int("repeats", repeats)
    broadcast: list[tuple[int, float]] = []
    allreduce: list[tuple[int, float]] = []
    ordered = sorted({int(size) for size in sizes_bytes})
    if ordered and ordered[0] < 4:
        raise ValueError(f"sizes_bytes must be >= 4 (one float32), got {ordered[0]}")
    for _ in range(3):  # the first collectives of a group set up connections
        barrier(comm)
    seconds_per_byte = 1e-9  # a pessimistic 1 GB/s until two sizes have been measured
    last: tuple[int, float] | None = None  # (size, seconds per repeat, barriers included)
    for index, size in enumerate(ordered):
        # A function of the size only, so every rank runs the same number of collectives.
        count = repeats * min(8, max(1, 2**20 // size))
        if last is not None and budget is not None:
            predicted = (count + 1) * (last[1] + 2 * seconds_per_byte * (size - last[0]))
            if not budget.allows(predicted):
                budget.skip("message sizes (bytes)", ordered[index:], predicted)
                break
        start = time.perf_counter()
        buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=comm.device)
        comm.all_reduce_sum(buffer).wait()
        comm.broadcast(buffer, src=0).wait()
        times = torch.zeros(2, count, dtype=torch.float64)
        for repeat in range(count):
            for row in (0, 1):
                barrier(comm)
                synchronize(comm.device)
                began = time.perf_counter()
                if row == 0:
                    comm.all_reduce_sum(buffer).wait()
                else:
                    comm.broadcast(buffer, src=repeat % comm.world_size).wait()
                synchronize(comm.device)
                times[row, repeat] = time.perf_counter() - began
        slowest = comm.all_reduce_max(times.to(comm.device)).wait().cpu()
        nbytes = buffer.numel() * 4
        allreduce.append((nbytes, float(slowest[0].median())))
        broadcast.append((nbytes, float(slowest[1].median())))
        if len(allreduce) >= 2:
            grown = nbytes - allreduce[-2][0]
            slopes = [(pairs[-1][1] - pairs[-2][1]) / grown for pairs in (allreduce, broadcast)]
            seconds_per_byte = max(1e-10, *slopes)
        last = (size, (time.perf_counter() - start) / count)
    return CollectiveSamples(broadcast=broadcast, allreduce=allreduce)
