"""Collectives of one simulated iteration and the order ranks post them in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from spdkfac.planning.schedule import FACTORS, GRADIENTS, STREAMS, CommSchedule
from spdkfac.sim.collectives import CollectiveOp
from spdkfac.sim.program import Collective, Compute, Instruction, Issue
from spdkfac.sim.strategies import StrategySetup
from spdkfac.sim.window import BYTES_PER_ELEMENT

__all__ = [
    "SCHEDULER_CHANNEL",
    "BucketLauncher",
    "IterationBuilder",
    "Launcher",
    "ScheduledWindow",
    "factor_channel",
    "issue",
]


class IterationBuilder:
    """Collects the collectives of one iteration; ``ranks`` are the ranks given programs."""

    def __init__(self, setup: StrategySetup, ranks: Sequence[int]) -> None:
        self.setup = setup
        self.costs = setup.costs
        self.world_size = setup.costs.world_size
        self.participants = tuple(range(len(ranks)))  # engine ranks: positions in ``ranks``
        hardware = setup.costs.hardware
        self.prices = {op: hardware.collective(op, self.world_size) for op in CollectiveOp}
        self.collectives: list[Collective] = []

    def collective(self, label: str, channel: str, op: CollectiveOp, nbytes: float) -> int:
        """Add ``op`` on every rank moving ``nbytes`` bytes (the whole buffer), costed by
        the cheapest algorithm for that size; returns its index.

        A broadcast takes the hardware's ``broadcast_overlap`` and ``broadcast_contention``
        (it reduces nothing); a reduce, priced as a broadcast (the same messages,
        backwards), combines buffers on the way and keeps the engine's defaults, as the
        all-reduce does."""
        _, line = self.prices[op].choose(nbytes)
        hardware = self.costs.hardware
        broadcast = op is CollectiveOp.BROADCAST
        self.collectives.append(
            Collective(
                label,
                channel,
                self.participants,
                line.alpha,
                line.beta * nbytes,
                overlap=hardware.broadcast_overlap if broadcast else None,
                contention=hardware.broadcast_contention if broadcast else None,
                op=op,
                nbytes=nbytes,
            )
        )
        return len(self.collectives) - 1


def factor_channel(builder: IterationBuilder) -> str:
    """The channel factor buckets travel on: their own when eager (a second process
    group), unless the hardware runs one queue."""
    fusion = builder.setup.fusion
    eager = fusion is not None and fusion.eager
    return "factor" if eager and not builder.costs.hardware.single_queue else "default"


def issue(
    builder: IterationBuilder, collective: int, out: list[Instruction], name: str | None = None
) -> None:
    """Post ``collective``, paying the host's cost of posting it (attributed to ``name``)."""
    out += [Compute(builder.costs.hardware.issue_overhead_seconds, name), Issue(collective)]


class BucketLauncher(Protocol):
    """Posts a stream's buckets as their members become ready."""

    @property
    def all_ids(self) -> tuple[int, ...]:
        """Every collective of every bucket, in issue order."""
        ...

    def ready(
        self, key: str, out: list[Instruction], *, eager: bool = True, name: str | None = None
    ) -> None:
        """``key`` is ready; post what that allows (``eager``)."""
        ...

    def flush(self, out: list[Instruction], *, force: bool, name: str | None = None) -> None:
        """Post every complete bucket (every one with ``force``)."""
        ...


class Launcher:
    """Issues buckets strictly in order as their members become ready; each bucket is
    one or more collectives (``ids``, aligned with ``buckets``), posted together."""

    def __init__(
        self,
        builder: IterationBuilder,
        buckets: tuple[tuple[str, ...], ...],
        ids: Sequence[tuple[int, ...]],
    ) -> None:
        self.builder = builder
        self.buckets = buckets
        self.ids = list(ids)
        self.missing = [set(bucket) for bucket in buckets]
        self.next = 0

    @property
    def all_ids(self) -> tuple[int, ...]:
        """Every collective of every bucket, in issue order."""
        return tuple(index for ids in self.ids for index in ids)

    def ready(
        self, key: str, out: list[Instruction], *, eager: bool = True, name: str | None = None
    ) -> None:
        for missing in self.missing[self.next :]:
            missing.discard(key)
        if eager:
            self.flush(out, force=False, name=name)

    def flush(self, out: list[Instruction], *, force: bool, name: str | None = None) -> None:
        while self.next < len(self.buckets) and (force or not self.missing[self.next]):
            self.launch(self.next, out, name)
            self.next += 1

    def launch(self, index: int, out: list[Instruction], name: str | None) -> None:
        """Post bucket ``index``'s collectives."""
        for collective in self.ids[index]:
            issue(self.builder, collective, out, name)


#: The channel of a scheduled window's chunks (the scheduler's own process group).
SCHEDULER_CHANNEL = "scheduler"


class ScheduledWindow:
    """The backward window's buckets as chunks issued in one planned order
    (``comm_scheduler="priority"``; :mod:`spdkfac.sim.window`).

    Each chunk of :class:`~spdkfac.planning.schedule.CommSchedule` ``order`` is one all-reduce
    on :data:`SCHEDULER_CHANNEL`. A stream hands a bucket over when it is complete and
    every bucket before it in the stream was handed over; the window then posts the chunks
    of ``order`` from where it stopped, up to the first whose bucket is not handed over
    yet (a rank waits for a chunk's data). The gradient stream's forced flush is the end of
    the backward pass: every factor bucket still incomplete is handed over then, with what
    it has, before the gradient buckets left. :meth:`stream` gives each stream a
    :class:`BucketLauncher`.
    """

    def __init__(
        self,
        builder: IterationBuilder,
        schedule: CommSchedule,
        buckets: Mapping[str, tuple[tuple[str, ...], ...]],
    ) -> None:
        for stream in STREAMS:
            if len(buckets[stream]) != len(schedule.sizes(stream)):
                raise ValueError(
                    f"the schedule has {len(schedule.sizes(stream))} {stream} calls, the "
                    f"iteration {len(buckets[stream])} buckets"
                )
        self.builder, self.schedule = builder, schedule
        sizes = {stream: schedule.sizes(stream) for stream in STREAMS}
        step = schedule.chunk_elements
        self.ids: dict[tuple[str, int, int], int] = {}
        for stream, index, chunk in schedule.order:
            elements = max(0, min(step, sizes[stream][index] - chunk * step))
            self.ids[stream, index, chunk] = builder.collective(
                f"{stream} bucket {index} chunk {chunk}",
                SCHEDULER_CHANNEL,
                CollectiveOp.ALL_REDUCE,
                float(BYTES_PER_ELEMENT * elements),
            )
        self.handed: set[tuple[str, int]] = set()
        self.position = 0
        self.streams = {stream: _Stream(self, stream, buckets[stream]) for stream in STREAMS}

    def stream(self, name: str) -> BucketLauncher:
        """The launcher of stream ``name``."""
        return self.streams[name]

    def hand_over(self, stream: str, index: int, out: list[Instruction], name: str | None) -> None:
        """Bucket ``index`` of ``stream`` is launched: post what the order now allows."""
        self.handed.add((stream, index))
        order = self.schedule.order
        while self.position < len(order) and order[self.position][:2] in self.handed:
            issue(self.builder, self.ids[order[self.position]], out, name)
            self.position += 1


class _Stream(Launcher):
    """One stream's :class:`BucketLauncher` in a :class:`ScheduledWindow`: a bucket's
    launch hands it over to the window."""

    def __init__(
        self, window: ScheduledWindow, stream: str, buckets: tuple[tuple[str, ...], ...]
    ) -> None:
        chunks: list[list[int]] = [[] for _ in buckets]
        for (name, index, _), collective in window.ids.items():
            if name == stream:
                chunks[index].append(collective)
        super().__init__(window.builder, buckets, [tuple(ids) for ids in chunks])
        self.window, self.stream = window, stream

    def flush(self, out: list[Instruction], *, force: bool, name: str | None = None) -> None:
        if force and self.stream == GRADIENTS:  # the backward pass ends
            self.window.streams[FACTORS].flush(out, force=True, name=name)
        super().flush(out, force=force, name=name)

    def launch(self, index: int, out: list[Instruction], name: str | None) -> None:
        self.window.hand_over(self.stream, index, out, name)
