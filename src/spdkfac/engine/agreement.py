"""Construction-time checks: the preconditioner's arguments, and what every rank must
agree on before training (options, registered layers, cost model).

The agreement checks are collectives issued once, at construction, in the same order on
every rank; a disagreement or a local failure becomes the same error on every rank instead
of a hang. The argument checks run before any collective.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import torch

from spdkfac.comm import Communicator
from spdkfac.config import KFACConfig
from spdkfac.costmodel import DEFAULT_COST_MODEL, CostModel, resolve_cost_model
from spdkfac.curvature import CurvatureBlock, discover_blocks
from spdkfac.curvature.discovery import check_materialized

__all__ = [
    "check_agreement",
    "check_runtime_arguments",
    "discover_agreed_blocks",
    "shared_cost_model",
]


def check_agreement(
    communicator: Communicator,
    fingerprint: str,
    blocks: Sequence[CurvatureBlock] | None,
    local_error: ValueError | None,
) -> None:
    """All ranks compare a digest of their options and layers; any difference fails all.

    Args:
        communicator: The group.
        fingerprint: This rank's options (``KFACConfig.fingerprint()``).
        blocks: This rank's curvature blocks, or None when discovering them failed.
        local_error: That failure; re-raised here after the others learned about it.

    Raises:
        ValueError: ``local_error``, or a disagreement naming the ranks that differ.
    """
    if communicator.world_size == 1:
        if local_error is not None:
            raise local_error
        return
    described = "error" if blocks is None else ";".join(block.describe() for block in blocks)
    digest = hashlib.sha256(f"{fingerprint}|{described}".encode()).digest()
    local = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(communicator.device)
    gathered = [t.cpu() for t in communicator.all_gather(local).wait()]
    if local_error is not None:
        raise local_error
    differing = [rank for rank, other in enumerate(gathered) if not torch.equal(other, gathered[0])]
    if differing:
        raise ValueError(
            f"ranks disagree on the K-FAC options or registered layers: ranks {differing} "
            f"differ from rank 0 (rank {communicator.rank}: {len(blocks or ())} layers, "
            f"{fingerprint})"
        )


def shared_cost_model(
    communicator: Communicator, cost_model: CostModel | str | os.PathLike[str] | None
) -> CostModel:
    """Rank 0's cost model on every rank.

    Plans and broadcast groups then agree even when each rank measured its own. Only rank 0
    loads a file; a failure there is raised on every rank instead of leaving the others
    waiting in the broadcast.
    """
    error: Exception | None = None
    local = DEFAULT_COST_MODEL
    if communicator.rank == 0:
        try:
            local = resolve_cost_model(cost_model, communicator.world_size)
        except (OSError, ValueError) as exc:
            error = exc
    if communicator.world_size == 1:
        if error is not None:
            raise error
        return local
    vector = torch.tensor([float(error is not None), *local.as_vector()], dtype=torch.float64)
    shared = communicator.broadcast(vector.to(communicator.device), src=0).wait().cpu().tolist()
    if shared[0]:
        raise error or ValueError(f"cost_model: rank 0 could not load {cost_model!r}")
    return CostModel.from_vector(shared[1:])


def discover_agreed_blocks(
    communicator: Communicator, model: torch.nn.Module, config: KFACConfig
) -> list[CurvatureBlock]:
    """This rank's curvature blocks, after every rank checked that all agree (a collective):
    a discovery error on any rank is raised on every rank."""
    try:
        check_materialized(model)
        blocks: list[CurvatureBlock] | None = discover_blocks(
            model, config.skip_layers, config.block_settings
        )
        local_error: ValueError | None = None
    except ValueError as error:
        blocks, local_error = None, error
    check_agreement(communicator, config.fingerprint(), blocks, local_error)
    assert blocks is not None
    return blocks


def check_runtime_arguments(
    model: object, grad_scaler: object, optimizer: object, profile: object, cost_model: object
) -> None:
    """Validate the preconditioner's arguments that are not options.

    Raises:
        ValueError: A wrong type for ``grad_scaler``, ``optimizer`` or ``profile``.
        TypeError: A ``model`` that is not an ``nn.Module``, or a ``cost_model`` that is
            neither a ``CostModel``, a path nor None.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise ValueError(f"grad_scaler must be a torch.amp.GradScaler or None, got {grad_scaler!r}")
    if not isinstance(profile, bool):
        raise ValueError(f"profile must be a bool, got {profile!r}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer or None, got {optimizer!r}")
    if cost_model is not None and not isinstance(cost_model, (CostModel, str, os.PathLike)):
        raise TypeError(
            f"cost_model must be a CostModel, a path to a calibration JSON or None, "
            f"got {cost_model!r}"
        )
