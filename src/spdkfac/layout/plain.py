"""A model whose parameters live whole on every rank and whose gradients nobody reduces
during backward (the caller may average them; the preconditioner's stages cope either way)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from spdkfac.comm import Communicator
from spdkfac.layers import LOCAL_GRADIENTS, GradientAccess
from spdkfac.layout.base import GradientHook, unwrap_compiled
from spdkfac.planning.factor_split import FactorShare

__all__ = ["PlainLayout"]


class PlainLayout:
    """A plain (or compiled) module.

    Args:
        model: The module (compiled wrappers are looked through).
    """

    name = "plain"
    reduces_gradients = False
    routes_gradients = False

    def __init__(self, model: nn.Module) -> None:
        self.module = unwrap_compiled(model)
        self.gradients: GradientAccess = LOCAL_GRADIENTS

    def route_gradients(self, hook: GradientHook) -> None:
        raise ValueError("a plain module has no gradient reduction to route")

    def owner_gradients(
        self, communicator: Communicator, params: Sequence[Tensor], owners: Sequence[int]
    ) -> GradientAccess:
        return self.gradients

    def factor_share(
        self, communicator: Communicator, blocks: Sequence[tuple[str, float]]
    ) -> FactorShare:
        return FactorShare.whole(blocks)

    def clip_sum(self, partial: float) -> float:
        return partial
