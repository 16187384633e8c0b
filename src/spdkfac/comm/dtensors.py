"""Cheap questions about DTensors that never import them: a tensor cannot be a DTensor,
nor a model sharded by FSDP, before ``torch.distributed.tensor`` or ``.fsdp`` is imported
(which costs most of a second, so ``import spdkfac`` does not)."""

from __future__ import annotations

import sys

from torch import Tensor

__all__ = ["local_part", "may_be_sharded"]

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
