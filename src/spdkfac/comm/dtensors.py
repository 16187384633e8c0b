"""Cheap questions about DTensors that never import them: a tensor cannot be a DTensor,
nor a model sharded by FSDP, before ``torch.distributed.tensor`` or ``.fsdp`` is imported
(which costs most of a second, so ``import spdkfac`` does not)."""

from __future__ import annotations

import sys

from torch import Tensor

__all__ = ["full_value", "local_part", "may_be_sharded"]

_SHARDING_MODULES = ("torch.distributed.fsdp", "torch.distributed.tensor")


def may_be_sharded() -> bool:
    """Whether FSDP or DTensor has been imported (else no model can be sharded)."""
    return any(name in sys.modules for name in _SHARDING_MODULES)


def local_part(tensor: Tensor | None) -> Tensor | None:
    """This rank's local tensor of a DTensor (whose own version counter does not move when
    its local tensor is written); any other tensor (or None) itself."""
    module = sys.modules.get("torch.distributed.tensor")
    if tensor is not None and module is not None and isinstance(tensor, module.DTensor):
        local: Tensor = module.DTensor.to_local(tensor)
        return local
    return tensor


def full_value(tensor: Tensor) -> Tensor:
    """A DTensor's whole value (``full_tensor()``: a collective over its mesh when a
    placement shards it, on every rank of that mesh, in the same order); any other
    tensor itself. The capture reads tensor-parallel layers' inputs and output gradients
    through this, so that every rank sees what the unsharded layer sees."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is not None and isinstance(tensor, module.DTensor):
        full: Tensor = module.DTensor.full_tensor(tensor)
        return full
    return tensor
