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
from spdkfac.profiling import Profiler, span_name

__all__ = ["BroadcastGroup", "broadcast_groups", "invert_factors"]


@dataclass(frozen=True)
class BroadcastGroup:
    """Inverses one owner sends in a single broadcast, as concatenated packed triangles."""

    owner: int
    keys: tuple[str, ...]
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        """Length of the concatenated packed buffer."""
        return sum(packed_size(dim) for dim in self.dims)


def broadcast_groups(
    plan: Plan, available: Mapping[str, object], min_group_elements: int = 0
) -> list[BroadcastGroup]:
    """Communicated factors grouped into broadcasts, in the order every rank issues them.

    Each owner's factors are taken in plan order and packed into groups of at least
    ``min_group_elements`` elements (0: one broadcast per factor, as in the SPD-KFAC paper;
    larger values save per-message start-up time when it dominates). Owners' groups are
    interleaved (first group of every rank, then second, …) so all ranks start computing
    at once and each broadcast is issued as soon as its owner can have it ready. Depends
    only on the plan and on which factors exist, both replicated on every rank.
    """
    per_owner: list[list[BroadcastGroup]] = [[] for _ in range(plan.world_size)]
    open_groups: list[list[tuple[str, int]]] = [[] for _ in range(plan.world_size)]
    for spec, owner in zip(plan.factors, plan.owners, strict=True):
        if owner == EVERY_RANK or spec.key not in available:
            continue
        members = open_groups[owner]
        members.append((spec.key, spec.dim))
        if sum(packed_size(dim) for _, dim in members) >= min_group_elements:
            per_owner[owner].append(_close(owner, members))
            open_groups[owner] = []
    for owner, members in enumerate(open_groups):
        if members:
            per_owner[owner].append(_close(owner, members))
    order: list[BroadcastGroup] = []
    for position in range(max((len(groups) for groups in per_owner), default=0)):
        order.extend(groups[position] for groups in per_owner if position < len(groups))
    return order


def _close(owner: int, members: list[tuple[str, int]]) -> BroadcastGroup:
    return BroadcastGroup(owner, tuple(key for key, _ in members), tuple(dim for _, dim in members))


def invert_factors(
    factors: Mapping[str, Tensor],
    plan: Plan,
    communicator: Communicator,
    damping: float,
    method: InverseMethod = "cholesky",
    *,
    min_group_elements: int = 0,
    profiler: Profiler | None = None,
) -> dict[str, Tensor]:
    """Compute ``(F + γI)⁻¹`` for every factor, placed as ``plan`` says.

    ``factors`` must be identical on every rank (global factors after the exchange). The
    owner of a communicated factor inverts it and broadcasts the packed upper triangle
    asynchronously (grouped as :func:`broadcast_groups` says), so the broadcast overlaps
    its next inversion; other ranks post the receive at once. Non-communicated factors are
    inverted locally after every broadcast has been issued, overlapping the transfers.

    Returns:
        Factor key → damped inverse, the same on every rank.
    """
    rank = communicator.rank
    profiler = profiler or Profiler()

    def invert(key: str) -> Tensor:
        with profiler.span(span_name("inverse_compute", key)):
            return damped_inverse(factors[key], damping, method)

    if communicator.world_size == 1:
        return {key: invert(key) for key in factors}
    inverses: dict[str, Tensor] = {}
    pending: list[tuple[BroadcastGroup, Future[Tensor]]] = []
    for group in broadcast_groups(plan, factors, min_group_elements):
        dtype = inverse_dtype(factors[group.keys[0]].dtype)
        if group.owner == rank:
            for key in group.keys:
                inverses[key] = invert(key)
            with profiler.span(span_name("inverse_compute", "pack")):
                parts = [pack_triu(inverses[key]) for key in group.keys]
                buffer = torch.cat(parts).to(device=communicator.device, dtype=dtype)
        else:
            buffer = torch.empty(group.elements, dtype=dtype, device=communicator.device)
        pending.append((group, communicator.broadcast(buffer, src=group.owner)))
    for spec, owner in zip(plan.factors, plan.owners, strict=True):
        if owner == EVERY_RANK and spec.key in factors:
            inverses[spec.key] = invert(spec.key)
    for group, future in pending:
        with profiler.span(span_name("inverse_comm", "wait")):
            received = future.wait()
        if group.owner == rank:
            continue
        offset = 0
        for key, dim in zip(group.keys, group.dims, strict=True):
            size = packed_size(dim)
            inverses[key] = unpack_triu(received[offset : offset + size], dim).to(
                factors[key].device
            )
            offset += size
    return inverses
