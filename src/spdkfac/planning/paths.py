"""Each layer's gradient path, chosen by the cost model: to its owner, or to every rank.

Two ways to precondition a layer whose gradient arrives sharded (FSDP2) or summed over
the ranks (DDP, plain):

- **owner** (Osawa et al. 2019, "Large-scale distributed second-order optimization using
  Kronecker-factored approximate curvature", Sec. 3, Fig. 1): the layer's factors and its
  averaged gradient are reduce-scattered to one owner, which inverts both factors,
  preconditions and broadcasts the result; no inverse travels and only the owner holds the
  layer's inverses (per-rank inverse memory about 1/P);
- **replicated** (SPD-KFAC, Shi, Zhang, Li 2021, Sec. 4): the factors are all-reduced,
  each factor inverted on every rank or on one rank and broadcast (the row's placement,
  e.g. SPD-KFAC's CT/NCT rule), the gradient all-gathered, and every rank preconditions.

:func:`plan_gradient_paths` prices both per layer with the α-β and inverse-time models
(:func:`path_costs`), sends each layer the cheaper way and places the factors: the
replicated layers' by the row's placement policy, the owner layers whole (both factors
on one rank), largest owner work first onto the least-loaded rank, counting the
placement's communicated inversions. A pure function of replicated inputs: every rank
makes the same plan without communicating.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from spdkfac.costmodel import CostModel
from spdkfac.linalg import packed_size
from spdkfac.planning.placement import (
    FactorSpec,
    PlacementPolicy,
    Plan,
    broadcast_seconds,
    inversion_seconds,
)

__all__ = [
    "OWNER",
    "REPLICATED",
    "LayerGradient",
    "PathCosts",
    "PathPlan",
    "path_costs",
    "plan_gradient_paths",
]

#: The owner path: the owner inverts, preconditions and returns the layer's gradient.
OWNER: Final = "owner"
#: The replicated path: every rank holds the layer's inverses and preconditions it.
REPLICATED: Final = "replicated"


@dataclass(frozen=True)
class LayerGradient:
    """One layer the path planner decides.

    Attributes:
        layer: The layer's name.
        elements: Elements of its gradient matrix (``g·a`` for a Kronecker block).
        factors: Its placed factors (:class:`~spdkfac.planning.placement.FactorSpec`:
            side, wire size and compute scale of their results).
    """

    layer: str
    elements: int
    factors: tuple[FactorSpec, ...]

    def __post_init__(self) -> None:
        if self.elements < 1:
            raise ValueError(f"elements of {self.layer!r} must be >= 1, got {self.elements}")
        if not self.factors or any(spec.layer != self.layer for spec in self.factors):
            raise ValueError(f"factors of {self.layer!r} must be its own, at least one")


@dataclass(frozen=True)
class PathCosts:
    """Predicted seconds a step spends on one layer by each path (:func:`path_costs`)."""

    owner: float
    replicated: float

    @property
    def path(self) -> str:
        """The cheaper path (:data:`REPLICATED` on a tie)."""
        return OWNER if self.owner < self.replicated else REPLICATED


def _reduce_scatter_seconds(elements: int, cost_model: CostModel) -> float:
    """A ring reduce-scatter moves half an all-reduce's bytes (one start-up)."""
    nbytes = elements * cost_model.bytes_per_element
    return cost_model.allreduce.alpha + cost_model.allreduce.beta * nbytes / 2


def path_costs(layer: LayerGradient, world_size: int, cost_model: CostModel) -> PathCosts:
    """Both paths' predicted seconds for ``layer`` on ``world_size`` ranks.

    Work one rank does for all ranks counts 1/P (owners and communicated inversions are
    spread over the ranks); communication counts whole. With ``n`` gradient elements,
    preconditioning ``Ĝ ∇ Â`` costs ``n·Σ dims`` multiply-adds at the inverse model's
    cubic rate (as :func:`~spdkfac.planning.placement.layer_owner_seconds` prices it), and
    factors travel as packed triangles in buckets (their bytes only):

    - replicated: the all-gather of the gradient (priced as a broadcast of ``n``
      elements: each rank receives the others' shards), the precondition on every rank,
      each factor's inversion (SPD-KFAC's rule, Eq. 18: on every rank when that is no
      slower than its broadcast, else on one rank plus the broadcast of its result) and
      its all-reduce;
    - owner: the reduce-scatter of the gradient to the owner (half an all-reduce), the
      broadcast of the preconditioned ``n`` elements, the owner's inversions and
      precondition, and the factors' reduce-scatter.
    """
    world = world_size
    dims = sum(spec.dim for spec in layer.factors)
    precondition = cost_model.inverse.c3 * layer.elements * dims
    bytes_ = cost_model.bytes_per_element * sum(packed_size(s.dim) for s in layer.factors)
    factor_exchange = cost_model.allreduce.beta * bytes_
    inversions = 0.0
    replicated_inverses = 0.0
    for spec in layer.factors:
        seconds = inversion_seconds(spec, cost_model)
        inversions += seconds
        sent = broadcast_seconds(spec, cost_model)
        communicated = world > 1 and seconds > sent
        replicated_inverses += seconds / world + sent if communicated else seconds
    gradient_bytes = layer.elements * cost_model.bytes_per_element
    replicated = (
        cost_model.broadcast.predict(gradient_bytes)
        + precondition
        + replicated_inverses
        + factor_exchange
    )
    owner = (
        _reduce_scatter_seconds(layer.elements, cost_model)
        + cost_model.broadcast.predict(gradient_bytes)
        + (precondition + inversions) / world
        + factor_exchange / 2
    )
    return PathCosts(owner=owner, replicated=replicated)


@dataclass(frozen=True)
class PathPlan:
    """Each layer's path and where every factor is inverted.

    Attributes:
        placement: The factors' plan; its ``owner_layers`` are the owner-path layers.
        costs: Both paths' predicted seconds per layer.
    """

    placement: Plan
    costs: Mapping[str, PathCosts]

    @property
    def paths(self) -> Mapping[str, str]:
        """Layer → :data:`OWNER` or :data:`REPLICATED`."""
        owners = self.placement.owner_layers
        return MappingProxyType(
            {layer: OWNER if layer in owners else REPLICATED for layer in self.costs}
        )

    def describe(self) -> str:
        """A short human-readable summary."""
        owners = sorted(self.placement.owner_layers)
        return (
            f"layer-paths: {len(owners)}/{len(self.costs)} layers to their owners "
            f"({', '.join(owners) or 'none'}); {self.placement.describe()}"
        )


def plan_gradient_paths(
    layers: Sequence[LayerGradient],
    world_size: int,
    cost_model: CostModel,
    placement: PlacementPolicy,
) -> PathPlan:
    """Send each layer the cheaper way (:func:`path_costs`) and place every factor.

    The replicated layers' factors are placed by ``placement``; the owner layers (none on
    one rank) are taken largest owner work first (its inversions and precondition; ties
    by name), each whole onto the rank with the least predicted work so far (the
    placement's communicated inversions included; ties: lowest rank).
    """
    costs = {layer.layer: path_costs(layer, world_size, cost_model) for layer in layers}
    chosen = [layer for layer in layers if world_size > 1 and costs[layer.layer].path == OWNER]
    chosen_names = {layer.layer for layer in chosen}
    specs = [spec for layer in layers for spec in layer.factors]
    shared = placement.plan(
        [spec for spec in specs if spec.layer not in chosen_names], world_size, cost_model
    )
    work = {
        layer.layer: cost_model.inverse.c3 * layer.elements * sum(s.dim for s in layer.factors)
        + sum(inversion_seconds(spec, cost_model) for spec in layer.factors)
        for layer in chosen
    }
    heap = [(load, rank) for rank, load in enumerate(shared.loads())]
    heapq.heapify(heap)
    owner_of = dict(shared.owner_by_key)
    for name in sorted(work, key=lambda layer: (-work[layer], layer)):
        load, rank = heapq.heappop(heap)
        owner_of.update({spec.key: rank for spec in specs if spec.layer == name})
        heapq.heappush(heap, (load + work[name], rank))
    plan = Plan(
        placement="layer-paths",
        world_size=world_size,
        factors=tuple(specs),
        owners=tuple(owner_of[spec.key] for spec in specs),
        predicted_seconds=tuple(inversion_seconds(spec, cost_model) for spec in specs),
        owner_layers=frozenset(chosen_names),
    )
    return PathPlan(placement=plan, costs=MappingProxyType(costs))
