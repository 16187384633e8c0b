"""The ``torch.distributed`` communicator (gloo, NCCL, any process group) and process set-up.

With :mod:`spdkfac.comm.ddp_hooks` (DDP communication hooks), the only module of the
package that touches ``torch.distributed``.
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from spdkfac.comm.base import Communicator
from spdkfac.comm.local import LocalCommunicator

__all__ = [
    "TorchDistributedCommunicator",
    "barrier",
    "destroy_distributed",
    "init_distributed",
    "is_distributed",
    "make_communicator",
    "release",
]


_EXIT_HOOK: list[bool] = []


def _leave_at_exit() -> None:
    """Make sure the process group is left before the interpreter exits (once).

    Every collective here completes through a Python ``.then()`` continuation run on a gloo
    worker thread. A script that ends without ``destroy_process_group()`` lets Python's
    finalization tear the groups down while those threads may still hold a continuation:
    measured on torch 2.13 (gloo, 2 ranks, DDP + SPD-KFAC), 1 exit in 12 aborted with
    "terminate called without an active exception". Leaving the group at exit, as torch
    recommends scripts do, removes that race; a script that already left is unaffected.
    """
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(True)
        atexit.register(destroy_distributed)


def _first(future: Future[Any]) -> Future[Tensor]:
    """Turn a work future holding ``[tensor]`` into one holding ``tensor``."""

    def unwrap(done: Future[Any]) -> Tensor:
        value = done.value()
        result = value[0] if isinstance(value, (list, tuple)) else value
        assert isinstance(result, Tensor)
        return result

    return future.then(unwrap)


def _check_group_type(process_group: object) -> None:
    """Reject what cannot be a group, before asking ``torch.distributed`` about it."""
    if (
        process_group is not None
        and process_group is not dist.GroupMember.NON_GROUP_MEMBER
        and not isinstance(process_group, dist.ProcessGroup)
    ):
        raise ValueError(
            "process_group must be a torch.distributed ProcessGroup, a Communicator or "
            f"None, got {process_group!r}"
        )


class TorchDistributedCommunicator:
    """Collectives on a ``torch.distributed`` process group (default: the world).

    Args:
        process_group: The group; None means the default group.

    Raises:
        ValueError: When ``process_group`` is not a process group, ``torch.distributed`` is
            not initialized or this rank is not a member of ``process_group``.
    """

    def __init__(self, process_group: Any = None) -> None:
        _check_group_type(process_group)
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "process_group needs torch.distributed to be initialized "
                "(call init_process_group, or launch with torchrun)"
            )
        if process_group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(
                f"process_group: this rank ({dist.get_rank()}) is not a member of the group"
            )
        group_rank = dist.get_rank(process_group)
        if group_rank < 0:
            raise ValueError(
                f"process_group: this rank ({dist.get_rank()}) is not a member of the group"
            )
        _leave_at_exit()
        self._owns_group = False  # True for a duplicate: release() destroys its group
        self._group = process_group
        self._rank = group_rank
        self._world_size = dist.get_world_size(process_group)
        backend = str(dist.get_backend(process_group)).lower()
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if "nccl" in backend
            else torch.device("cpu")
        )

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def process_group(self) -> Any:
        """The underlying process group (None: the default one)."""
        return self._group

    def _all_reduce(self, tensor: Tensor, op: Any) -> Future[Tensor]:
        work = dist.all_reduce(tensor, op=op, group=self._group, async_op=True)
        assert work is not None
        return _first(work.get_future())

    def all_reduce_sum(self, tensor: Tensor) -> Future[Tensor]:
        return self._all_reduce(tensor, dist.ReduceOp.SUM)

    def all_reduce_average(self, tensor: Tensor) -> Future[Tensor]:
        # Gloo has no AVG op: sum, then divide in the completion callback.
        world = self._world_size
        return self.all_reduce_sum(tensor).then(lambda done: done.value().div_(world))

    def all_reduce_max(self, tensor: Tensor) -> Future[Tensor]:
        return self._all_reduce(tensor, dist.ReduceOp.MAX)

    def broadcast(self, tensor: Tensor, src: int) -> Future[Tensor]:
        if not 0 <= src < self._world_size:
            raise ValueError(f"broadcast src must be in [0, {self._world_size}), got {src}")
        global_src = src if self._group is None else dist.get_global_rank(self._group, src)
        work = dist.broadcast(tensor, src=global_src, group=self._group, async_op=True)
        assert work is not None
        return _first(work.get_future())

    def all_gather(self, tensor: Tensor) -> Future[list[Tensor]]:
        outputs = [torch.empty_like(tensor) for _ in range(self._world_size)]
        work = dist.all_gather(outputs, tensor, group=self._group, async_op=True)
        assert work is not None
        gathered: Future[list[Tensor]] = work.get_future().then(lambda _done: outputs)
        return gathered

    def reduce_scatter(self, chunks: Sequence[Tensor]) -> Future[Tensor]:
        world, rank = self._world_size, self._rank
        if len(chunks) != world:
            raise ValueError(
                f"reduce_scatter needs one chunk per rank ({world}), got {len(chunks)}"
            )
        # ReduceScatterV as one reduce per owner: each moves its chunk's bytes once per
        # link whatever the other chunks' sizes, where an all-to-all (or NCCL's
        # reduce-scatter, padded to equal chunks) would make every owner receive P − 1
        # copies of the largest chunk. Empty chunks issue nothing (sizes are replicated).
        works = []
        for owner, chunk in enumerate(chunks):
            if chunk.numel() == 0:
                continue
            dst = owner if self._group is None else dist.get_global_rank(self._group, owner)
            work = dist.reduce(chunk, dst=dst, group=self._group, async_op=True)
            assert work is not None
            works.append(work.get_future())
        mine = chunks[rank]
        reduced: Future[Tensor] = torch.futures.collect_all(works).then(lambda _done: mine)
        return reduced

    def duplicate(self) -> TorchDistributedCommunicator:
        if self._group is None:
            ranks = list(range(dist.get_world_size()))
        else:
            ranks = [dist.get_global_rank(self._group, r) for r in range(self._world_size)]
        backend = dist.get_backend(self._group)
        # new_group() would otherwise get torch's default timeout (30 min for gloo), not
        # this group's: a stalled peer would hang the duplicate long after the original
        # group's timeout.
        timeout = _group_timeout(self._group, self._device)
        # A subgroup is created by its members only: ranks of different subgroups (the
        # data-parallel groups of an FSDP2 × TP mesh) duplicate different groups at once,
        # which a world-synchronised new_group() would deadlock on.
        subgroup = len(ranks) < dist.get_world_size()
        copy = TorchDistributedCommunicator(
            dist.new_group(
                ranks=ranks, backend=backend, timeout=timeout, use_local_synchronization=subgroup
            )
        )
        copy._owns_group = True
        return copy

    def __repr__(self) -> str:
        return f"TorchDistributedCommunicator(rank={self._rank}, world_size={self._world_size})"


def _group_timeout(group: Any, device: torch.device) -> timedelta | None:
    """The collective timeout of ``group`` (None when the backend does not expose it)."""
    try:
        process_group: Any = group if group is not None else dist.group.WORLD
        timeout = process_group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is initialized with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def make_communicator(process_group: Any = None) -> Communicator:
    """The communicator for ``process_group`` (a ``Communicator`` is returned as it is):
    local when not distributed and none is given."""
    if isinstance(process_group, Communicator):
        return process_group
    if process_group is None and not (dist.is_available() and dist.is_initialized()):
        return LocalCommunicator()
    return TorchDistributedCommunicator(process_group)


def init_distributed(
    backend: str | None = None, *, timeout: timedelta | None = None
) -> Communicator:
    """Join the process group described by torchrun's environment, or run alone.

    With ``WORLD_SIZE`` > 1 in the environment (torchrun, or MASTER_ADDR/PORT, RANK and
    WORLD_SIZE set by hand) this initializes ``torch.distributed`` (NCCL when CUDA is
    available, else gloo, unless ``backend`` says otherwise) and returns its communicator;
    otherwise it returns a :class:`LocalCommunicator`.
    """
    if dist.is_available() and dist.is_initialized():
        return TorchDistributedCommunicator()
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return LocalCommunicator()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timeout)
    return TorchDistributedCommunicator()


def barrier(communicator: Communicator) -> None:
    """Wait until every rank of ``communicator`` reaches this point."""
    if communicator.world_size > 1:
        communicator.all_reduce_sum(torch.zeros(1, device=communicator.device)).wait()


def release(communicator: Communicator) -> None:
    """Destroy the process group of a communicator that :meth:`duplicate` made (every rank
    at the same point, after its last collective on it); other communicators are left as
    they are."""
    if isinstance(communicator, TorchDistributedCommunicator) and communicator._owns_group:
        communicator._owns_group = False
        if dist.is_initialized():
            _destroy(communicator.process_group)


def destroy_distributed() -> None:
    """Leave the default process group, if one was joined."""
    if dist.is_available() and dist.is_initialized():
        _destroy(None)


def _destroy(group: Any) -> None:
    # A gloo worker thread that finished a collective still has to drop the Python
    # ``.then()`` continuation under the GIL, and the group's destructor joins that
    # thread while holding the GIL: tearing down right after a collective (an error
    # agreed by every rank, say) can deadlock. Releasing the GIL briefly lets it finish.
    time.sleep(0.05)
    dist.destroy_process_group(group)
