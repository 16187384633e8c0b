"""Gradient traffic of the owner-computes exchange (Osawa et al. 2019, Sec. 3 and Fig. 1).

Each registered layer has an owner rank. Gradients are *reduce-scattered*: a layer's
averaged gradient arrives at its owner only (ReduceScatterV), while parameters without an
owner (normalization layers, unregistered ones) are all-reduced as data-parallel training
does. After the owners precondition, their results are *all-gathered* (AllGatherV, one
broadcast per owner in rank order). The layouts depend only on replicated facts (which
pieces exist, their sizes, their owners), so every rank issues the same collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.futures import Future

from spdkfac.comm.base import Communicator, completed

__all__ = ["EVERYONE", "gather_from_owners", "reduce_to_owners"]

#: Owner of a piece every rank needs reduced (all-reduced).
EVERYONE = -1


def _flat(pieces: Sequence[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    if not pieces:
        return torch.zeros(0, dtype=dtype, device=device)
    return torch.cat([piece.reshape(-1).to(device=device, dtype=dtype) for piece in pieces])


def reduce_to_owners(
    communicator: Communicator,
    pieces: Sequence[Tensor],
    owners: Sequence[int],
    *,
    dtype: torch.dtype = torch.float32,
) -> Future[None]:
    """Average ``pieces`` over the group: each at its owner, ``EVERYONE``'s on every rank.

    Issues at most one reduce-scatter (when some piece has an owner) and one all-reduce
    (when some piece is ``EVERYONE``'s), both asynchronous; the future completes once this
    rank's own and everyone's pieces hold the averages, in place. Other ranks' pieces are
    left as they were (their values are meaningless afterwards). ``pieces`` must have the
    same sizes and owners on every rank; they travel in ``dtype``.
    """
    world = communicator.world_size
    device = communicator.device
    rank = communicator.rank
    by_owner: list[list[Tensor]] = [[] for _ in range(world)]
    shared: list[Tensor] = []
    for piece, owner in zip(pieces, owners, strict=True):
        (shared if owner == EVERYONE else by_owner[owner]).append(piece)
    futures: list[Future[None]] = []
    if any(by_owner):
        chunks = [_flat(group, dtype, device) for group in by_owner]
        mine = by_owner[rank]
        futures.append(communicator.reduce_scatter(chunks).then(_writer(mine, world)))
    if shared:
        futures.append(
            communicator.all_reduce_sum(_flat(shared, dtype, device)).then(_writer(shared, world))
        )
    return torch.futures.collect_all(futures).then(lambda _all: None)


def _writer(pieces: Sequence[Tensor], world: int) -> Callable[[Future[Tensor]], None]:
    def write(done: Future[Tensor]) -> None:
        flat = done.value()
        offset = 0
        for piece in pieces:
            size = piece.numel()
            piece.copy_(flat[offset : offset + size].view_as(piece).div(world))
            offset += size

    return write


def gather_from_owners(
    communicator: Communicator, sizes: Sequence[int], mine: Tensor
) -> list[Future[Tensor]]:
    """AllGatherV: every owner's flat segment on every rank, as one broadcast per owner.

    Args:
        communicator: The group.
        sizes: Elements of each rank's segment (the same on every rank); a rank with
            nothing to send issues no broadcast.
        mine: This rank's segment (``sizes[rank]`` elements).

    Returns:
        One future per rank, in rank order, giving its segment (``mine`` for this rank).
    """
    rank = communicator.rank
    if mine.numel() != sizes[rank]:
        raise ValueError(f"this rank's segment has {mine.numel()} elements, not {sizes[rank]}")
    futures: list[Future[Tensor]] = []
    for owner, size in enumerate(sizes):
        if size == 0:
            futures.append(completed(torch.zeros(0, dtype=mine.dtype, device=mine.device)))
            continue
        buffer = mine if owner == rank else torch.empty(size, dtype=mine.dtype, device=mine.device)
        futures.append(communicator.broadcast(buffer, src=owner))
    return futures
