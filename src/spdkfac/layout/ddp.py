"""A model wrapped by ``DistributedDataParallel``: whole parameters on every rank,
gradients averaged during backward by DDP's bucket all-reduces, which a communication hook
can take over."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from spdkfac.comm import Communicator
from spdkfac.layers import LOCAL_GRADIENTS, GradientAccess
from spdkfac.layout.base import GradientHook, unwrap_compiled

__all__ = ["DataParallelLayout"]


class DataParallelLayout:
    """A ``DistributedDataParallel`` model.

    Args:
        ddp: The wrapper (its module may itself be compiled).
    """

    name = "ddp"
    reduces_gradients = True
    routes_gradients = True

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp
        inner = ddp.module
        assert isinstance(inner, nn.Module)
        self.module = unwrap_compiled(inner)
        self.gradients: GradientAccess = LOCAL_GRADIENTS

    def route_gradients(self, hook: GradientHook) -> None:
        try:
            self.ddp.register_comm_hook(None, hook)
        except RuntimeError as error:
            raise ValueError(
                "strategy / comm_scheduler: spdkfac reduces the gradient buckets through "
                "its own communication hook, and this DistributedDataParallel model cannot "
                f"take it ({error})"
            ) from error

    def owner_gradients(
        self, communicator: Communicator, params: Sequence[Tensor], owners: Sequence[int]
    ) -> GradientAccess:
        return self.gradients

    def clip_sum(self, partial: float) -> float:
        return partial
