"""A model wrapped by ``DistributedDataParallel``: whole parameters on every rank,
gradients averaged during backward by DDP's bucket all-reduces, which a communication hook
can take over."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from spdkfac.layout.base import GradientHook
from spdkfac.layout.plain import PlainLayout

__all__ = ["DataParallelLayout"]


class DataParallelLayout(PlainLayout):
    """A ``DistributedDataParallel`` model: the plain layout of its module, with DDP
    reducing the gradients during backward (a hook can take that over).

    Args:
        ddp: The wrapper (its module may itself be compiled).
    """

    name = "ddp"
    reduces_gradients = True
    routes_gradients = True

    def __init__(self, ddp: DistributedDataParallel) -> None:
        inner = ddp.module
        assert isinstance(inner, nn.Module)
        super().__init__(inner)
        self.ddp = ddp

    def route_gradients(self, hook: GradientHook) -> None:
        try:
            self.ddp.register_comm_hook(None, hook)
        except RuntimeError as error:
            raise ValueError(
                "strategy / comm_scheduler: spdkfac reduces the gradient buckets through "
                "its own communication hook, and this DistributedDataParallel model cannot "
                f"take it ({error})"
            ) from error
