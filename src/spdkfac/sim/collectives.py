"""Closed-form collective costs on a cluster: ring and tree algorithms over a two-level network.

A cluster is nodes of ``G`` accelerators joined inside a node by a fast link (NVLink, PCIe)
and across nodes by a slower network (InfiniBand, Ethernet); each level has its own
α (seconds per algorithm step) and β (seconds per byte). On ``p`` ranks of one level, for
an ``n``-byte buffer (the whole buffer: the input of an all-reduce, reduce-scatter, reduce
or broadcast, the output of an all-gather):

=====================  ================================  ==========================
algorithm              start-up                          transfer
=====================  ================================  ==========================
ring all-reduce        2(p−1)·α                          2(p−1)/p · n·β
tree all-reduce        2⌈log₂p⌉·α                        2 · n·β
ring reduce-scatter    (p−1)·α                           (p−1)/p · n·β
ring all-gather        (p−1)·α                           (p−1)/p · n·β
chain broadcast        (p−1)·α                           n·β
tree broadcast         ⌈log₂p⌉·α                         n·β
chain reduce           (p−1)·α                           n·β
tree reduce            ⌈log₂p⌉·α                         n·β
=====================  ================================  ==========================

A reduce (every rank's buffer summed at one root) is a broadcast run backwards: the same
messages along the same chain or tree, each node combining what arrives with its own
buffer before it forwards it. Its reduction arithmetic is not costed separately (it is
pipelined with the transfer, at memory speed, as the all-reduce's and the
reduce-scatter's is in their lines).

The ring forms are the bandwidth-optimal ring of Patarasuk and Yuan ("Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009) and Thakur, Rabenseifner
and Gropp ("Optimization of collective communication operations in MPICH", IJHPCA 2005);
the tree forms are the pipelined double binary tree of Sanders, Speck and Träff ("Two-tree
algorithms for full bandwidth broadcast, reduction and scan", Parallel Computing 2009),
which NCCL 2.4 adopted for all-reduce (NVIDIA blog "Massively Scale Your Deep Learning
Training with NCCL 2.4", 2019): a reduction up the trees and a broadcast down them, each
node sending and receiving ``n`` bytes per direction in each, with ⌈log₂p⌉ levels.

Algorithms over the whole cluster (:class:`Flat`, :class:`Hierarchical`) compose these:

* **flat**: one ring (or tree) through all P ranks, as NCCL's ring runs across nodes with
  one channel per NIC. Every step waits for its slowest hop, so with more than one node a
  step costs the larger α and the larger β of the two levels (the inter-node β is per node:
  all its NICs together, which one ring step's ``n/P`` bytes per node cross);
* **hierarchical**: reduce-scatter inside each node, then the ``G`` slices all-reduced
  across the ``N`` nodes (``G`` concurrent all-reduces of ``n/G`` bytes sharing the node's
  NICs: ``n`` bytes at the per-node rate), then all-gather inside the node (Horovod's
  hierarchical all-reduce, NCCL's tree across nodes). Reduce-scatter and all-gather run
  their two phases likewise; a broadcast crosses the nodes, then the node (a reduce the
  node, then the nodes). Phases are
  summed, not pipelined into each other (pessimistic for large messages, where the flat
  ring then wins).

:mod:`spdkfac.sim.network` picks, per message, the cheapest of a collective's candidate
algorithms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Final, Protocol

from spdkfac.costmodel import AlphaBetaModel
from spdkfac.support.checks import check_int, check_number

__all__ = [
    "MIRRORS",
    "Algorithm",
    "CollectiveOp",
    "Flat",
    "Hierarchical",
    "Link",
    "Shape",
    "Topology",
    "flat_line",
]

_ZERO = AlphaBetaModel(alpha=0.0, beta=0.0)


class CollectiveOp(str, Enum):
    """A collective operation the simulator can cost."""

    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    REDUCE = "reduce"


#: A collective costed as another: the same messages in the other direction.
MIRRORS: Final[Mapping[CollectiveOp, CollectiveOp]] = MappingProxyType(
    {CollectiveOp.REDUCE: CollectiveOp.BROADCAST}
)


class Shape(str, Enum):
    """How ranks of one level are connected for a collective."""

    RING = "ring"  # a ring; for a broadcast, the pipelined chain along it
    TREE = "tree"  # a pipelined double binary tree


@dataclass(frozen=True, kw_only=True)
class Link:
    """One level of the network.

    Attributes:
        name: For reports (``"NVLink"``, ``"4x EDR InfiniBand"``).
        alpha: Seconds per algorithm step (latency of one hop, software included).
        beta: Seconds per byte: per accelerator inside a node, per node across nodes.
    """

    name: str
    alpha: float
    beta: float

    def __post_init__(self) -> None:
        check_number("alpha", self.alpha, low_inclusive=True)
        check_number("beta", self.beta, low_inclusive=True)

    @classmethod
    def rated(
        cls, name: str, *, gbit_per_second: float, efficiency: float, latency_seconds: float
    ) -> Link:
        """A link moving ``efficiency`` of ``gbit_per_second`` (all lanes or NICs together)."""
        check_number("gbit_per_second", gbit_per_second)
        check_number("efficiency", efficiency, high=1.0, high_inclusive=True)
        return cls(
            name=name, alpha=latency_seconds, beta=8.0 / (gbit_per_second * 1e9 * efficiency)
        )


def _depth(ranks: int) -> int:
    return math.ceil(math.log2(ranks)) if ranks > 1 else 0


def _line(alpha: float, beta: float) -> AlphaBetaModel:
    return AlphaBetaModel(alpha=alpha, beta=beta)


#: (op, shape) → p ↦ (start-up steps, transfer factor on n·β): the table above.
_STEPS: Mapping[tuple[CollectiveOp, Shape], Callable[[int], tuple[float, float]]] = {
    (CollectiveOp.ALL_REDUCE, Shape.RING): lambda p: (2 * (p - 1), 2 * (p - 1) / p),
    (CollectiveOp.ALL_REDUCE, Shape.TREE): lambda p: (2 * _depth(p), 2.0),
    (CollectiveOp.REDUCE_SCATTER, Shape.RING): lambda p: (p - 1, (p - 1) / p),
    (CollectiveOp.ALL_GATHER, Shape.RING): lambda p: (p - 1, (p - 1) / p),
    (CollectiveOp.BROADCAST, Shape.RING): lambda p: (p - 1, 1.0),
    (CollectiveOp.BROADCAST, Shape.TREE): lambda p: (_depth(p), 1.0),
    (CollectiveOp.REDUCE, Shape.RING): lambda p: (p - 1, 1.0),
    (CollectiveOp.REDUCE, Shape.TREE): lambda p: (_depth(p), 1.0),
}


def flat_line(op: CollectiveOp, shape: Shape, ranks: int, link: Link) -> AlphaBetaModel:
    """The closed form of ``op`` on ``ranks`` ranks of one ``link`` (module table).

    Raises:
        ValueError: A shape the collective has no form for (a tree reduce-scatter).
    """
    form = _STEPS.get((op, shape))
    if form is None:
        raise ValueError(f"no {shape.value} form of {op.value}")
    if ranks <= 1:
        return _ZERO
    steps, traffic = form(ranks)
    return _line(steps * link.alpha, traffic * link.beta)


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Nodes of ``gpus_per_node`` accelerators.

    Attributes:
        gpus_per_node: Accelerators per node (G).
        intra: The link inside a node (β per accelerator).
        inter: The network between nodes (β per node: every NIC of the node together).
    """

    gpus_per_node: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        check_int("gpus_per_node", self.gpus_per_node, low=1)

    def layout(self, world_size: int) -> tuple[int, int]:
        """(ranks per node, nodes) of ``world_size`` ranks, nodes filled first.

        A world size that is not a multiple of G above one node counts its last, partly
        filled node as a full one (an upper bound on the cost).
        """
        per_node = max(1, min(self.gpus_per_node, world_size))
        return per_node, math.ceil(world_size / per_node)

    def bottleneck(self, world_size: int) -> Link:
        """The link a flat algorithm's every step waits for: inside one node, the intra
        link; across nodes, the larger α and the larger β of the two levels."""
        _, nodes = self.layout(world_size)
        if nodes == 1:
            return self.intra
        return Link(
            name=f"{self.intra.name} + {self.inter.name}",
            alpha=max(self.intra.alpha, self.inter.alpha),
            beta=max(self.intra.beta, self.inter.beta),
        )


class Algorithm(Protocol):
    """A way to run collectives over a whole cluster."""

    @property
    def name(self) -> str: ...

    def line(self, op: CollectiveOp, topology: Topology, world_size: int) -> AlphaBetaModel:
        """Its cost of ``op`` on ``world_size`` ranks as ``α + β·bytes``."""
        ...


@dataclass(frozen=True)
class Flat:
    """One ring or tree through every rank (see the module docstring)."""

    shape: Shape

    @property
    def name(self) -> str:
        return f"flat {self.shape.value}"

    def line(self, op: CollectiveOp, topology: Topology, world_size: int) -> AlphaBetaModel:
        return flat_line(op, self.shape, world_size, topology.bottleneck(world_size))


@dataclass(frozen=True)
class _Phase:
    op: CollectiveOp
    across_nodes: bool


#: The phases of each collective run hierarchically, in order.
_PHASES: Mapping[CollectiveOp, tuple[_Phase, ...]] = MappingProxyType(
    {
        CollectiveOp.ALL_REDUCE: (
            _Phase(CollectiveOp.REDUCE_SCATTER, False),
            _Phase(CollectiveOp.ALL_REDUCE, True),
            _Phase(CollectiveOp.ALL_GATHER, False),
        ),
        CollectiveOp.REDUCE_SCATTER: (
            _Phase(CollectiveOp.REDUCE_SCATTER, False),
            _Phase(CollectiveOp.REDUCE_SCATTER, True),
        ),
        CollectiveOp.ALL_GATHER: (
            _Phase(CollectiveOp.ALL_GATHER, True),
            _Phase(CollectiveOp.ALL_GATHER, False),
        ),
        CollectiveOp.BROADCAST: (
            _Phase(CollectiveOp.BROADCAST, True),
            _Phase(CollectiveOp.BROADCAST, False),
        ),
        CollectiveOp.REDUCE: (  # the broadcast's phases, backwards
            _Phase(CollectiveOp.REDUCE, False),
            _Phase(CollectiveOp.REDUCE, True),
        ),
    }
)


@dataclass(frozen=True)
class Hierarchical:
    """Inside the nodes on rings, across them with ``across`` (see the module docstring).

    A reduce-scatter or all-gather has no tree form; a tree ``across`` runs them on rings.
    """

    across: Shape

    @property
    def name(self) -> str:
        return f"hierarchical {self.across.value}"

    def line(self, op: CollectiveOp, topology: Topology, world_size: int) -> AlphaBetaModel:
        per_node, nodes = topology.layout(world_size)
        alpha = beta = 0.0
        for phase in _PHASES[op]:
            if phase.across_nodes:
                shape = self.across if (phase.op, self.across) in _STEPS else Shape.RING
                part = flat_line(phase.op, shape, nodes, topology.inter)
            else:
                part = flat_line(phase.op, Shape.RING, per_node, topology.intra)
            alpha, beta = alpha + part.alpha, beta + part.beta
        return _line(alpha, beta)
