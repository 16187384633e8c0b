"""One all-reduce of every small dense statistic (normalization blocks) on a factor step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from spdkfac.comm.base import Communicator

__all__ = ["reduce_dense"]


def reduce_dense(
    communicator: Communicator,
    slots: Sequence[tuple[str, tuple[int, ...]]],
    pending: Mapping[str, tuple[Tensor | None, float]],
    dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor | None]:
    """Every slot's example-weighted average over all ranks (None where no rank had one).

    Args:
        communicator: The group.
        slots: ``(key, shape)`` per slot, in the same order on every rank.
        pending: Per key, this rank's weighted total (None when it captured nothing) and
            its weight (examples).
        dtype: Dtype of the reduction (float64 when any statistic is).

    Collective with more than one rank: **one** all-reduce of every slot's weighted total
    and weight, issued whenever ``slots`` is not empty, whatever was captured. A group of
    one returns copies of the local means.
    """
    if not slots:
        return {}
    if communicator.world_size == 1:
        means: dict[str, Tensor | None] = {}
        for key, _ in slots:
            total, weight = pending.get(key, (None, 0.0))
            if total is None:
                means[key] = None
            else:
                means[key] = total.div(weight) if weight != 1 else total.clone()
        return means
    device = communicator.device
    parts = []
    weights = []
    for key, shape in slots:
        total, weight = pending.get(key, (None, 0.0))
        numel = int(torch.Size(shape).numel())
        parts.append(
            torch.zeros(numel, dtype=dtype, device=device)
            if total is None
            else total.reshape(-1).to(device=device, dtype=dtype)
        )
        weights.append(float(weight))
    buffer = torch.cat([*parts, torch.tensor(weights, dtype=dtype, device=device)])
    reduced = communicator.all_reduce_sum(buffer).wait()
    totals = reduced[: -len(weights)].split([part.numel() for part in parts])
    result: dict[str, Tensor | None] = {}
    for (key, shape), total, weight in zip(
        slots, totals, reduced[-len(weights) :].tolist(), strict=True
    ):
        result[key] = None if weight <= 0 else (total / weight).reshape(shape)
    return result
