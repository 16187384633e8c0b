"""A training run's state through ``torch.distributed.checkpoint`` (DCP): the model's and the
optimizer's state dicts as ``torch.distributed.checkpoint.state_dict`` gives them (DTensor
shards under FSDP2, parameters named by their module paths) and DCP's save and load, for
``spdkfac train --fsdp`` (``torch.distributed`` APIs, hence here)."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["dcp_load", "dcp_save", "load_training_state", "training_state"]


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}``: what :func:`dcp_save` writes of them, also the
    template :func:`dcp_load` fills (no collective under FSDP2).

    An optimizer without state yet (a fresh one, or SGD without momentum) is given it by
    one step with zero gradients at learning rate 0 (``get_optimizer_state_dict``'s way),
    which leaves the parameters as they are.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }


def load_training_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
) -> None:
    """Put :func:`training_state`'s entries, as :func:`dcp_load` filled them, into ``model``
    and ``optimizer`` (its parameter groups' settings, the learning rate among them, too)."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def _single() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _alone() -> Iterator[bool]:
    """Whether this process runs alone (no process group), DCP's warning that it then
    assumes so silenced: one process is what it is asked for here."""
    single = _single()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        yield single


def dcp_save(state: dict[str, Any], directory: str | os.PathLike[str]) -> None:
    """``torch.distributed.checkpoint.save`` of ``state`` into ``directory`` (created).

    A collective over the default process group when there is one (every rank, the same
    keys where they are replicated; each replicated key is written once); one process
    alone otherwise. The checkpoint is complete once ``.metadata`` exists.
    """
    from torch.distributed.checkpoint import state_dict_saver

    with _alone() as single:
        state_dict_saver.save(state, checkpoint_id=directory, no_dist=single)


def dcp_load(state: dict[str, Any], directory: str | os.PathLike[str]) -> None:
    """``torch.distributed.checkpoint.load`` into ``state`` (in place) from ``directory``,
    at any world size (DCP reshards). A collective like :func:`dcp_save`.

    Raises:
        RuntimeError: On every rank when it failed on any (DCP gathers the failures),
            naming the first failing rank and its error.
    """
    from torch.distributed.checkpoint import state_dict_loader
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _alone() as single:
            state_dict_loader.load(state, checkpoint_id=directory, no_dist=single)
    except CheckpointException as exc:  # a BaseException: made an ordinary error
        rank = min(exc.failures)
        error = exc.failures[rank][0]
        raise RuntimeError(f"rank {rank}: {type(error).__name__}: {error}") from None
