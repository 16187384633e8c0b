"""What a collective costs on a cluster: the cheapest candidate algorithm per message size.

A :class:`NetworkModel` holds per collective the candidate algorithms; a message takes the
cheapest (:class:`CollectiveCost`), standing in for NCCL's tuner, which picks ring or tree
per size from a cost model of the same shape. An ``anchor`` (:class:`Anchor`) scales
every line so that at one measured world size the first candidate reproduces measured
α-β lines exactly (how the SPD-KFAC paper's 64-GPU fit becomes one point of the model).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from spdkfac.costmodel import AlphaBetaModel
from spdkfac.sim.collectives import MIRRORS, Algorithm, CollectiveOp, Topology
from spdkfac.support.checks import check_int

__all__ = ["Anchor", "CollectiveCost", "Network", "NetworkModel"]

_ZERO = AlphaBetaModel(alpha=0.0, beta=0.0)


@dataclass(frozen=True)
class CollectiveCost(AlphaBetaModel):
    """The cheapest of several algorithms' ``α + β·bytes`` lines, per message size.

    ``alpha`` and ``beta`` are the line cheapest for the smallest messages (what a planner
    reading one α-β pair sees: the start-up a fused message saves); :meth:`predict` and
    :meth:`choose` take the lower envelope of every line.

    Attributes:
        lines: One line per candidate algorithm.
        names: The algorithms' names, aligned with ``lines``.
    """

    lines: tuple[AlphaBetaModel, ...] = ()
    names: tuple[str, ...] = ()

    @classmethod
    def of(cls, names: tuple[str, ...], lines: tuple[AlphaBetaModel, ...]) -> CollectiveCost:
        """The envelope of ``lines`` (at least one)."""
        if not lines or len(names) != len(lines):
            raise ValueError("a collective cost needs one name per line and at least one line")
        first = min(lines, key=lambda line: (line.alpha, line.beta))
        return cls(alpha=first.alpha, beta=first.beta, lines=lines, names=names)

    def choose(self, nbytes: float) -> tuple[str, AlphaBetaModel]:
        """The algorithm and line cheapest for an ``nbytes``-byte message (first on ties)."""
        if not self.lines:
            return "alpha-beta", AlphaBetaModel(alpha=self.alpha, beta=self.beta)
        index = min(range(len(self.lines)), key=lambda i: self.lines[i].predict(nbytes))
        return self.names[index], self.lines[index]

    def predict(self, nbytes: float) -> float:
        """Seconds of the cheapest algorithm for ``nbytes`` bytes."""
        return self.choose(nbytes)[1].predict(nbytes)


class Network(Protocol):
    """What a simulated run asks of its network."""

    def cost(self, op: CollectiveOp, world_size: int) -> CollectiveCost:
        """The cost of ``op`` on ``world_size`` ranks."""
        ...

    def at(self, world_size: int) -> tuple[AlphaBetaModel, AlphaBetaModel]:
        """(broadcast, all-reduce) at ``world_size``."""
        ...

    def calibrated(self, measured: Mapping[int, tuple[AlphaBetaModel, AlphaBetaModel]]) -> Network:
        """This network fitted to (broadcast, all-reduce) lines measured per world size."""
        ...


@dataclass(frozen=True)
class Anchor:
    """Measured α-β lines at one world size that a :class:`NetworkModel` must reproduce.

    Every algorithm's α at world size P is ``measured α · α_alg(P) / α_first(P₀)``, its β
    likewise, where ``first`` is the collective's first candidate and P₀ ``world_size``:
    at P₀ the first candidate gives the measured line exactly, elsewhere the model's shape.
    Collectives without a measured line scale as their mirror does when it was measured
    (a reduce as the broadcast: :data:`~spdkfac.sim.collectives.MIRRORS`), else as
    ``fallback`` does (same links).

    Attributes:
        world_size: Where the lines were measured (P₀ > 1).
        lines: Collective → measured line.
        fallback: The collective whose scale unmeasured ones take.
    """

    world_size: int
    lines: Mapping[CollectiveOp, AlphaBetaModel]
    fallback: CollectiveOp = CollectiveOp.ALL_REDUCE

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, low=2)
        if self.fallback not in self.lines:
            raise ValueError(f"an anchor needs a measured {self.fallback.value} line")
        object.__setattr__(self, "lines", MappingProxyType(dict(self.lines)))


@dataclass(frozen=True, kw_only=True)
class NetworkModel:
    """Candidate algorithms per collective on a :class:`Topology` (module docstring).

    Attributes:
        name: Short name for reports.
        description: One line naming the hardware.
        topology: Nodes and links.
        algorithms: Collective → candidate algorithms (the first is the one an
            ``anchor`` calibrates).
        anchor: Measured lines the model is scaled to reproduce, if any.
    """

    name: str
    description: str
    topology: Topology
    algorithms: Mapping[CollectiveOp, tuple[Algorithm, ...]]
    anchor: Anchor | None = None
    _anchors: Mapping[CollectiveOp, tuple[AlphaBetaModel, AlphaBetaModel]] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        missing = [op.value for op in CollectiveOp if not self.algorithms.get(op)]
        if missing:
            raise ValueError(f"network {self.name!r} has no algorithm for {', '.join(missing)}")
        object.__setattr__(self, "algorithms", MappingProxyType(dict(self.algorithms)))
        if self.anchor is not None:
            pairs = MappingProxyType(self._anchor_pairs(self.anchor))
            object.__setattr__(self, "_anchors", pairs)

    def _anchor_pairs(
        self, anchor: Anchor
    ) -> dict[CollectiveOp, tuple[AlphaBetaModel, AlphaBetaModel]]:
        """Collective → (measured line, the model's first candidate at the anchor)."""
        pairs: dict[CollectiveOp, tuple[AlphaBetaModel, AlphaBetaModel]] = {}
        for op in CollectiveOp:
            measured_op = op if op in anchor.lines else MIRRORS.get(op, anchor.fallback)
            if measured_op not in anchor.lines:
                measured_op = anchor.fallback
            model = self.algorithms[measured_op][0].line(
                measured_op, self.topology, anchor.world_size
            )
            if model.alpha <= 0 or model.beta <= 0:
                raise ValueError(f"network {self.name!r}: cannot anchor a free {op.value}")
            pairs[op] = (anchor.lines[measured_op], model)
        return pairs

    def scales(self, op: CollectiveOp) -> tuple[float, float]:
        """The factors the anchor puts on the model's α and β of ``op`` (1, 1 without)."""
        pair = self._anchors.get(op)
        if pair is None:
            return 1.0, 1.0
        measured, model = pair
        return measured.alpha / model.alpha, measured.beta / model.beta

    def cost(self, op: CollectiveOp, world_size: int) -> CollectiveCost:
        """The cost of ``op`` on ``world_size`` ranks (free on one rank)."""
        candidates = self.algorithms[op]
        names = tuple(algorithm.name for algorithm in candidates)
        if world_size <= 1:
            return CollectiveCost.of(names, tuple(_ZERO for _ in candidates))
        lines = tuple(algorithm.line(op, self.topology, world_size) for algorithm in candidates)
        pair = self._anchors.get(op)
        if pair is not None:
            # measured · (model / model at the anchor): exactly the measured line there.
            measured, base = pair
            lines = tuple(
                AlphaBetaModel(
                    measured.alpha * (line.alpha / base.alpha),
                    measured.beta * (line.beta / base.beta),
                )
                for line in lines
            )
        return CollectiveCost.of(names, lines)

    def at(self, world_size: int) -> tuple[CollectiveCost, CollectiveCost]:
        """(broadcast, all-reduce) at ``world_size``."""
        return (
            self.cost(CollectiveOp.BROADCAST, world_size),
            self.cost(CollectiveOp.ALL_REDUCE, world_size),
        )

    def calibrated(
        self, measured: Mapping[int, tuple[AlphaBetaModel, AlphaBetaModel]]
    ) -> NetworkModel:
        """This network anchored to (broadcast, all-reduce) lines measured at the largest of
        the given world sizes (``spdkfac calibrate``'s)."""
        size = max(measured)
        broadcast, allreduce = measured[size]
        lines = {CollectiveOp.BROADCAST: broadcast, CollectiveOp.ALL_REDUCE: allreduce}
        return NetworkModel(
            name=f"{self.name}@{size}",
            description=f"{self.description}, calibrated at {size} ranks",
            topology=self.topology,
            algorithms=self.algorithms,
            anchor=Anchor(size, lines),
        )
