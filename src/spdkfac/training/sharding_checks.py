"""The checks of ``spdkfac train``'s sharded layouts: FSDP2 (``fsdp``), HSDP
(``hsdp_replicas``), FSDP2 × TP (``tp_size``) and HSDP × TP (both), run by
:class:`TrainConfig` on construction, before any process group exists."""

from __future__ import annotations

from typing import TYPE_CHECKING

from spdkfac.models import TENSOR_PARALLEL_MODELS
from spdkfac.support.checks import check_int

if TYPE_CHECKING:
    from spdkfac.training.config import TrainConfig

__all__ = ["check_sharding"]


def check_sharding(config: TrainConfig) -> None:
    """Refuse a sharded layout ``config`` cannot train.

    Raises:
        ValueError: Naming the option, its value and why.
    """
    _check_fsdp(config)
    _check_tensor_parallel(config)


def _check_fsdp(config: TrainConfig) -> None:
    """``fsdp`` trains only with what was tested under it; ``hsdp_replicas`` needs it."""
    if config.hsdp_replicas is not None:
        check_int("hsdp_replicas", config.hsdp_replicas, low=1)
        if not config.fsdp:
            raise ValueError("hsdp_replicas needs fsdp (HSDP is FSDP2 on a 2-D mesh)")
    if not config.fsdp:
        return
    refused = [
        ("weight_rescaling", config.weight_rescaling),
        (
            f"optimizer {config.optimizer!r}",
            config.base_optimizer in ("muon", "soap", "eigen-adam", "eigen-adam-muon"),
        ),
    ]
    named = [name for name, given in refused if given]
    if named:
        raise ValueError(
            f"fsdp does not support {', '.join(named)} (not built for sharded "
            "parameters yet; optimizers: sgd, kfac, adamw, kfac-adamw)"
        )


def _check_tensor_parallel(config: TrainConfig) -> None:
    """``tp_size``: FSDP2 × TP on a ``(dp, tp)`` mesh (HSDP × TP on a ``(replicate,
    shard, tp)`` one with ``hsdp_replicas``), for a model with a plan whose attention heads
    split evenly (the world's divisibility is checked at launch)."""
    if config.tp_size is None:
        return
    check_int("tp_size", config.tp_size, low=2)
    if not config.fsdp:
        raise ValueError(
            f"tp_size {config.tp_size} needs fsdp (tensor parallelism runs under FSDP2 on a "
            "(dp, tp) mesh)"
        )
    if config.model.lower() not in TENSOR_PARALLEL_MODELS:
        raise ValueError(
            f"model {config.model!r} has no tensor-parallel plan for tp_size; models with "
            f"one: {', '.join(TENSOR_PARALLEL_MODELS)}"
        )
    if config.gpt_heads % config.tp_size:
        raise ValueError(
            f"tp_size {config.tp_size} must divide gpt_heads ({config.gpt_heads}): the "
            "attention heads are split across the tensor-parallel ranks"
        )
