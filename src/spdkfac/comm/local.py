"""The communicator of a group of one: every collective is the identity."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.futures import Future

from spdkfac.comm.base import completed

__all__ = ["LocalCommunicator"]


class LocalCommunicator:
    """World size 1, no ``torch.distributed`` needed; futures are already complete."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def all_reduce_sum(self, tensor: Tensor) -> Future[Tensor]:
        return completed(tensor)

    def all_reduce_average(self, tensor: Tensor) -> Future[Tensor]:
        return completed(tensor)

    def all_reduce_max(self, tensor: Tensor) -> Future[Tensor]:
        return completed(tensor)

    def broadcast(self, tensor: Tensor, src: int) -> Future[Tensor]:
        if src != 0:
            raise ValueError(f"broadcast src must be 0 in a group of one, got {src}")
        return completed(tensor)

    def all_gather(self, tensor: Tensor) -> Future[list[Tensor]]:
        future: Future[list[Tensor]] = Future()
        future.set_result([tensor])
        return future

    def reduce_scatter(self, chunks: Sequence[Tensor]) -> Future[Tensor]:
        if len(chunks) != 1:
            raise ValueError(f"reduce_scatter needs one chunk in a group of one, got {len(chunks)}")
        return completed(chunks[0])

    def duplicate(self) -> LocalCommunicator:
        return self

    def __repr__(self) -> str:
        return "LocalCommunicator()"
