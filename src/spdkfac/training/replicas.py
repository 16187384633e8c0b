"""Whether every rank holds the same replica: one all-gather of a digest of its tensors."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from spdkfac.comm import Communicator

__all__ = ["replicas_identical", "state_tensors"]


def replicas_identical(comm: Communicator, tensors: Iterable[Tensor]) -> bool:
    """Whether ``tensors`` are bitwise equal on every rank (one all-gather of a digest).

    A collective: every rank calls it with the same tensors in the same order.
    """
    hasher = hashlib.sha256()
    for tensor in tensors:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        hasher.update(str(flat.dtype).encode())
        hasher.update(flat.view(torch.uint8).numpy().tobytes())
    if comm.world_size == 1:
        return True
    local = torch.frombuffer(bytearray(hasher.digest()), dtype=torch.uint8).to(comm.device)
    gathered = comm.all_gather(local).wait()
    return all(torch.equal(other.cpu(), gathered[0].cpu()) for other in gathered)


def state_tensors(state: Mapping[str, Any] | Iterable[Any]) -> list[Tensor]:
    """Every tensor in a nested state dict (dicts in key order, lists in order)."""
    found: list[Tensor] = []
    items = state.values() if isinstance(state, Mapping) else state
    for value in items:
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, (Mapping, list, tuple)):
            found.extend(state_tensors(value))
    return found
