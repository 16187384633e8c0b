"""DDP communication hooks that time when each gradient bucket's all-reduce is launched."""

# No ``from __future__ import annotations`` here: DDP inspects the hook's signature and
# accepts only the real ``GradBucket`` class (or nothing) as the bucket's annotation.

import time
from collections.abc import Callable
from typing import Any

import torch
from torch._C._distributed_c10d import GradBucket  # torch.distributed.GradBucket itself
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

__all__ = ["BucketLaunches", "DDPCommHook", "timed_allreduce_hook"]

#: The contract of ``DistributedDataParallel.register_comm_hook``.
DDPCommHook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]


class BucketLaunches:
    """Host times (``time.perf_counter()``) at which gradient buckets were launched.

    Clear it before each backward pass; afterwards :attr:`last` is the launch of the
    iteration's last bucket (the start of the gradient communication nothing can hide).
    """

    def __init__(self) -> None:
        self.times: list[tuple[int, float]] = []

    def __call__(self, index: int, moment: float) -> None:
        """Record that bucket ``index`` was launched at ``moment``."""
        self.times.append((index, moment))

    @property
    def last(self) -> float | None:
        """The latest launch time since :meth:`clear` (None when nothing launched)."""
        return max((moment for _, moment in self.times), default=None)

    def clear(self) -> None:
        """Forget every launch."""
        self.times.clear()


def timed_allreduce_hook(recorder: Callable[[int, float], None]) -> DDPCommHook:
    """DDP's default all-reduce hook, calling ``recorder(bucket_index, perf_counter())``
    just before each bucket's all-reduce is launched.

    Register it with ``ddp_model.register_comm_hook(None, hook)`` (state None: the default
    group) or with a process group as the state; gradients are averaged exactly as without
    a hook.
    """

    def hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        recorder(bucket.index(), time.perf_counter())
        return allreduce_hook(state, bucket)

    return hook
