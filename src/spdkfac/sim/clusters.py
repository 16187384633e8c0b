"""Networks of named clusters: topologies, link figures and where each number comes from.

Every figure below is either a public specification (labelled *spec*) or an assumption
(labelled *assumed*); nothing here was measured by this project, which has no GPU.

* Link rates (*spec*): InfiniBand EDR, HDR and NDR signal 100, 200 and 400 Gbit/s per
  port (InfiniBand Trade Association roadmap); NVLink 2.0 gives a V100 6 links of 25 GB/s
  per direction (150 GB/s), NVLink 3 an A100 12 (300 GB/s), NVLink 4 an H100 18
  (450 GB/s) (NVIDIA's V100, A100 and H100 architecture whitepapers); PCIe 3.0 x16 moves
  15.75 GB/s per direction.
* Nodes (*spec*): NVIDIA DGX-1 (8x V100 on NVLink, 4x 100 Gb/s EDR InfiniBand), DGX A100
  (8x A100 on NVSwitch, 8x 200 Gb/s HDR for the compute fabric), DGX H100 (8x H100 on
  NVSwitch, 8x 400 Gb/s NDR), from NVIDIA's DGX system datasheets; ABCI's compute nodes
  (4x V100 SXM2 on NVLink, 2x 100 Gb/s EDR InfiniBand), from AIST's ABCI system overview
  (Osawa et al. 2019, Sec. 5, state the 4 V100 per node).
* Efficiency (*assumed*): collectives reach 90 % of an InfiniBand link's rate, 80 % of
  NVLink's and of TCP over Ethernet. NCCL's own benchmark (nccl-tests, whose
  ``doc/PERFORMANCE.md`` defines the *bus bandwidth* these compare with: all-reduce moves
  2(P−1)/P bytes per byte per rank, reduce-scatter and all-gather (P−1)/P, broadcast and
  reduce 1, exactly the β terms of :mod:`spdkfac.sim.network`) reports bus bandwidths
  close to the link rate on InfiniBand; we did not run it.
* Latency per algorithm step (*assumed*): 2 µs on NVLink, 5 µs on PCIe, 6 µs on
  InfiniBand, 30 µs for TCP over 10 Gbit/s Ethernet. For comparison, reading the SPD-KFAC
  paper's fitted all-reduce start-up (929 µs at 64 GPUs) as a ring's 2·63 steps gives
  7.4 µs per step.

The ``paper`` network is the SPD-KFAC paper's cluster (Shi, Zhang, Li 2021, Sec. VI: 64
RTX 2080 Ti GPUs, 16 nodes of 4, 100 Gbit/s InfiniBand) *anchored* to its own α-β lines at
64 GPUs (:data:`~spdkfac.sim.paper.PAPER_ALLREDUCE`, and the broadcast this project
assumes beside it): at 64 it reproduces them exactly, elsewhere it follows a ring across
the topology. Only rings run there (the paper's fit is one straight line, which a
ring/tree choice would not give), so ``paper`` keeps today's 64-GPU numbers;
``paper-nccl`` is the same anchored links with NCCL's choice of algorithms. The anchor's
factors on the assumed links (:meth:`~spdkfac.sim.network.NetworkModel.scales`) say how
far they are from the paper's fit: 1.23 on α and 1.09 on β for the all-reduce, 2.46 and
1.08 for the broadcast (the broadcast's α is the all-reduce's, an assumption of
:mod:`spdkfac.sim.paper`, where a chain has half a ring all-reduce's steps).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from spdkfac.sim.collectives import (
    Algorithm,
    CollectiveOp,
    Flat,
    Hierarchical,
    Link,
    Shape,
    Topology,
)
from spdkfac.sim.network import Anchor, NetworkModel
from spdkfac.sim.paper import PAPER_ALLREDUCE, PAPER_BROADCAST

__all__ = ["NCCL_LIKE", "NETWORKS", "RING_ONLY"]

_RING, _TREE = Flat(Shape.RING), Hierarchical(Shape.TREE)
_TWO_LEVEL_RING = Hierarchical(Shape.RING)

#: NCCL-like candidates: all-reduce on a flat ring, a hierarchical ring or NCCL's tree
#: across nodes (a double binary tree between nodes, rings inside); the rest on rings
#: (NCCL pipelines broadcasts, reduces, reduce-scatters and all-gathers along rings only),
#: flat or node by node. The cheapest wins per message size.
NCCL_LIKE: Final[Mapping[CollectiveOp, tuple[Algorithm, ...]]] = MappingProxyType(
    {
        CollectiveOp.ALL_REDUCE: (_RING, _TWO_LEVEL_RING, _TREE),
        CollectiveOp.BROADCAST: (_RING, _TWO_LEVEL_RING),
        CollectiveOp.REDUCE: (_RING, _TWO_LEVEL_RING),
        CollectiveOp.REDUCE_SCATTER: (_RING, _TWO_LEVEL_RING),
        CollectiveOp.ALL_GATHER: (_RING, _TWO_LEVEL_RING),
    }
)
#: One flat ring for every collective (a chain for broadcasts and reduces).
RING_ONLY: Final[Mapping[CollectiveOp, tuple[Algorithm, ...]]] = MappingProxyType(
    {op: (_RING,) for op in CollectiveOp}
)

_IB_EFFICIENCY = 0.9  # assumed
_NVLINK_EFFICIENCY = 0.8  # assumed
_TCP_EFFICIENCY = 0.8  # assumed
_NVLINK_LATENCY = 2e-6  # assumed
_IB_LATENCY = 6e-6  # assumed
_TCP_LATENCY = 30e-6  # assumed


def _nvlink(name: str, gigabytes_per_second: float) -> Link:
    return Link.rated(
        name,
        gbit_per_second=8 * gigabytes_per_second,
        efficiency=_NVLINK_EFFICIENCY,
        latency_seconds=_NVLINK_LATENCY,
    )


def _infiniband(name: str, ports: int, gbit_per_second: float) -> Link:
    return Link.rated(
        f"{ports}x {name}",
        gbit_per_second=ports * gbit_per_second,
        efficiency=_IB_EFFICIENCY,
        latency_seconds=_IB_LATENCY,
    )


_PAPER_TOPOLOGY = Topology(
    gpus_per_node=4,
    # GeForce cards have no peer-to-peer over PCIe: copies are staged through host
    # memory; 6 GB/s of PCIe 3.0 x16's 15.75 is assumed.
    intra=Link.rated(
        "PCIe 3.0 x16 via host", gbit_per_second=48.0, efficiency=1.0, latency_seconds=5e-6
    ),
    inter=_infiniband("EDR InfiniBand", 1, 100.0),
)
_PAPER_ANCHOR = Anchor(
    64, {CollectiveOp.ALL_REDUCE: PAPER_ALLREDUCE, CollectiveOp.BROADCAST: PAPER_BROADCAST}
)
_V100_NVLINK = _nvlink("NVLink 2.0", 150.0)


def _eight_gpu(name: str, description: str, intra: Link, inter: Link) -> NetworkModel:
    return NetworkModel(
        name=name,
        description=description,
        topology=Topology(gpus_per_node=8, intra=intra, inter=inter),
        algorithms=NCCL_LIKE,
    )


#: Network name → model (see the module docstring for every figure).
NETWORKS: Final[Mapping[str, NetworkModel]] = MappingProxyType(
    {
        "paper": NetworkModel(
            name="paper",
            description="16 nodes x 4 RTX 2080 Ti, PCIe inside, 1x 100 Gb/s EDR per node; "
            "anchored to the SPD-KFAC paper's α-β at 64 GPUs; rings only",
            topology=_PAPER_TOPOLOGY,
            algorithms=RING_ONLY,
            anchor=_PAPER_ANCHOR,
        ),
        "paper-nccl": NetworkModel(
            name="paper-nccl",
            description="the paper network with NCCL's ring/tree choice (anchored links)",
            topology=_PAPER_TOPOLOGY,
            algorithms=NCCL_LIKE,
            anchor=_PAPER_ANCHOR,
        ),
        "ib100": _eight_gpu(
            "ib100",
            "8 GPUs/node on NVLink 2.0 (150 GB/s), 4x 100 Gb/s EDR InfiniBand per node "
            "(DGX-1 layout)",
            _V100_NVLINK,
            _infiniband("EDR InfiniBand", 4, 100.0),
        ),
        "ib200": _eight_gpu(
            "ib200",
            "8 GPUs/node on NVSwitch (NVLink 3, 300 GB/s), 8x 200 Gb/s HDR InfiniBand per "
            "node (DGX A100 layout)",
            _nvlink("NVLink 3", 300.0),
            _infiniband("HDR InfiniBand", 8, 200.0),
        ),
        "ib400": _eight_gpu(
            "ib400",
            "8 GPUs/node on NVSwitch (NVLink 4, 450 GB/s), 8x 400 Gb/s NDR InfiniBand per "
            "node (DGX H100 layout)",
            _nvlink("NVLink 4", 450.0),
            _infiniband("NDR InfiniBand", 8, 400.0),
        ),
        "abci": NetworkModel(
            name="abci",
            description="4 GPUs/node on NVLink 2.0 (150 GB/s), 2x 100 Gb/s EDR InfiniBand "
            "per node (ABCI's compute nodes, where Osawa et al. ran)",
            topology=Topology(
                gpus_per_node=4,
                intra=_V100_NVLINK,
                inter=_infiniband("EDR InfiniBand", 2, 100.0),
            ),
            algorithms=NCCL_LIKE,
        ),
        "eth10": _eight_gpu(
            "eth10",
            "8 GPUs/node on NVLink 2.0 (150 GB/s), 1x 10 Gb/s Ethernet per node (TCP)",
            _V100_NVLINK,
            Link.rated(
                "10 Gb/s Ethernet",
                gbit_per_second=10.0,
                efficiency=_TCP_EFFICIENCY,
                latency_seconds=_TCP_LATENCY,
            ),
        ),
    }
)
