"""The communicator a stream of calls hands to a :class:`~spdkfac.comm.scheduler.CommScheduler`
(``comm_scheduler="priority"``): planned all-reduces and reduce-scatters go through the
scheduler, everything else to the stream's own group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.futures import Future

from spdkfac.comm.base import Communicator

if TYPE_CHECKING:
    from spdkfac.comm.scheduler import CommScheduler

__all__ = ["ScheduledStream"]


class ScheduledStream:
    """A stream's :class:`~spdkfac.comm.base.Communicator`: all-reduces and
    reduce-scatters of a planned window go through the scheduler, everything else (and
    every call outside one) to ``fifo``."""

    def __init__(self, scheduler: CommScheduler, name: str, fifo: Communicator) -> None:
        self._scheduler = scheduler
        self._name = name
        self._fifo = fifo

    @property
    def rank(self) -> int:
        return self._fifo.rank

    @property
    def world_size(self) -> int:
        return self._fifo.world_size

    @property
    def device(self) -> torch.device:
        return self._fifo.device

    def all_reduce_sum(self, tensor: Tensor) -> Future[Tensor]:
        index = self._scheduler.admit(self._name, tensor.numel())
        if index is None:
            return self._fifo.all_reduce_sum(tensor)
        return self._scheduler.enqueue(self._name, index, [(tensor.view(-1), None)], tensor)

    def all_reduce_average(self, tensor: Tensor) -> Future[Tensor]:
        world = self.world_size
        return self.all_reduce_sum(tensor).then(lambda done: done.value().div_(world))

    def all_reduce_max(self, tensor: Tensor) -> Future[Tensor]:
        return self._fifo.all_reduce_max(tensor)

    def broadcast(self, tensor: Tensor, src: int) -> Future[Tensor]:
        return self._fifo.broadcast(tensor, src)

    def all_gather(self, tensor: Tensor) -> Future[list[Tensor]]:
        return self._fifo.all_gather(tensor)

    def reduce_scatter(self, chunks: Sequence[Tensor]) -> Future[Tensor]:
        if len(chunks) != self.world_size:
            return self._fifo.reduce_scatter(chunks)  # let it raise its error
        index = self._scheduler.admit(self._name, sum(chunk.numel() for chunk in chunks))
        if index is None:
            return self._fifo.reduce_scatter(chunks)
        segments: list[tuple[Tensor, int | None]] = [
            (chunk.view(-1), owner) for owner, chunk in enumerate(chunks) if chunk.numel()
        ]
        return self._scheduler.enqueue(self._name, index, segments, chunks[self.rank])

    def duplicate(self) -> Communicator:
        return self._fifo.duplicate()
