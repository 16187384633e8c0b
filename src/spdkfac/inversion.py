"""The inverse phase: each rank inverts what the plan gives it and broadcasts CT results."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.futures import Future

from spdkfac.comm import Communicator
from spdkfac.linalg import (
    InverseMethod,
    damped_inverse,
    inverse_dtype,
    pack_triu,
    packed_size,
    unpack_triu,
)
from spdkfac.placement import EVERY_RANK, Plan

__all__ = ["broadcast_order", "invert_factors"]


@dataclass(frozen=True)
class _Broadcast:
    key: str
    dim: int
    owner: int


def broadcast_order(plan: Plan, available: Mapping[str, object]) -> list[_Broadcast]:
    """Communicated factors in the order every rank issues their broadcasts.

    Each owner's factors are taken in plan order and the owners are interleaved (first
    factor of every rank, then second, …), so all ranks start computing at once and each
    broadcast is issued as soon as its owner can have it ready. Depends only on the plan
    and on which factors exist, both replicated.
    """
    queues: list[list[_Broadcast]] = [[] for _ in range(plan.world_size)]
    for spec, owner in zip(plan.factors, plan.owners, strict=True):
        if owner != EVERY_RANK and spec.key in available:
            queues[owner].append(_Broadcast(spec.key, spec.dim, owner))
    order: list[_Broadcast] = []
    for position in range(max((len(q) for q in queues), default=0)):
        order.extend(queue[position] for queue in queues if position < len(queue))
    return order


def invert_factors(
    factors: Mapping[str, Tensor],
    plan: Plan,
    communicator: Communicator,
    damping: float,
    method: InverseMethod = "cholesky",
) -> dict[str, Tensor]:
    """Compute ``(F + γI)⁻¹`` for every factor, placed as ``plan`` says.

    ``factors`` must be identical on every rank (global factors after the exchange). The
    owner of a communicated factor inverts it and broadcasts the packed upper triangle
    asynchronously, so the broadcast overlaps its next inversion; other ranks post the
    receive at once. Non-communicated factors are inverted locally after every broadcast
    has been issued, overlapping the transfers in flight.

    Returns:
        Factor key → damped inverse, the same on every rank.
    """
    rank = communicator.rank
    if communicator.world_size == 1:
        return {key: damped_inverse(f, damping, method) for key, f in factors.items()}
    inverses: dict[str, Tensor] = {}
    pending: list[tuple[_Broadcast, Future[Tensor]]] = []
    for item in broadcast_order(plan, factors):
        factor = factors[item.key]
        if item.owner == rank:
            inverse = damped_inverse(factor, damping, method)
            inverses[item.key] = inverse
            buffer = pack_triu(inverse).to(communicator.device)
        else:
            buffer = torch.empty(
                packed_size(item.dim),
                dtype=inverse_dtype(factor.dtype),
                device=communicator.device,
            )
        pending.append((item, communicator.broadcast(buffer, src=item.owner)))
    for spec, owner in zip(plan.factors, plan.owners, strict=True):
        if owner == EVERY_RANK and spec.key in factors:
            inverses[spec.key] = damped_inverse(factors[spec.key], damping, method)
    for item, future in pending:
        received = future.wait()
        if item.owner != rank:
            factor = factors[item.key]
            inverses[item.key] = unpack_triu(received, item.dim).to(factor.device)
    return inverses
