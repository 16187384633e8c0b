"""Tensor-parallel parameters (DTensor ``parallelize_module``, alone, under FSDP2 on a
2-D ``(dp, tp)`` mesh or under HSDP on a 3-D ``(replicate, shard, tp)`` one): which
models are tensor-parallel, which forms spdkfac supports, and each gradient read whole
and written back as this rank's shard.

A tensor-parallel weight is a ``DTensor`` whose placements on the tensor-parallel mesh
dimension are ``Shard(0)`` (``ColwiseParallel``: output rows), ``Shard(1)``
(``RowwiseParallel``: input columns) or ``Replicate()`` (biases of row-wise layers,
``SequenceParallel`` norms); under FSDP2 × TP the data-parallel dimension adds FSDP's
``Shard(0)`` (a ``_StridedShard`` where both shard rows), and HSDP a ``Replicate()``
before it. After backward every gradient is a ``DTensor`` of its parameter's placements
holding the gradient of the loss (averaged over the data-parallel dimensions by FSDP2).
:meth:`TensorParallelGradients.read` returns the whole gradient (``full_tensor``:
all-gathers over the sharded dimensions, uneven shards included) and
:meth:`~TensorParallelGradients.write` keeps this rank's part of a whole value, cut locally
the way DTensor cuts it (no collective).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from spdkfac.comm.base import Communicator
from spdkfac.comm.owners import EVERYONE

__all__ = [
    "SUPPORTED_TENSOR_PARALLEL",
    "OwnedGradients",
    "TensorParallelGradients",
    "check_tensor_parallel",
    "is_tensor_parallel",
    "tensor_parallel_group",
]

#: What the tensor-parallel layout accepts, for error messages.
SUPPORTED_TENSOR_PARALLEL = (
    "tensor parallelism (torch.distributed.tensor.parallel.parallelize_module) on a 1-D "
    "mesh spanning the world, or under FSDP2 on a 2-D (dp, tp) mesh or under HSDP on a 3-D "
    "(replicate, shard, tp) mesh spanning the world"
)

#: Placements FSDP2 (1-D) and HSDP (2-D) make without tensor parallelism.
_FSDP_PLACEMENTS = ((Shard(0),), (Replicate(), Shard(0)))


def is_tensor_parallel(model: nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters that tensor parallelism placed: any, when
    no module is ``fully_shard``-ed; under FSDP2, any placed otherwise than FSDP2's or
    HSDP's rows."""
    params = [p for p in model.parameters() if isinstance(p, DTensor)]
    if not params:
        return False
    if not any(isinstance(module, FSDPModule) for module in model.modules()):
        return True
    return any(tuple(p.placements) not in _FSDP_PLACEMENTS for p in params)


def check_tensor_parallel(model: nn.Module) -> None:
    """Refuse tensor-parallel forms spdkfac does not support (before any collective).

    Raises:
        ValueError: A mesh of more than two dimensions other than HSDP × TP's; a
            tensor-parallel mesh (without FSDP2, any; under FSDP2, the 2-D or 3-D one) that
            does not span the world
            (its other ranks' batches would be averaged into the factors but not into the
            gradients); under FSDP2, plain parameters beside sharded ones.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    fully_sharded = any(isinstance(module, FSDPModule) for module in model.modules())
    sharded: list[tuple[str, DTensor]] = []
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            sharded.append((name, param))
        elif fully_sharded:
            raise ValueError(
                f"model: parameter {name!r} is not sharded while others are; "
                f"fully_shard the root module too (supported: {SUPPORTED_TENSOR_PARALLEL})"
            )
    for name, dtensor in sharded:
        mesh = dtensor.device_mesh
        if mesh.ndim > 2 and not (fully_sharded and _hsdp_times_tp(dtensor)):
            raise ValueError(
                f"model: parameter {name!r} lives on a {mesh.ndim}-D mesh "
                f"{tuple(mesh.mesh.shape)} as {tuple(dtensor.placements)}, which spdkfac "
                f"does not support; supported: {SUPPORTED_TENSOR_PARALLEL}"
            )
    for name, dtensor in sharded:
        # Under FSDP2 only the tensor-parallel placements: a module left out of the plan
        # keeps FSDP2's data-parallel mesh.
        placed = not fully_sharded or tuple(dtensor.placements) not in _FSDP_PLACEMENTS
        if placed and dtensor.device_mesh.size() != world:
            how = "under FSDP2" if fully_sharded else "without FSDP2"
            raise ValueError(
                f"model: parameter {name!r} is tensor-parallel over "
                f"{dtensor.device_mesh.size()} of {world} ranks {how}: the other ranks' data "
                f"parallelism is not one spdkfac can see; supported: {SUPPORTED_TENSOR_PARALLEL}"
            )


def _hsdp_times_tp(dtensor: DTensor) -> bool:
    """Whether a parameter is placed as HSDP × TP makes it: a 3-D mesh whose first
    dimension replicates, whose second shards rows (FSDP2's ``Shard(0)``, strided where
    tensor parallelism shards them too) and whose last is tensor parallelism's."""
    replicate, shard = dtensor.placements[:2]
    return (
        dtensor.device_mesh.ndim == 3
        and replicate.is_replicate()
        and getattr(shard, "dim", None) == 0
    )


def tensor_parallel_group(model: nn.Module) -> tuple[int, int, int]:
    """This rank's index within its tensor-parallel group, the group's size and the size
    of the whole mesh, read from the mesh of a parameter tensor parallelism placed (no
    collective): its last dimension is the group's (FSDP2 puts its data-parallel
    dimensions, HSDP's two, before it). A model :func:`check_tensor_parallel` accepted."""
    fully_sharded = any(isinstance(module, FSDPModule) for module in model.modules())
    for param in model.parameters():
        if not isinstance(param, DTensor):
            continue
        if fully_sharded and tuple(param.placements) in _FSDP_PLACEMENTS:
            continue  # FSDP2's own rows: a module left out of the plan
        mesh = param.device_mesh
        dim = mesh.ndim - 1
        return mesh.get_local_rank(dim), mesh.size(dim), mesh.size()
    raise ValueError(f"model: no tensor-parallel parameter ({SUPPORTED_TENSOR_PARALLEL})")


class TensorParallelGradients:
    """The gradient access of a tensor-parallel model (module docstring). Plain tensors
    (parameters left whole) are read and written as they are.

    Every rank must read the same parameters in the same order (a read of a sharded
    gradient is a collective over its mesh); the engine reads blocks in their agreed order.
    """

    def read(self, param: Tensor) -> Tensor | None:
        grad = param.grad
        if not isinstance(grad, DTensor):
            return grad
        full: Tensor = grad.full_tensor()
        return full

    def write(self, param: Tensor, value: Tensor) -> None:
        grad = param.grad
        assert grad is not None
        if not isinstance(grad, DTensor):
            grad.copy_(value)
            return
        # src_data_rank=None: each rank cuts its own copy (every rank holds the same value).
        part = distribute_tensor(
            value.to(grad.dtype), grad.device_mesh, grad.placements, src_data_rank=None
        )
        grad.to_local().copy_(part.to_local())

    def gather_to_owners(
        self, communicator: Communicator, params: Sequence[Tensor], owners: Sequence[int]
    ) -> OwnedGradients:
        """The whole gradients of the parameters this rank owns (or everyone owns): every
        rank reads every parameter (one all-gather over its mesh each, the same traffic
        as a replicated stage's reads) and keeps its own."""
        kept: dict[int, Tensor | None] = {}
        for param, owner in zip(params, owners, strict=True):
            value = self.read(param)
            if owner in (EVERYONE, communicator.rank):
                kept[id(param)] = value
        return OwnedGradients(self, kept)


class OwnedGradients:
    """Whole gradients read by :meth:`TensorParallelGradients.gather_to_owners` (no
    collective); every write through the tensor-parallel access."""

    def __init__(self, access: TensorParallelGradients, kept: Mapping[int, Tensor | None]) -> None:
        self._access = access
        self._kept = kept

    def read(self, param: Tensor) -> Tensor | None:
        if id(param) in self._kept:
            return self._kept[id(param)]
        grad = param.grad
        assert not isinstance(grad, DTensor), "a sharded gradient read outside the gather"
        return grad

    def write(self, param: Tensor, value: Tensor) -> None:
        self._access.write(param, value)
