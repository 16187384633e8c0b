"""Who preconditions each layer: every rank (replicated), the layer's owner (Osawa et
al. 2019's hybrid exchange), or per layer the cheaper of the two by the cost model. A
strategy axis; the engine builds the matching final stage.

Osawa et al. 2019 ("Large-scale distributed second-order optimization using
Kronecker-factored approximate curvature", Sec. 3, Fig. 1): gradients and factors are
reduce-scattered to each layer's owner, which inverts and preconditions, and the
preconditioned gradients are all-gathered; no inverse is communicated. The per-layer
choice is :func:`~spdkfac.planning.paths.plan_gradient_paths`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from spdkfac.costmodel import CostModel
from spdkfac.planning.paths import LayerGradient, plan_gradient_paths
from spdkfac.planning.placement import EVERY_RANK, PlacementPolicy, Plan

__all__ = ["FINAL_POLICIES", "LAYER_PATHS", "OWNER_COMPUTES", "REPLICATED", "FinalPolicy"]


@dataclass(frozen=True)
class FinalPolicy:
    """Where a step's last stage runs.

    Attributes:
        name: ``"replicated"``, ``"owner-computes"`` or ``"layer-paths"``.
        owners_precondition: Owners precondition the plan's ``owner_layers`` and keep
            their inverses (the owner stage; other layers are preconditioned everywhere).
        chooses_paths: Each layer's path is chosen by the cost model
            (:func:`~spdkfac.planning.paths.plan_gradient_paths`); else every placed
            layer goes the one way (to its owner with ``owners_precondition``, whose
            placement must then give all of a layer's factors to one rank).
    """

    name: str
    owners_precondition: bool
    chooses_paths: bool = False

    def place(
        self,
        placement: PlacementPolicy,
        layers: Sequence[LayerGradient],
        world_size: int,
        costs: CostModel,
    ) -> Plan:
        """Where every factor of ``layers`` is inverted (and, choosing paths, which layers
        their owners precondition)."""
        if self.chooses_paths:
            return plan_gradient_paths(layers, world_size, costs, placement).placement
        specs = [spec for layer in layers for spec in layer.factors]
        return placement.plan(specs, world_size, costs)

    def factor_owners(self, plan: Plan) -> Mapping[str, int] | None:
        """Owner per factor key when owners precondition: the owner layers' factors are
        reduce-scattered to their owner, the others' all-reduced (``EVERY_RANK``). None:
        every rank receives every global factor."""
        if not self.owners_precondition:
            return None
        return {
            spec.key: owner if spec.layer in plan.owner_layers else EVERY_RANK
            for spec, owner in zip(plan.factors, plan.owners, strict=True)
        }

    def check_placement(self, placement: str, owns_layers: bool, strategy: str | None) -> None:
        """Raise when the placement cannot serve this stage.

        Raises:
            ValueError: Owners precondition but the placement splits layers.
        """
        if self.owners_precondition and not self.chooses_paths and not owns_layers:
            raise ValueError(
                f"placement={placement!r} cannot be used with strategy={strategy!r}: "
                "its owners precondition whole layers, so the placement must give every "
                "factor of a layer to one rank (e.g. 'layer-owners')"
            )


#: Every rank preconditions every block (D-KFAC, MPD-KFAC, SPD-KFAC).
REPLICATED = FinalPolicy("replicated", owners_precondition=False)
#: Osawa et al.'s owners precondition, then all-gather.
OWNER_COMPUTES = FinalPolicy("owner-computes", owners_precondition=True)
#: Per layer by the cost model: owners precondition some layers, every rank the others.
LAYER_PATHS = FinalPolicy("layer-paths", owners_precondition=True, chooses_paths=True)
#: Final-stage policy by name.
FINAL_POLICIES: Mapping[str, FinalPolicy] = MappingProxyType(
    {policy.name: policy for policy in (REPLICATED, OWNER_COMPUTES, LAYER_PATHS)}
)
