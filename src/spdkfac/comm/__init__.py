"""Communication: the ``Communicator`` protocol, its implementations, the factor exchange."""

from __future__ import annotations

from spdkfac.comm.base import Communicator, completed
from spdkfac.comm.ddp_hooks import BucketLaunches, timed_allreduce_hook
from spdkfac.comm.distributed import (
    TorchDistributedCommunicator,
    barrier,
    destroy_distributed,
    init_distributed,
    is_distributed,
    make_communicator,
    release,
)
from spdkfac.comm.gather import gather_events
from spdkfac.comm.local import LocalCommunicator

__all__ = [
    "BucketLaunches",
    "Communicator",
    "LocalCommunicator",
    "TorchDistributedCommunicator",
    "barrier",
    "completed",
    "destroy_distributed",
    "gather_events",
    "init_distributed",
    "is_distributed",
    "make_communicator",
    "release",
    "timed_allreduce_hook",
]
