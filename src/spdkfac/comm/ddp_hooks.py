"""DDP communication hooks: timing each gradient bucket's all-reduce, and reducing buckets
to the layer owners of the owner-computes exchange."""

# No ``from __future__ import annotations`` here: DDP inspects the hook's signature and
# accepts only the real ``GradBucket`` class (or nothing) as the bucket's annotation.

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch._C._distributed_c10d import GradBucket  # torch.distributed.GradBucket itself
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from spdkfac.comm.base import Communicator
from spdkfac.comm.owners import EVERYONE, reduce_to_owners
from spdkfac.comm.scheduler import CommScheduler
from spdkfac.planning.schedule import GRADIENTS

__all__ = [
    "BucketLaunches",
    "DDPCommHook",
    "SwitchableHook",
    "owner_reduce_hook",
    "scheduled_allreduce_hook",
    "timed_allreduce_hook",
]

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


def scheduled_allreduce_hook(
    scheduler: CommScheduler, recorder: Callable[[int, float], None]
) -> DDPCommHook:
    """DDP's all-reduce, through ``scheduler`` when its window plans the bucket
    (``comm_scheduler="priority"``), else DDP's default hook; ``recorder`` as in
    :func:`timed_allreduce_hook`. Either way the bucket is divided by the world size, then
    summed, as DDP does."""

    def hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        recorder(bucket.index(), time.perf_counter())
        buffer = bucket.buffer()
        index = scheduler.admit(GRADIENTS, buffer.numel())
        if index is None:
            return allreduce_hook(state, bucket)
        buffer.div_(scheduler.group.world_size)
        return scheduler.enqueue(GRADIENTS, index, [(buffer.view(-1), None)], buffer)

    return hook


def owner_reduce_hook(
    communicator: Communicator,
    owner_of: Mapping[int, int],
    recorder: Callable[[int, float], None] | None = None,
) -> DDPCommHook:
    """A hook that averages each bucket to the layer owners instead of all-reducing it.

    The bucket's parameters owned by a rank (``owner_of[id(parameter)]``) are
    reduce-scattered to it; the rest (``EVERYONE``'s: parameters without an owner) are
    all-reduced (:func:`~spdkfac.comm.owners.reduce_to_owners`). Only this rank's own and
    everyone's gradients are averages afterwards; the owner-computes step all-gathers the
    others' preconditioned gradients. Register it with
    ``ddp_model.register_comm_hook(None, hook)``; ``recorder`` is called like
    :func:`timed_allreduce_hook`'s.
    """

    def hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        if recorder is not None:
            recorder(bucket.index(), time.perf_counter())
        buffer = bucket.buffer()
        pieces = []
        owners = []
        offset = 0
        for parameter in bucket.parameters():
            size = parameter.numel()
            pieces.append(buffer[offset : offset + size])
            owners.append(owner_of.get(id(parameter), EVERYONE))
            offset += size
        if offset != buffer.numel():
            raise RuntimeError(
                f"spdkfac: a DDP gradient bucket holds {buffer.numel()} elements, its "
                f"parameters {offset}: cannot split it by owner"
            )
        dtype = torch.float64 if buffer.dtype == torch.float64 else torch.float32
        done = reduce_to_owners(communicator, pieces, owners, dtype=dtype)
        return done.then(lambda _done: buffer)

    return hook


class SwitchableHook:
    """One hook registered once whose behaviour can change between iterations (DDP takes
    a single communication hook per model): DDP's default all-reduce (through the
    ``scheduler`` when one is given), or the hook given to :meth:`use` (``strategy="auto"``
    trying an owner-computes composition). Records bucket launches in :attr:`launches`
    either way.
    """

    def __init__(self, scheduler: CommScheduler | None = None) -> None:
        self.launches = BucketLaunches()
        self._hook: DDPCommHook | None = None
        self._default = (
            None if scheduler is None else scheduled_allreduce_hook(scheduler, self.launches)
        )

        def switchable_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
            return self(state, bucket)

        #: The function to register (DDP wants a named function).
        self.function: DDPCommHook = switchable_hook

    def use(self, hook: DDPCommHook | None) -> None:
        """Use ``hook`` from the next bucket on (None: DDP's all-reduce)."""
        self._hook = hook

    def plain(self) -> None:
        """DDP's own all-reduce from the next bucket on, never the scheduler's."""
        self._hook = self._default = None

    def __call__(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self._hook is not None:
            return self._hook(state, bucket)
        if self._default is not None:
            return self._default(state, bucket)
        self.launches(bucket.index(), time.perf_counter())
        return allreduce_hook(state, bucket)
