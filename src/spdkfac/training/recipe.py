"""The checks of the baselines' usual recipe in ``spdkfac train``: gradient clipping by global
norm (``grad_clip``), and ``beta2``'s default (which optimizers take ``beta2`` and SOAP's
``precondition_frequency`` is :mod:`spdkfac.training.optimizer_table`'s)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spdkfac.training.config import TrainConfig

__all__ = ["DEFAULT_BETA2", "check_recipe"]

#: ``beta2``'s default: ``torch.optim.AdamW``'s.
DEFAULT_BETA2 = 0.999


def check_recipe(config: TrainConfig) -> None:
    """``beta2`` needs an AdamW part, ``precondition_frequency`` SOAP; ``grad_clip`` needs
    every rank to hold the whole averaged gradient before K-FAC (not an owner strategy's,
    not FSDP's shards).

    Raises:
        ValueError: Naming the option, its value and why.
    """
    if not config.grad_clip:
        return
    if config.fsdp:
        raise ValueError(f"grad_clip {config.grad_clip} is not supported with fsdp yet")
    rows = config.kfac.selection.rows if config.uses_kfac else ()
    owners = [row.name for row in rows if row.owner_computes]
    if owners:
        raise ValueError(
            f"grad_clip {config.grad_clip} needs the whole averaged gradient on every rank "
            f"before K-FAC, but strategy {config.kfac.strategy!r} may run {owners[0]!r}, "
            "which reduces each layer's gradient to its owner only"
        )
