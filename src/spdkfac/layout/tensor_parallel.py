"""A tensor-parallel model (DTensor ``parallelize_module``: column- and row-wise Linear
layers, sequence-parallel norms), alone on a 1-D mesh or under FSDP2 on a 2-D
``(dp, tp)`` mesh. The capture reads every sharded layer input and output gradient whole
on every rank (the same collectives everywhere), so the ranks of a tensor-parallel group
see the same rows of the unsharded model; each block's factor statistics are formed by
one rank of the group (:func:`~spdkfac.planning.factor_split.plan_factor_split`), the
others sending zeros with weight 0, and the factor exchange's example-weighted average
over the world is then the average over the data-parallel batches. The preconditioner
reads each block's whole gradient and writes back this rank's shard: each rank ends with
its shard of the unsharded model's preconditioned gradient."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from spdkfac.comm import Communicator
from spdkfac.comm.tensor_parallel import (
    TensorParallelGradients,
    check_tensor_parallel,
    tensor_parallel_group,
)
from spdkfac.layers import GradientAccess
from spdkfac.layout.base import GradientHook
from spdkfac.planning.factor_split import FactorShare, plan_factor_split

__all__ = ["TensorParallelLayout"]


class TensorParallelLayout:
    """A tensor-parallel model, with or without FSDP2 (module docstring).

    Args:
        model: The model (``parallelize_module`` and FSDP2 keep the user's modules).

    Raises:
        ValueError: Forms spdkfac does not support
            (:func:`~spdkfac.comm.tensor_parallel.check_tensor_parallel`).
    """

    name = "tp"
    # Tensor parallelism alone spans the world (one batch); FSDP2 averages over dp.
    reduces_gradients = True
    routes_gradients = False

    def __init__(self, model: nn.Module) -> None:
        check_tensor_parallel(model)
        self.module = model
        self._access = TensorParallelGradients()
        self.gradients: GradientAccess = self._access

    def route_gradients(self, hook: GradientHook) -> None:
        raise ValueError(
            "tensor parallelism (and FSDP2) reduce gradients themselves: spdkfac cannot "
            "route them through a communication hook"
        )

    def owner_gradients(
        self, communicator: Communicator, params: Sequence[Tensor], owners: Sequence[int]
    ) -> GradientAccess:
        return self._access.gather_to_owners(communicator, params, owners)

    def factor_share(
        self, communicator: Communicator, blocks: Sequence[tuple[str, float]]
    ) -> FactorShare:
        rank, size, mesh = tensor_parallel_group(self.module)
        if communicator.world_size != mesh:
            # A group that is not the mesh's (the user's data-parallel one): the other
            # ranks of the tensor-parallel group are not in the exchange to send theirs.
            return FactorShare.whole(blocks)
        return FactorShare(plan_factor_split(blocks, size), rank)

    def clip_sum(self, partial: float) -> float:
        return partial
