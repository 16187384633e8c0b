"""The ``Communicator`` protocol: asynchronous collectives that return futures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor
from torch.futures import Future

__all__ = ["Communicator", "completed"]


def completed(value: Tensor) -> Future[Tensor]:
    """A future that already holds ``value``."""
    future: Future[Tensor] = torch.futures.Future()
    future.set_result(value)
    return future


@runtime_checkable
class Communicator(Protocol):
    """Collectives over one group of ranks; every call is asynchronous.

    Every rank of the group must issue the same calls, in the same order, with tensors of
    the same shape and dtype. Calls return at once with a future; ``future.wait()`` gives
    the result (the input tensor, modified in place, unless stated otherwise). Ranks are
    numbered within the group.
    """

    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        ...

    @property
    def world_size(self) -> int:
        """Number of ranks in the group."""
        ...

    @property
    def device(self) -> torch.device:
        """Where this group's tensors must live (CUDA for NCCL, CPU for gloo)."""
        ...

    def all_reduce_sum(self, tensor: Tensor) -> Future[Tensor]:
        """Sum ``tensor`` over the group, in place."""
        ...

    def all_reduce_average(self, tensor: Tensor) -> Future[Tensor]:
        """Average ``tensor`` over the group, in place."""
        ...

    def all_reduce_max(self, tensor: Tensor) -> Future[Tensor]:
        """Element-wise maximum over the group, in place."""
        ...

    def broadcast(self, tensor: Tensor, src: int) -> Future[Tensor]:
        """Copy rank ``src``'s ``tensor`` into every rank's ``tensor``."""
        ...

    def all_gather(self, tensor: Tensor) -> Future[list[Tensor]]:
        """Every rank's ``tensor`` (same shape on all ranks), in rank order."""
        ...

    def reduce_scatter(self, chunks: Sequence[Tensor]) -> Future[Tensor]:
        """ReduceScatterV: chunk ``r`` of every rank, summed, arrives at rank ``r`` only.

        ``chunks`` holds one 1-D tensor per rank, in rank order, of the same sizes on
        every rank (they may differ between ranks' chunks, and be empty). The future
        gives this rank's summed chunk (possibly its input, reduced in place); the other
        inputs may be overwritten.
        """
        ...

    def duplicate(self) -> Communicator:
        """A communicator over the same ranks whose collectives are ordered independently
        of this one's (a new process group). A collective: every rank must call it."""
        ...
