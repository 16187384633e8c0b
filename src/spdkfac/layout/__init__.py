"""Where a model's parameters and gradients live: a plain module, one wrapped by
``DistributedDataParallel``, or one sharded by FSDP2 (each behind :class:`ParameterLayout`)."""

from __future__ import annotations

from torch import nn

from spdkfac.comm.dtensors import may_be_sharded
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
        ValueError: A module compiled with ``fullgraph=True``; sharding other than FSDP2's
            (FSDP1, tensor-parallel placements).
    """
    outer = unwrap_compiled(model)
    if isinstance(outer, nn.parallel.DistributedDataParallel):
        return DataParallelLayout(outer)
    if may_be_sharded():
        # Imported only once FSDP or DTensor is: no model is sharded before that.
        from spdkfac.comm.sharded import is_fully_sharded
        from spdkfac.layout.fsdp import FullyShardedLayout

        if is_fully_sharded(outer):
            return FullyShardedLayout(outer)
    return PlainLayout(outer)
