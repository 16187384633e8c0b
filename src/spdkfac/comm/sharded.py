"""FSDP2 (``fully_shard``) parameters: which sharding a model uses, and each sharded
gradient read whole (gathered over its mesh's shard dimension) and written back as this
rank's shard.

FSDP2 keeps every parameter as a ``DTensor`` sharded by rows (``Shard(0)``) over a 1-D
mesh, or over the second dimension of a 2-D mesh whose first dimension replicates (HSDP).
After backward each gradient is a ``DTensor`` of the same placements holding the average
over the whole mesh. Anything else (tensor-parallel placements, FSDP1's flat parameters)
is refused with what is supported. The one place besides :mod:`spdkfac.comm.distributed`
that reads ``torch.distributed`` (DTensor, device meshes, FSDP classes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor, Replicate, Shard

from spdkfac.comm.base import Communicator
from spdkfac.comm.distributed import TorchDistributedCommunicator
from spdkfac.comm.owners import EVERYONE

__all__ = [
    "SUPPORTED_SHARDING",
    "GatheredGradients",
    "ShardedGradients",
    "check_sharding",
    "is_fully_sharded",
    "row_range",
]

#: What the FSDP2 layout accepts, for error messages.
SUPPORTED_SHARDING = (
    "FSDP2 (torch.distributed.fsdp.fully_shard) on a 1-D mesh, parameters placed "
    "(Shard(0),), or HSDP on a 2-D mesh (replicate, shard), parameters placed "
    "(Replicate(), Shard(0))"
)


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether ``model`` or a submodule was ``fully_shard``-ed (FSDP2), or holds DTensor
    parameters (then :func:`check_sharding` says whether spdkfac supports them).

    Raises:
        ValueError: FSDP1 (``FullyShardedDataParallel``) anywhere in ``model``.
    """
    for name, module in model.named_modules():
        if isinstance(module, FullyShardedDataParallel):
            where = name or "the model"
            raise ValueError(
                f"model: {where} is wrapped in FullyShardedDataParallel (FSDP1, flat "
                f"parameters), which spdkfac does not support; supported: {SUPPORTED_SHARDING}"
            )
    if any(isinstance(module, FSDPModule) for module in model.modules()):
        return True
    return any(isinstance(param, DTensor) for param in model.parameters())


def check_sharding(model: nn.Module) -> None:
    """Refuse a model whose DTensor parameters are not FSDP2's or HSDP's rows.

    Raises:
        ValueError: Parameters that are DTensors without ``fully_shard`` (tensor
            parallelism), placements other than FSDP2's (``Shard(1)``, a ``Replicate`` or
            ``Shard`` on a tensor-parallel mesh dimension), or plain parameters beside
            sharded ones (a module left out of ``fully_shard``).
    """
    if not any(isinstance(module, FSDPModule) for module in model.modules()):
        raise ValueError(
            "model: its parameters are DTensors but no module is fully_shard-ed (tensor "
            f"parallelism?), which spdkfac does not support; supported: {SUPPORTED_SHARDING}"
        )
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            raise ValueError(
                f"model: parameter {name!r} is not sharded while others are; fully_shard "
                f"the root module too (supported: {SUPPORTED_SHARDING})"
            )
        placements = tuple(param.placements)
        if placements not in ((Shard(0),), (Replicate(), Shard(0))):
            raise ValueError(
                f"model: parameter {name!r} is placed {placements} on a "
                f"{param.device_mesh.ndim}-D mesh (tensor parallelism?), which spdkfac does "
                f"not support; supported: {SUPPORTED_SHARDING}"
            )


def row_range(rows: int, parts: int, index: int) -> tuple[int, int]:
    """Rows ``[begin, end)`` of shard ``index`` when ``rows`` are split into ``parts`` as
    ``torch.chunk`` does (FSDP2's and DTensor's ``Shard(0)``: ⌈rows/parts⌉ per shard, the
    last ones shorter or empty)."""
    chunk = -(-rows // parts)
    return min(rows, index * chunk), min(rows, (index + 1) * chunk)


@dataclass(frozen=True)
class _Shard:
    """Where one gradient's local rows sit in the full tensor."""

    communicator: Communicator
    rows: int
    chunk: int
    begin: int
    end: int


class ShardedGradients:
    """The gradient access of an FSDP2 model: :meth:`read` all-gathers a ``Shard(0)``
    gradient over its mesh's shard dimension (padding uneven shards to equal ones), and
    :meth:`write` keeps this rank's rows. Plain tensors are read and written as they are.

    Every rank must read the same parameters in the same order (each read is a collective
    over the shard group); the engine reads blocks in their agreed order.
    """

    def __init__(self) -> None:
        self._groups: dict[int, Communicator] = {}

    def _communicator(self, mesh: Any) -> Communicator:
        group = mesh.get_group(mesh.ndim - 1)
        key = id(group)
        if key not in self._groups:
            self._groups[key] = TorchDistributedCommunicator(group)
        return self._groups[key]

    def _shard(self, grad: DTensor) -> _Shard:
        communicator = self._communicator(grad.device_mesh)
        rows = grad.shape[0]
        begin, end = row_range(rows, communicator.world_size, communicator.rank)
        local = grad.to_local()
        if local.shape[0] != end - begin:
            raise ValueError(
                f"model: a gradient of {rows} rows holds {local.shape[0]} on rank "
                f"{communicator.rank} of {communicator.world_size}, not torch.chunk's "
                f"{end - begin}; supported: {SUPPORTED_SHARDING}"
            )
        chunk = -(-rows // communicator.world_size)
        return _Shard(communicator, rows, chunk, begin, end)

    def gather_to_owners(
        self, communicator: Communicator, params: Sequence[Tensor], owners: Sequence[int]
    ) -> GatheredGradients:
        """Each owned parameter's full gradient at its owner only (a collective over
        ``communicator``, whose ranks own the parameters): every rank puts its rows in
        place in a zero tensor of the full shape, one reduce-scatter sums them at the
        owners (exact: each element is one rank's value plus zeros; under HSDP only the
        first replica contributes). Parameters of ``EVERYONE`` and those without a
        gradient are left to :meth:`read`.
        """
        pieces: list[list[Tensor]] = [[] for _ in range(communicator.world_size)]
        entries: list[tuple[int, Tensor]] = []
        for param, owner in zip(params, owners, strict=True):
            grad = param.grad
            if owner == EVERYONE or not isinstance(grad, DTensor):
                continue
            full = torch.zeros(grad.shape, dtype=grad.dtype, device=communicator.device)
            if _first_replica(grad.device_mesh):
                shard = self._shard(grad)
                full[shard.begin : shard.end].copy_(grad.to_local())
            pieces[owner].append(full)
            entries.append((owner, param))
        gathered: dict[int, Tensor] = {}
        if entries:
            chunks = [
                torch.cat([p.reshape(-1) for p in group]) if group else _empty(communicator)
                for group in pieces
            ]
            flat = communicator.reduce_scatter(chunks).wait()
            offset = 0
            for owner, param in entries:
                if owner == communicator.rank:
                    size = param.numel()
                    gathered[id(param)] = flat[offset : offset + size].view(param.shape)
                    offset += size
        return GatheredGradients(self, gathered)

    def read(self, param: Tensor) -> Tensor | None:
        grad = param.grad
        if not isinstance(grad, DTensor):
            return grad
        shard = self._shard(grad)
        local = grad.to_local()
        if shard.communicator.world_size == 1:
            return local.clone()
        padded = local.new_zeros((shard.chunk, *local.shape[1:]))
        padded[: local.shape[0]].copy_(local)
        pieces = shard.communicator.all_gather(padded.to(shard.communicator.device)).wait()
        return torch.cat(pieces)[: shard.rows].to(local.device)

    def write(self, param: Tensor, value: Tensor) -> None:
        grad = param.grad
        assert grad is not None
        if not isinstance(grad, DTensor):
            grad.copy_(value)
            return
        shard = self._shard(grad)
        grad.to_local().copy_(value[shard.begin : shard.end])


def _first_replica(mesh: Any) -> bool:
    """Whether this rank is in the first replica of an HSDP mesh (always on a 1-D mesh)."""
    return bool(mesh.ndim == 1 or mesh.get_local_rank(0) == 0)


def _empty(communicator: Communicator) -> Tensor:
    return torch.zeros(0, device=communicator.device)


class GatheredGradients:
    """Full gradients an owner gathered (:meth:`ShardedGradients.gather_to_owners`), read
    without a collective; other parameters read, and every write, through the sharded
    access."""

    def __init__(self, sharded: ShardedGradients, gathered: Mapping[int, Tensor]) -> None:
        self._sharded = sharded
        self._gathered = gathered

    def read(self, param: Tensor) -> Tensor | None:
        found = self._gathered.get(id(param))
        return found if found is not None else self._sharded.read(param)

    def write(self, param: Tensor, value: Tensor) -> None:
        self._sharded.write(param, value)
