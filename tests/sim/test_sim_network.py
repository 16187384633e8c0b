"""The collective cost model against closed forms and hand-checked hierarchical cases."""

from __future__ import annotations

import math

import pytest

from spdkfac.costmodel import AlphaBetaModel
from spdkfac.sim import (
    NETWORKS,
    PRESETS,
    Anchor,
    CollectiveCost,
    CollectiveOp,
    Flat,
    Hierarchical,
    Link,
    NetworkModel,
    Shape,
    Topology,
    paper_preset,
)
from spdkfac.sim.clusters import NCCL_LIKE, RING_ONLY
from spdkfac.sim.collectives import flat_line
from spdkfac.sim.paper import PAPER_ALLREDUCE, PAPER_BROADCAST

AR, BC, RD = CollectiveOp.ALL_REDUCE, CollectiveOp.BROADCAST, CollectiveOp.REDUCE
RS, AG = CollectiveOp.REDUCE_SCATTER, CollectiveOp.ALL_GATHER
US = 1e-6
# Inside a node 1 µs and 1e-10 s/byte; across nodes 10 µs and 1e-9 s/byte per node.
FAST = Link(name="fast", alpha=1 * US, beta=1e-10)
SLOW = Link(name="slow", alpha=10 * US, beta=1e-9)


def _close(line: AlphaBetaModel, alpha: float, beta: float) -> None:
    assert line.alpha == pytest.approx(alpha, rel=1e-12, abs=1e-18)
    assert line.beta == pytest.approx(beta, rel=1e-12, abs=1e-24)


@pytest.mark.parametrize("ranks", [2, 3, 4, 7, 8, 64, 1000, 1024])
def test_ring_forms(ranks: int) -> None:
    a, b = SLOW.alpha, SLOW.beta
    _close(flat_line(AR, Shape.RING, ranks, SLOW), 2 * (ranks - 1) * a, 2 * (ranks - 1) / ranks * b)
    _close(flat_line(RS, Shape.RING, ranks, SLOW), (ranks - 1) * a, (ranks - 1) / ranks * b)
    _close(flat_line(AG, Shape.RING, ranks, SLOW), (ranks - 1) * a, (ranks - 1) / ranks * b)
    _close(flat_line(BC, Shape.RING, ranks, SLOW), (ranks - 1) * a, b)


@pytest.mark.parametrize(
    ("ranks", "depth"), [(2, 1), (3, 2), (4, 2), (5, 3), (8, 3), (9, 4), (1024, 10), (1025, 11)]
)
def test_tree_forms_have_log_p_start_up(ranks: int, depth: int) -> None:
    assert depth == math.ceil(math.log2(ranks))
    _close(flat_line(AR, Shape.TREE, ranks, SLOW), 2 * depth * SLOW.alpha, 2 * SLOW.beta)
    _close(flat_line(BC, Shape.TREE, ranks, SLOW), depth * SLOW.alpha, SLOW.beta)


def test_one_rank_is_free_and_unknown_forms_are_refused() -> None:
    assert flat_line(AR, Shape.RING, 1, SLOW) == AlphaBetaModel(alpha=0.0, beta=0.0)
    with pytest.raises(ValueError, match="no tree form of reduce_scatter"):
        flat_line(RS, Shape.TREE, 8, SLOW)


def test_one_gpu_per_node_is_the_flat_closed_form() -> None:
    """With one rank per node every hop crosses the network: the flat ring is the ring
    closed form on the slower link, the hierarchical tree the tree closed form."""
    topology = Topology(gpus_per_node=1, intra=FAST, inter=SLOW)
    for ranks in (2, 16, 1024):
        ring = Flat(Shape.RING).line(AR, topology, ranks)
        _close(ring, 2 * (ranks - 1) * SLOW.alpha, 2 * (ranks - 1) / ranks * SLOW.beta)
        tree = Hierarchical(Shape.TREE).line(AR, topology, ranks)
        _close(tree, 2 * math.ceil(math.log2(ranks)) * SLOW.alpha, 2 * SLOW.beta)


def test_hierarchical_by_hand() -> None:
    """16 ranks in 4 nodes of 4 (module docstring of spdkfac.sim.network)."""
    topology = Topology(gpus_per_node=4, intra=FAST, inter=SLOW)
    assert topology.layout(16) == (4, 4) and topology.layout(3) == (3, 1)
    assert topology.layout(6) == (4, 2)  # a partly filled node counts as a full one
    # all-reduce, rings: RS in the node (3 steps, 3/4 β_i), ring all-reduce across the 4
    # nodes (6 steps, 2·3/4 β_o), AG in the node (3 steps, 3/4 β_i).
    _close(Hierarchical(Shape.RING).line(AR, topology, 16), 6 * US + 60 * US, 1.5e-10 + 1.5e-9)
    # NCCL's tree across nodes: 2·⌈log₂4⌉ = 4 steps and 2 β_o.
    _close(Hierarchical(Shape.TREE).line(AR, topology, 16), 6 * US + 40 * US, 1.5e-10 + 2e-9)
    # One flat ring through all 16: 30 steps at the slow α, 2·15/16 of the slow β.
    _close(Flat(Shape.RING).line(AR, topology, 16), 300 * US, 2 * 15 / 16 * 1e-9)
    # reduce-scatter: in the node, then across (3 + 3 steps, 3/4 of each β).
    _close(Hierarchical(Shape.RING).line(RS, topology, 16), 33 * US, 0.75 * 1.1e-9)
    _close(Hierarchical(Shape.TREE).line(AG, topology, 16), 33 * US, 0.75 * 1.1e-9)
    # broadcast: a chain across the nodes, then a chain in each node.
    _close(Hierarchical(Shape.RING).line(BC, topology, 16), 33 * US, 1.1e-9)
    # Within one node, every algorithm is the ring on the fast link.
    for algorithm in (Flat(Shape.RING), Hierarchical(Shape.RING), Hierarchical(Shape.TREE)):
        _close(algorithm.line(AR, topology, 4), 6 * US, 1.5e-10)


def test_the_cheapest_algorithm_wins_per_size() -> None:
    topology = Topology(gpus_per_node=4, intra=FAST, inter=SLOW)
    network = NetworkModel(name="t", description="t", topology=topology, algorithms=NCCL_LIKE)
    cost = network.cost(AR, 16)
    assert isinstance(cost, CollectiveCost)
    assert cost.names == ("flat ring", "hierarchical ring", "hierarchical tree")
    # Tree 46 µs + 2.15e-9·n against the hierarchical ring 66 µs + 1.65e-9·n: they cross
    # at n = 20 µs / 0.5e-9 = 40,000 bytes.
    assert cost.choose(39_000)[0] == "hierarchical tree"
    assert cost.choose(41_000)[0] == "hierarchical ring"
    for nbytes in (0.0, 1e3, 4e4, 1e6, 1e9):
        assert cost.predict(nbytes) == min(line.predict(nbytes) for line in cost.lines)
    # A planner reading one α-β pair sees the small-message line.
    assert (cost.alpha, cost.beta) == (cost.lines[2].alpha, cost.lines[2].beta)
    assert network.cost(AR, 1).predict(1e9) == 0.0


def test_an_anchor_reproduces_its_lines_and_scales_by_the_model() -> None:
    topology = Topology(gpus_per_node=4, intra=FAST, inter=SLOW)
    measured = AlphaBetaModel(alpha=1e-3, beta=2e-9)
    network = NetworkModel(
        name="t",
        description="t",
        topology=topology,
        algorithms=RING_ONLY,
        anchor=Anchor(16, {AR: measured}),
    )
    assert network.cost(AR, 16).lines == (measured,)  # exactly, not to rounding
    ring = Flat(Shape.RING)
    base, there = ring.line(AR, topology, 16), ring.line(AR, topology, 64)
    _close(network.cost(AR, 64), 1e-3 * there.alpha / base.alpha, 2e-9 * there.beta / base.beta)
    # Unmeasured collectives take the all-reduce's scale.
    alpha_scale, beta_scale = network.scales(AR)
    assert network.scales(BC) == (alpha_scale, beta_scale)
    chain = ring.line(BC, topology, 64)
    _close(network.cost(BC, 64), chain.alpha * alpha_scale, chain.beta * beta_scale)
    with pytest.raises(ValueError, match="measured all_reduce"):
        Anchor(16, {BC: measured})


def test_paper_network_is_the_papers_line_at_64_and_grows_beyond() -> None:
    network = paper_preset().communication
    broadcast, allreduce = network.at(64)
    assert (allreduce.alpha, allreduce.beta) == (PAPER_ALLREDUCE.alpha, PAPER_ALLREDUCE.beta)
    assert (broadcast.alpha, broadcast.beta) == (PAPER_BROADCAST.alpha, PAPER_BROADCAST.beta)
    # A ring's start-up grows with P: α(1024)/α(64) = 1023/63 (both span nodes).
    assert network.at(1024)[1].alpha / PAPER_ALLREDUCE.alpha == pytest.approx(1023 / 63)
    assert network.at(8)[1].alpha < PAPER_ALLREDUCE.alpha
    # How far the assumed link figures are from the paper's fit (spdkfac.sim.clusters).
    assert [round(x, 2) for x in NETWORKS["paper"].scales(AR)] == [1.23, 1.09]
    assert [round(x, 2) for x in NETWORKS["paper"].scales(BC)] == [2.46, 1.08]
    # Under NCCL's choice small messages take the tree: log P start-up at 1024 workers.
    nccl = NETWORKS["paper-nccl"]
    assert nccl.cost(AR, 64).choose(0)[0] == "hierarchical tree"
    assert nccl.cost(AR, 1024).predict(4) < nccl.cost(AR, 1024).lines[0].predict(4) / 50


@pytest.mark.parametrize("name", ["ib100", "ib200", "ib400", "eth10"])
def test_cluster_networks_are_ordered_by_their_links(name: str) -> None:
    network = NETWORKS[name]
    assert network.topology.gpus_per_node == 8
    one_node, many = network.cost(AR, 8), network.cost(AR, 1024)
    assert many.predict(4) > one_node.predict(4) and many.predict(1e8) > one_node.predict(1e8)
    if name != "eth10":
        assert many.predict(1e8) < NETWORKS["eth10"].cost(AR, 1024).predict(1e8) / 10
    big = 25 * 2**20
    assert (
        NETWORKS["ib100"].cost(AR, 256).predict(big)
        > NETWORKS["ib200"].cost(AR, 256).predict(big)
        > NETWORKS["ib400"].cost(AR, 256).predict(big)
    )


@pytest.mark.parametrize("preset", ["paper", "paper-nccl", "ib100", "abci", "eth10", "cpu"])
def test_a_reduce_costs_what_a_broadcast_does(preset: str) -> None:
    # A reduce is a broadcast run backwards: the same chain or tree, the same bytes per
    # link (its arithmetic uncosted), so every network prices it as the broadcast,
    # anchored or not, at every world size and message size.
    for ranks in (2, 3, 8):
        _close(flat_line(RD, Shape.RING, ranks, SLOW), (ranks - 1) * SLOW.alpha, SLOW.beta)
        _close(
            flat_line(RD, Shape.TREE, ranks, SLOW),
            math.ceil(math.log2(ranks)) * SLOW.alpha,
            SLOW.beta,
        )
    topology = Topology(gpus_per_node=4, intra=FAST, inter=SLOW)
    # A chain inside the node, then across the nodes: the broadcast's 33 µs + 1.1e-9/B.
    _close(Hierarchical(Shape.RING).line(RD, topology, 16), 33 * US, 1.1e-9)
    hardware = PRESETS[preset]()
    for ranks in (1, 2, 16, 64, 1024):
        reduce, broadcast = hardware.collective(RD, ranks), hardware.collective(BC, ranks)
        assert reduce.names == broadcast.names and reduce.lines == broadcast.lines
