"""Where a model's parameters and gradients live: a plain module, one wrapped by
``DistributedDataParallel``, one sharded by FSDP2, or a tensor-parallel one (alone or
under FSDP2; each behind :class:`ParameterLayout`)."""

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
            and tensor parallelism's (FSDP1; meshes of more than two dimensions other
            than HSDP × TP's).
    """
    outer = unwrap_compiled(model)
    if isinstance(outer, nn.parallel.DistributedDataParallel):
        return DataParallelLayout(outer)
    if may_be_sharded():
        # Imported only once FSDP or DTensor is: no model is sharded before that.
        from spdkfac.comm.sharded import is_fully_sharded
        from spdkfac.comm.tensor_parallel import is_tensor_parallel
        from spdkfac.layout.fsdp import FullyShardedLayout
        from spdkfac.layout.tensor_parallel import TensorParallelLayout

        if is_fully_sharded(outer) and is_tensor_parallel(outer):
            return TensorParallelLayout(outer)
        if is_fully_sharded(outer):
            return FullyShardedLayout(outer)
    return PlainLayout(outer)
