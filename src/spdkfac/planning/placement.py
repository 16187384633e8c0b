"""Pure planners that decide which rank inverts each Kronecker factor.

A factor is either *communicated* (CT: inverted on one owner rank and broadcast) or
*non-communicated* (NCT: inverted redundantly on every rank). Planners are pure functions
of replicated inputs (the factors in registration order — their sides and what their
results cost in the blocks' inverse form, :class:`FactorSpec` —, world size, cost model),
so every rank computes the same :class:`Plan` without communicating. ``layer-owners`` gives
all of a layer's factors to one rank, for Osawa et al.'s owner-computes exchange (the
owner keeps its inverses and preconditions the layer itself).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Protocol

from spdkfac.costmodel import DEFAULT_COST_MODEL, CostModel
from spdkfac.forms import InverseForm
from spdkfac.linalg import packed_size
from spdkfac.support.checks import check_number
from spdkfac.types import FactorKind

__all__ = [
    "EVERY_RANK",
    "PLACEMENTS",
    "PLACEMENT_POLICIES",
    "Balanced",
    "FactorSpec",
    "LayerOwners",
    "PlacementPolicy",
    "Plan",
    "Replicated",
    "RoundRobin",
    "broadcast_seconds",
    "inversion_seconds",
    "plan_balanced",
    "plan_inversions",
    "plan_layer_owners",
    "plan_replicated",
    "plan_round_robin",
]

#: Owner value of a non-communicated factor: every rank inverts it.
EVERY_RANK: Final = -1


@dataclass(frozen=True)
class FactorSpec:
    """One Kronecker factor to invert: its layer, which factor, its side, and what its
    result costs in the block's inverse form (:mod:`spdkfac.forms`; build one with
    :meth:`for_form`).

    Attributes:
        layer: The layer's name.
        kind: ``"A"`` or ``"G"``.
        dim: The factor's side.
        wire_elements: Elements its result occupies in a broadcast (the form's
            ``wire_size``); 0 on construction means a damped inverse's packed triangle,
            ``d(d+1)/2``.
        compute_scale: Its compute time relative to the cost model's inverse-time fit
            (the form's ``compute_scale``; 1: a damped inverse by Cholesky).
    """

    layer: str
    kind: FactorKind
    dim: int
    wire_elements: int = 0
    compute_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("A", "G"):
            raise ValueError(f"kind must be 'A' or 'G', got {self.kind!r}")
        if self.dim < 1:
            raise ValueError(f"dim of {self.key} must be >= 1, got {self.dim}")
        if self.wire_elements == 0:
            object.__setattr__(self, "wire_elements", packed_size(self.dim))
        if self.wire_elements < 1:
            raise ValueError(f"wire_elements of {self.key} must be >= 1, got {self.wire_elements}")
        check_number(f"compute_scale of {self.key}", self.compute_scale)

    @classmethod
    def for_form(cls, layer: str, kind: FactorKind, dim: int, form: InverseForm) -> FactorSpec:
        """The factor as ``form`` computes and sends its result."""
        return cls(layer, kind, dim, form.wire_size(dim), form.compute_scale)

    @property
    def key(self) -> str:
        """``"<layer>/<kind>"``, unique within a model."""
        return f"{self.layer}/{self.kind}"


@dataclass(frozen=True)
class Plan:
    """Where every factor is inverted. Build with a planner; validated on construction.

    Attributes:
        placement: Name of the planner that made it.
        world_size: Ranks the plan is for.
        factors: The factors, in the order given to the planner.
        owners: Owner rank per factor, aligned with ``factors`` (``EVERY_RANK`` for NCT).
        predicted_seconds: Predicted inversion time per factor, aligned with ``factors``.
        owner_layers: Layers whose owner keeps its results and preconditions the layer
            itself (nothing broadcast): every layer of ``layer-owners``, the owner-path
            layers of :func:`~spdkfac.planning.paths.plan_gradient_paths`.
    """

    placement: str
    world_size: int
    factors: tuple[FactorSpec, ...]
    owners: tuple[int, ...]
    predicted_seconds: tuple[float, ...]
    owner_layers: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not (len(self.factors) == len(self.owners) == len(self.predicted_seconds)):
            raise ValueError("factors, owners and predicted_seconds must align")
        keys = [spec.key for spec in self.factors]
        if len(set(keys)) != len(keys):
            raise ValueError("every factor must appear exactly once in a plan")
        for spec, owner in zip(self.factors, self.owners, strict=True):
            if owner != EVERY_RANK and not 0 <= owner < self.world_size:
                raise ValueError(
                    f"owner of {spec.key} must be in [0, {self.world_size}) or "
                    f"EVERY_RANK, got {owner}"
                )
        ranks = {(s.layer, o) for s, o in zip(self.factors, self.owners, strict=True)}
        for layer in self.owner_layers:
            owners = {owner for name, owner in ranks if name == layer}
            if len(owners) != 1 or EVERY_RANK in owners:
                raise ValueError(f"owner layer {layer!r} must have one owner rank, got {owners}")

    @property
    def owner_by_key(self) -> Mapping[str, int]:
        """Factor key → owner rank (``EVERY_RANK`` for NCT)."""
        return MappingProxyType(
            {spec.key: owner for spec, owner in zip(self.factors, self.owners, strict=True)}
        )

    def owner(self, layer: str, kind: FactorKind) -> int:
        """The rank that inverts ``layer``'s ``kind`` factor, or ``EVERY_RANK``."""
        return self.owner_by_key[f"{layer}/{kind}"]

    def is_communicated(self, layer: str, kind: FactorKind) -> bool:
        """Whether the factor's inverse is computed on one rank and broadcast."""
        return self.owner(layer, kind) != EVERY_RANK

    def loads(self) -> tuple[float, ...]:
        """Predicted seconds of communicated inversions per rank."""
        loads = [0.0] * self.world_size
        for owner, seconds in zip(self.owners, self.predicted_seconds, strict=True):
            if owner != EVERY_RANK:
                loads[owner] += seconds
        return tuple(loads)

    def replicated_seconds(self) -> float:
        """Predicted seconds every rank spends on non-communicated inversions."""
        return sum(
            seconds
            for owner, seconds in zip(self.owners, self.predicted_seconds, strict=True)
            if owner == EVERY_RANK
        )

    def describe(self) -> str:
        """A short human-readable summary."""
        communicated = sum(owner != EVERY_RANK for owner in self.owners)
        loads = ", ".join(f"{1000 * load:.2f}" for load in self.loads())
        return (
            f"{self.placement}: {communicated}/{len(self.factors)} factors communicated, "
            f"per-rank CT load [{loads}] ms, NCT {1000 * self.replicated_seconds():.2f} ms"
        )


def inversion_seconds(spec: FactorSpec, cost_model: CostModel) -> float:
    """Predicted seconds to compute ``spec``'s result in its form."""
    return cost_model.inverse_seconds(spec.dim, spec.compute_scale)


def broadcast_seconds(spec: FactorSpec, cost_model: CostModel) -> float:
    """Predicted seconds to broadcast ``spec``'s result in its form's wire format."""
    return cost_model.broadcast_seconds(spec.dim, spec.wire_elements)


def _predicted(factors: Sequence[FactorSpec], cost_model: CostModel) -> tuple[float, ...]:
    return tuple(inversion_seconds(spec, cost_model) for spec in factors)


def plan_replicated(
    factors: Sequence[FactorSpec], world_size: int, cost_model: CostModel = DEFAULT_COST_MODEL
) -> Plan:
    """D-KFAC: every rank inverts every factor; no inverse is communicated."""
    return Plan(
        placement="replicated",
        world_size=world_size,
        factors=tuple(factors),
        owners=(EVERY_RANK,) * len(factors),
        predicted_seconds=_predicted(factors, cost_model),
    )


def plan_round_robin(
    factors: Sequence[FactorSpec], world_size: int, cost_model: CostModel = DEFAULT_COST_MODEL
) -> Plan:
    """MPD-KFAC: the i-th factor (in the given order) is inverted by rank i mod P; all CT."""
    return Plan(
        placement="round-robin",
        world_size=world_size,
        factors=tuple(factors),
        owners=tuple(index % world_size for index in range(len(factors))),
        predicted_seconds=_predicted(factors, cost_model),
    )


def plan_balanced(
    factors: Sequence[FactorSpec], world_size: int, cost_model: CostModel = DEFAULT_COST_MODEL
) -> Plan:
    """SPD-KFAC: NCT when inverting is no slower than receiving, else LPT on predicted time.

    A factor is NCT when its predicted inversion time is not more than its predicted
    broadcast time, both in its inverse form (:func:`inversion_seconds`,
    :func:`broadcast_seconds`: an eigen-basis costs more to compute and twice the
    elements to send). The rest are taken largest predicted time first (ties broken by key,
    so the plan does not depend on the order factors are listed in) and each goes to the
    least-loaded rank (ties: lowest rank). Loads are predicted seconds, not dimensions.
    """
    predicted = _predicted(factors, cost_model)
    owners = [EVERY_RANK] * len(factors)
    communicated = [
        index
        for index, spec in enumerate(factors)
        if world_size > 1 and predicted[index] > broadcast_seconds(spec, cost_model)
    ]
    communicated.sort(key=lambda index: (-predicted[index], factors[index].key))
    heap = [(0.0, rank) for rank in range(world_size)]
    for index in communicated:
        load, rank = heapq.heappop(heap)
        owners[index] = rank
        heapq.heappush(heap, (load + predicted[index], rank))
    return Plan(
        placement="balanced",
        world_size=world_size,
        factors=tuple(factors),
        owners=tuple(owners),
        predicted_seconds=predicted,
    )


def layer_owner_seconds(
    factors: Sequence[FactorSpec], cost_model: CostModel = DEFAULT_COST_MODEL
) -> dict[str, float]:
    """Predicted seconds an owner spends on each layer, by layer name.

    The inversions of its factors (in their form, :func:`inversion_seconds`), the two
    products of preconditioning ``Ĝ ∇ Â`` (an ``[g, a]`` gradient: ``g·a·(g + a)``
    multiply-adds, costed at the inversion model's cubic rate, as one inversion is about
    ``d³`` of them) and sending the ``g·a``
    preconditioned elements in the all-gather (the broadcast model). A layer whose A is
    not placed (a diagonal A, an embedding's) counts its inversion only.
    """
    specs: dict[str, dict[str, FactorSpec]] = {}
    for spec in factors:
        specs.setdefault(spec.layer, {})[spec.kind] = spec
    seconds: dict[str, float] = {}
    for layer, kinds in specs.items():
        total = sum(inversion_seconds(spec, cost_model) for spec in kinds.values())
        if len(kinds) == 2:
            a, g = kinds["A"].dim, kinds["G"].dim
            total += cost_model.inverse.c3 * g * a * (g + a)
            total += cost_model.broadcast.predict(g * a * cost_model.bytes_per_element)
        seconds[layer] = total
    return seconds


def plan_layer_owners(
    factors: Sequence[FactorSpec], world_size: int, cost_model: CostModel = DEFAULT_COST_MODEL
) -> Plan:
    """Osawa et al. 2019 (Sec. 3, Fig. 1): one owner per layer, balanced on its total work.

    Every factor of a layer goes to the layer's owner. Layers are taken largest predicted
    owner time first (:func:`layer_owner_seconds`; ties broken by name) and each goes to
    the least-loaded rank (ties: lowest rank), as the SPD-KFAC placement does for single
    factors. The owner computes, so nothing is NCT: with one rank, rank 0 owns everything.
    """
    per_layer = layer_owner_seconds(factors, cost_model)
    heap = [(0.0, rank) for rank in range(world_size)]
    owner_of: dict[str, int] = {}
    for layer in sorted(per_layer, key=lambda name: (-per_layer[name], name)):
        load, rank = heapq.heappop(heap)
        owner_of[layer] = rank
        heapq.heappush(heap, (load + per_layer[layer], rank))
    return Plan(
        placement="layer-owners",
        world_size=world_size,
        factors=tuple(factors),
        owners=tuple(owner_of[spec.layer] for spec in factors),
        predicted_seconds=_predicted(factors, cost_model),
        owner_layers=frozenset(owner_of),
    )


class PlacementPolicy(Protocol):
    """Where each factor is inverted: one ``plan`` from replicated inputs.

    Attributes:
        name: The name ``placement=`` takes.
        owns_layers: Every factor of a layer goes to one owner rank (never
            ``EVERY_RANK`` with several ranks), which the owner-computes exchange needs.
    """

    @property
    def name(self) -> str: ...

    @property
    def owns_layers(self) -> bool: ...

    def plan(self, factors: Sequence[FactorSpec], world_size: int, cost_model: CostModel) -> Plan:
        """The placement of ``factors`` over ``world_size`` ranks."""
        ...


@dataclass(frozen=True)
class Replicated:
    """D-KFAC: every rank inverts every factor (:func:`plan_replicated`)."""

    name: str = "replicated"
    owns_layers: bool = False

    def plan(self, factors: Sequence[FactorSpec], world_size: int, cost_model: CostModel) -> Plan:
        return plan_replicated(factors, world_size, cost_model)


@dataclass(frozen=True)
class RoundRobin:
    """MPD-KFAC: factor i on rank i mod P, every inverse broadcast (:func:`plan_round_robin`)."""

    name: str = "round-robin"
    owns_layers: bool = False

    def plan(self, factors: Sequence[FactorSpec], world_size: int, cost_model: CostModel) -> Plan:
        return plan_round_robin(factors, world_size, cost_model)


@dataclass(frozen=True)
class Balanced:
    """SPD-KFAC's load-balancing placement (Shi, Zhang, Li 2021: NCT by Eq. 18, CTs
    balanced over the ranks; :func:`plan_balanced`)."""

    name: str = "balanced"
    owns_layers: bool = False

    def plan(self, factors: Sequence[FactorSpec], world_size: int, cost_model: CostModel) -> Plan:
        return plan_balanced(factors, world_size, cost_model)


@dataclass(frozen=True)
class LayerOwners:
    """Osawa et al. 2019's model-parallel stage: each layer has one owner that inverts
    both its factors and preconditions its gradient (:func:`plan_layer_owners`)."""

    name: str = "layer-owners"
    owns_layers: bool = True

    def plan(self, factors: Sequence[FactorSpec], world_size: int, cost_model: CostModel) -> Plan:
        return plan_layer_owners(factors, world_size, cost_model)


#: Every placement policy by the name ``placement=`` takes.
PLACEMENT_POLICIES: Mapping[str, PlacementPolicy] = MappingProxyType(
    {policy.name: policy for policy in (Replicated(), RoundRobin(), Balanced(), LayerOwners())}
)
PLACEMENTS: tuple[str, ...] = tuple(PLACEMENT_POLICIES)


def plan_inversions(
    factors: Sequence[FactorSpec],
    world_size: int,
    placement: str | PlacementPolicy,
    cost_model: CostModel = DEFAULT_COST_MODEL,
) -> Plan:
    """Plan with ``placement`` (a policy, or the name of one of :data:`PLACEMENTS`)."""
    if isinstance(placement, str):
        if placement not in PLACEMENT_POLICIES:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        placement = PLACEMENT_POLICIES[placement]
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    return placement.plan(factors, world_size, cost_model)
