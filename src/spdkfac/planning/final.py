"""Who preconditions each layer: every rank (replicated) or the layer's owner (Osawa et
al. 2019's hybrid exchange). A strategy axis; the engine builds the matching final stage.

Osawa et al. 2019 ("Large-scale distributed second-order optimization using
Kronecker-factored approximate curvature", Sec. 3, Fig. 1): gradients and factors are
reduce-scattered to each layer's owner, which inverts and preconditions, and the
preconditioned gradients are all-gathered; no inverse is communicated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from spdkfac.planning.placement import Plan

__all__ = ["FINAL_POLICIES", "OWNER_COMPUTES", "REPLICATED", "FinalPolicy"]


@dataclass(frozen=True)
class FinalPolicy:
    """Where a step's last stage runs.

    Attributes:
        name: ``"replicated"`` or ``"owner-computes"``.
        owners_precondition: Each layer's owner preconditions it and keeps its inverses;
            the placement must give all of a layer's factors to one rank.
    """

    name: str
    owners_precondition: bool

    def factor_owners(self, plan: Plan) -> Mapping[str, int] | None:
        """Owner per factor key when factors are reduce-scattered to owners (None: every
        rank receives every global factor)."""
        return plan.owner_by_key if self.owners_precondition else None

    def check_placement(self, placement: str, owns_layers: bool, strategy: str | None) -> None:
        """Raise when the placement cannot serve this stage.

        Raises:
            ValueError: Owners precondition but the placement splits layers.
        """
        if self.owners_precondition and not owns_layers:
            raise ValueError(
                f"placement={placement!r} cannot be used with strategy={strategy!r}: "
                "its owners precondition whole layers, so the placement must give every "
                "factor of a layer to one rank (e.g. 'layer-owners')"
            )


#: Every rank preconditions every block (D-KFAC, MPD-KFAC, SPD-KFAC).
REPLICATED = FinalPolicy("replicated", owners_precondition=False)
#: Osawa et al.'s owners precondition, then all-gather.
OWNER_COMPUTES = FinalPolicy("owner-computes", owners_precondition=True)
#: Final-stage policy by name.
FINAL_POLICIES: Mapping[str, FinalPolicy] = MappingProxyType(
    {policy.name: policy for policy in (REPLICATED, OWNER_COMPUTES)}
)
