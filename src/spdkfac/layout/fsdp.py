"""A model sharded by FSDP2 (``fully_shard``, HSDP included): ``DTensor`` parameters
sharded by rows, gradients reduced (averaged over the mesh) and resharded by FSDP during
backward. The preconditioner reads each block's full gradient (all-gathered over the
mesh's shard dimension) and writes back this rank's rows."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from spdkfac.comm import Communicator
from spdkfac.comm.sharded import ShardedGradients, check_sharding
from spdkfac.layers import GradientAccess
from spdkfac.layout.base import GradientHook
from spdkfac.planning.factor_split import FactorShare

__all__ = ["FullyShardedLayout"]


class FullyShardedLayout:
    """A ``fully_shard``-ed model (the root and any submodules, 1-D or HSDP 2-D mesh).

    Args:
        model: The model (FSDP2 keeps the user's module: nothing to unwrap).

    Raises:
        ValueError: Placements FSDP2 does not make (tensor parallelism) or parameters
            left unsharded beside sharded ones.
    """

    name = "fsdp"
    reduces_gradients = True
    routes_gradients = False

    def __init__(self, model: nn.Module) -> None:
        check_sharding(model)
        self.module = model
        self._sharded = ShardedGradients()
        self.gradients: GradientAccess = self._sharded

    def route_gradients(self, hook: GradientHook) -> None:
        raise ValueError(
            "FSDP2 reduce-scatters gradients itself: spdkfac cannot route them through a "
            "communication hook (strategies that take over DDP's buckets read the reduced "
            "shards instead)"
        )

    def owner_gradients(
        self, communicator: Communicator, params: Sequence[Tensor], owners: Sequence[int]
    ) -> GradientAccess:
        return self._sharded.gather_to_owners(communicator, params, owners)

    def factor_share(
        self, communicator: Communicator, blocks: Sequence[tuple[str, float]]
    ) -> FactorShare:
        return FactorShare.whole(blocks)

    def clip_sum(self, partial: float) -> float:
        return partial
