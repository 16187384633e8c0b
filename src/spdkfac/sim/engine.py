"""The discrete-event engine: per-rank programs, FIFO collective channels, a shared link.

Each rank runs a straight-line program (:mod:`spdkfac.sim.program`) on one compute stream:
``Compute`` takes time, ``Open``/``Close`` bracket a named span, ``Issue`` posts a
collective without blocking, ``Wait`` blocks until collectives complete. Collectives
belong to a *channel* (a process group): on every rank a channel runs its collectives one
at a time, in issue order, so a collective starts when every participant has issued it and
finished the previous one on that channel. It then spends ``alpha`` seconds of start-up
(no bandwidth) and ``work`` seconds of transfer at the full link rate. Transfers of
different channels that overlap share each rank's link equally (processor sharing; a
collective moves at the rate of its most loaded participant), which conserves bytes: two
channels cannot beat one link.

Communication and computation can get in each other's way (both default off):
``overlap`` < 1 is the share of its rate a transfer keeps while any participant computes;
``contention`` > 0 slows a rank's computation by that share while one of its collectives
is under way, start-up included (gloo's threads copying and reducing on the same CPU
cores, NCCL kernels taking GPU SMs). A collective may carry its own values of both
(a broadcast reduces nothing and may cost the CPUs less than an all-reduce); a rank
computing under several collectives at once is slowed by the largest contention, times
the rank's own ``sensitivity`` (how hard the communication threads hit it this time).

Everything happens in global time order (a heap of events), so results are exact up to
floating-point rounding and independent of the order ranks are listed in.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from spdkfac.profiling import Event
from spdkfac.sim.program import (
    Close,
    Collective,
    Compute,
    Issue,
    Open,
    Program,
    SimulationResult,
)

__all__ = ["simulate"]

_EPS = 1e-12


@dataclass
class _Moving:
    """Work in progress at a rate that can change: a transfer or a computation."""

    remaining: float
    rate: float = 1.0
    since: float = 0.0
    version: int = 0

    def advance(self, now: float) -> None:
        self.remaining -= (now - self.since) * self.rate
        self.since = now

    def due(self) -> float | None:
        return None if self.rate <= 0 else self.since + max(self.remaining, 0.0) / self.rate


@dataclass
class _Work(_Moving):
    name: str | None = None
    started: float = 0.0


class _Engine:
    def __init__(
        self,
        programs: Sequence[Program],
        collectives: Sequence[Collective],
        overlap: float,
        contention: float,
        sensitivity: Sequence[float] | None = None,
    ) -> None:
        ranks = len(programs)
        self.sensitivity = list(sensitivity) if sensitivity is not None else [1.0] * ranks
        if len(self.sensitivity) != ranks or any(not s >= 0 for s in self.sensitivity):
            raise ValueError("sensitivity needs one number >= 0 per rank")
        for name, value in (("overlap", overlap), ("contention", contention)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        if contention >= 1.0:
            raise ValueError("contention must be < 1 (computation would never finish)")
        for index, collective in enumerate(collectives):
            if not collective.participants or any(
                not 0 <= rank < ranks for rank in collective.participants
            ):
                raise ValueError(f"collective {index} ({collective.label}) has bad participants")
            if collective.alpha < 0 or collective.work < 0:
                raise ValueError(f"collective {index} ({collective.label}) has a negative cost")
            if collective.overlap is not None and not 0.0 <= collective.overlap <= 1.0:
                raise ValueError(f"collective {index} ({collective.label}) has a bad overlap")
            if collective.contention is not None and not 0.0 <= collective.contention < 1.0:
                raise ValueError(f"collective {index} ({collective.label}) has a bad contention")
        self.programs, self.collectives = programs, collectives
        self.overlaps = [overlap if c.overlap is None else c.overlap for c in collectives]
        self.contentions = [
            contention if c.contention is None else c.contention for c in collectives
        ]
        self.interacts = any(v < 1.0 for v in self.overlaps) or any(
            v > 0.0 for v in self.contentions
        )
        self.now = 0.0
        self.heap: list[tuple[float, int, str, int, int]] = []
        self.counter = itertools.count()
        self.events: list[Event] = []
        self.pc = [0] * ranks
        self.finish = [0.0] * ranks
        self.work: list[_Work | None] = [None] * ranks
        self.spans: list[list[tuple[str, float]]] = [[] for _ in range(ranks)]
        self.waiting: list[tuple[tuple[int, ...], str | None, float] | None] = [None] * ranks
        self.issued: list[set[int]] = [set() for _ in collectives]
        # Per (rank, channel): collectives issued there and not yet completed, in order.
        self.queues: dict[tuple[int, str], list[int]] = {}
        self.starts: list[float | None] = [None] * len(collectives)
        self.ends: list[float | None] = [None] * len(collectives)
        self.active: dict[int, _Moving] = {}
        self.starting: set[int] = set()  # collectives in their start-up (α) phase
        self.link_version = 0

    def push(self, when: float, kind: str, payload: int, version: int = 0) -> None:
        heapq.heappush(self.heap, (when, next(self.counter), kind, payload, version))

    def run(self) -> SimulationResult:
        for rank in range(len(self.pc)):
            self.push(0.0, "resume", rank)
        while self.heap:
            when, _, kind, payload, version = heapq.heappop(self.heap)
            self.now = when
            if kind == "resume":
                self.resume(payload)
            elif kind == "computed":
                work = self.work[payload]
                if work is not None and work.version == version:
                    self.computed(payload, work)
            elif kind == "latency":
                self.advance_all()
                self.starting.discard(payload)
                self.active[payload] = _Moving(self.collectives[payload].work, since=self.now)
                self.relink()
            elif kind == "link" and version == self.link_version:
                self.complete_transfers()
        stuck = [
            rank
            for rank, pc in enumerate(self.pc)
            if pc < len(self.programs[rank]) or self.waiting[rank] is not None
        ]
        if stuck:
            raise RuntimeError(f"deadlock: ranks {stuck} wait on collectives that never start")
        events = sorted(self.events, key=lambda e: (e.rank, e.start, -e.duration))
        return SimulationResult(events, self.finish, self.starts, self.ends)

    # ------------------------------------------------------------------ ranks
    def resume(self, rank: int) -> None:
        program = self.programs[rank]
        while self.pc[rank] < len(program):
            instruction = program[self.pc[rank]]
            self.pc[rank] += 1
            if isinstance(instruction, Compute):
                if instruction.seconds < 0:
                    raise ValueError(f"negative compute time on rank {rank}: {instruction}")
                if instruction.seconds > 0:
                    self.start_work(rank, instruction)
                    return
            elif isinstance(instruction, Open):
                self.spans[rank].append((instruction.name, self.now))
            elif isinstance(instruction, Close):
                self.close(rank, instruction.name)
            elif isinstance(instruction, Issue):
                self.issue(rank, instruction.collective)
            elif not all(self.ends[c] is not None for c in instruction.collectives):
                self.waiting[rank] = (instruction.collectives, instruction.name, self.now)
                return
        self.finish[rank] = self.now
        if self.spans[rank]:
            raise ValueError(f"rank {rank} ended with open spans {self.spans[rank]}")

    def start_work(self, rank: int, instruction: Compute) -> None:
        work = _Work(instruction.seconds, since=self.now, name=instruction.name, started=self.now)
        if self.interacts:
            self.advance_all()
            self.work[rank] = work
            self.relink()  # the rank now computes: its transfers may slow, it may slow
        else:
            self.work[rank] = work
            work.version = next(self.counter)
            self.push(self.now + work.remaining, "computed", rank, work.version)

    def computed(self, rank: int, work: _Work) -> None:
        if self.interacts:
            self.advance_all()
        self.work[rank] = None
        if work.name is not None:
            self.events.append(Event(work.name, rank, work.started, self.now - work.started))
        if self.interacts and self.active:
            self.relink()
        self.resume(rank)

    def close(self, rank: int, name: str) -> None:
        for position in range(len(self.spans[rank]) - 1, -1, -1):
            if self.spans[rank][position][0] == name:
                _, began = self.spans[rank].pop(position)
                self.events.append(Event(name, rank, began, self.now - began))
                return
        raise ValueError(f"rank {rank} closes span {name!r} that is not open")

    def wake(self, rank: int) -> None:
        pending = self.waiting[rank]
        if pending is None or not all(self.ends[c] is not None for c in pending[0]):
            return
        _, name, since = pending
        self.waiting[rank] = None
        if name is not None and self.now > since:
            self.events.append(Event(name, rank, since, self.now - since))
        self.push(self.now, "resume", rank)

    # ------------------------------------------------------------------ collectives
    def issue(self, rank: int, index: int) -> None:
        collective = self.collectives[index]
        if rank not in collective.participants:
            raise ValueError(f"rank {rank} issues {collective.label} it does not take part in")
        if rank in self.issued[index]:
            raise ValueError(f"rank {rank} issues {collective.label} twice")
        self.issued[index].add(rank)
        self.queues.setdefault((rank, collective.channel), []).append(index)
        self.try_start(index)

    def try_start(self, index: int) -> None:
        collective = self.collectives[index]
        if self.starts[index] is not None:
            return
        if len(self.issued[index]) < len(collective.participants):
            return
        if any(self.queues[(r, collective.channel)][0] != index for r in collective.participants):
            return
        self.starts[index] = self.now
        if self.contentions[index] > 0:  # its start-up occupies the ranks too
            self.advance_all()
            self.starting.add(index)
            self.relink()
        self.push(self.now + collective.alpha, "latency", index)

    def advance_all(self) -> None:
        for moving in self.active.values():
            moving.advance(self.now)
        if self.interacts:
            for work in self.work:
                if work is not None:
                    work.advance(self.now)

    def relink(self) -> None:
        """Recompute every rate after a change (call :meth:`advance_all` first)."""
        load: dict[int, int] = {}
        for index in self.active:
            for rank in self.collectives[index].participants:
                load[rank] = load.get(rank, 0) + 1
        self.link_version += 1
        soonest: float | None = None
        for index, moving in self.active.items():
            participants = self.collectives[index].participants
            computing = any(self.work[r] is not None for r in participants)
            share = self.overlaps[index] if computing else 1.0
            moving.rate = share / max(load[r] for r in participants)
            due = moving.due()
            if due is not None:
                soonest = due if soonest is None else min(soonest, due)
        if soonest is not None:
            self.push(soonest, "link", 0, self.link_version)
        if not self.interacts:
            return
        slowed: dict[int, float] = {}
        for index in (*self.active, *self.starting):
            for rank in self.collectives[index].participants:
                slowed[rank] = max(slowed.get(rank, 0.0), self.contentions[index])
        for rank, work in enumerate(self.work):
            if work is None:
                continue
            rate = 1.0 - min(0.95, slowed.get(rank, 0.0) * self.sensitivity[rank])
            if rate != work.rate or work.version == 0:
                work.rate = rate
                work.version = next(self.counter)  # unique: stale events never match
                due = work.due()
                assert due is not None
                self.push(due, "computed", rank, work.version)

    def complete_transfers(self) -> None:
        self.advance_all()
        finished = [i for i, moving in self.active.items() if moving.remaining <= _EPS]
        if not finished:  # rounding left a sliver: finish the closest moving one
            moving = [i for i, m in self.active.items() if m.rate > 0]
            finished = [min(moving, key=lambda i: self.active[i].remaining)]
        for index in finished:
            del self.active[index]
        self.relink()
        for index in finished:
            self.complete(index)

    def complete(self, index: int) -> None:
        collective = self.collectives[index]
        self.ends[index] = self.now
        for rank in collective.participants:
            queue = self.queues[(rank, collective.channel)]
            queue.remove(index)
            if queue:
                self.try_start(queue[0])
        for rank in collective.participants:
            self.wake(rank)


def simulate(
    programs: Sequence[Program],
    collectives: Sequence[Collective],
    *,
    overlap: float = 1.0,
    contention: float = 0.0,
    sensitivity: Sequence[float] | None = None,
) -> SimulationResult:
    """Run one program per rank (rank = position) with the given collectives.

    Args:
        programs: One instruction list per rank.
        collectives: Everything the programs issue, by index.
        overlap: Share of its link rate a transfer keeps while any participant computes.
        contention: Share of its speed a rank's computation loses while one of its
            collectives is under way (start-up or transfer).
        sensitivity: Per rank, a factor on every contention it suffers (default 1; the
            loss is capped at 95 % of its speed).

    Raises:
        ValueError: Malformed programs (negative times, unbalanced spans, a rank issuing a
            collective it is not part of, or twice) or knobs outside [0, 1).
        RuntimeError: A deadlock (a rank waits for a collective that can never start).
    """
    return _Engine(programs, collectives, overlap, contention, sensitivity).run()
