"""Collectives of one simulated iteration and the order ranks post them in."""

from __future__ import annotations

from collections.abc import Sequence

from spdkfac.sim.collectives import CollectiveOp
from spdkfac.sim.program import Collective, Compute, Instruction, Issue
from spdkfac.sim.strategies import StrategySetup

__all__ = ["IterationBuilder", "Launcher", "factor_channel", "issue"]


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
            for collective in self.ids[self.next]:
                issue(self.builder, collective, out, name)
            self.next += 1
