"""Gathering profiler events from every rank onto one timeline."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spdkfac.comm.base import Communicator
from spdkfac.profiling import Event, events_from_json, events_to_json

__all__ = ["gather_events"]


def gather_events(events: Sequence[Event], communicator: Communicator) -> list[Event]:
    """Every rank's events, on every rank (two all-gathers: lengths, then padded bytes).

    A collective: every rank of the group must call it.
    """
    if communicator.world_size == 1:
        return list(events)
    payload = torch.frombuffer(bytearray(events_to_json(events).encode()), dtype=torch.uint8)
    device = communicator.device
    length = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    lengths = [int(t) for t in communicator.all_gather(length).wait()]
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload.to(device)
    gathered = communicator.all_gather(padded).wait()
    merged: list[Event] = []
    for size, tensor in zip(lengths, gathered, strict=True):
        merged.extend(events_from_json(bytes(tensor[:size].cpu().tolist()).decode()))
    return sorted(merged, key=lambda event: event.start)
