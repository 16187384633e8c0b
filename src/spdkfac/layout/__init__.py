"""Where a model's parameters and gradients live: a plain module, or one wrapped by
``DistributedDataParallel`` (each behind :class:`ParameterLayout`)."""

from __future__ import annotations

from torch import nn

from spdkfac.layout.base import GradientHook, ParameterLayout, unwrap_compiled
from spdkfac.layout.ddp import DataParallelLayout
from spdkfac.layout.plain import PlainLayout

__all__ = [
    "DataParallelLayout",
    "GradientHook",
    "ParameterLayout",
    "PlainLayout",
    "layout_of",
    "unwrap_compiled",
]


def layout_of(model: nn.Module) -> ParameterLayout:
    """The layout of ``model`` as the user passed it (looking through ``torch.compile``
    outside or inside ``DistributedDataParallel``).

    Raises:
        ValueError: A module compiled with ``fullgraph=True``.
    """
    outer = unwrap_compiled(model)
    if isinstance(outer, nn.parallel.DistributedDataParallel):
        return DataParallelLayout(outer)
    return PlainLayout(outer)
