"""The KL clip with the learning rate actually applied to each block.

The KL clip (Ba et al. 2017, as in Osawa et al. 2019) scales every preconditioned gradient
by ``ν = min(1, √(κ / |Σ_b η_b² ⟨V_b, ∇_b⟩|))``, where ``η_b`` is the learning rate the
optimizer will apply to block ``b``'s parameters at this step: read from the optimizer's
parameter groups when the preconditioner was given the optimizer (schedulers included),
else the ``lr`` option.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from spdkfac.config import KFACConfig
from spdkfac.curvature import CurvatureBlock

__all__ = [
    "LearningRates",
    "clip_from_sum",
    "clip_terms",
    "optimizer_rates",
]


def clip_terms(
    gradients: Mapping[str, Tensor],
    preconditioned: Mapping[str, Tensor],
    rates: Mapping[str, float],
) -> float:
    """``Σ_b η_b² ⟨V_b, ∇_b⟩`` over the blocks of ``preconditioned`` (0 for none)."""
    if not preconditioned:
        return 0.0
    terms = [
        (preconditioned[name] * gradients[name]).sum() * (rates[name] ** 2)
        for name in preconditioned
    ]
    return float(torch.stack(terms).sum())


def clip_from_sum(total: float, kl_clip: float | None) -> float | None:
    """``ν`` from the clip's sum; None when the sum is not finite."""
    if kl_clip is None:
        return 1.0
    if not math.isfinite(total):
        return None
    if total == 0.0:
        return 1.0
    return min(1.0, math.sqrt(kl_clip / abs(total)))


def optimizer_rates(
    optimizer: torch.optim.Optimizer, modules: Mapping[str, nn.Module]
) -> Callable[[], dict[str, float]]:
    """A function returning, per block, the current ``lr`` of the parameter group holding
    its module's weight (read at each call, so LR schedulers are followed).

    Raises:
        ValueError: A block's weight is in none of the optimizer's parameter groups.
    """
    group_of: dict[str, int] = {}
    for name, module in modules.items():
        weight = module.weight
        index = next(
            (
                i
                for i, group in enumerate(optimizer.param_groups)
                if any(p is weight for p in group["params"])
            ),
            None,
        )
        if index is None:
            raise ValueError(
                f"optimizer: the weight of layer {name!r} is in none of its parameter groups "
                "(pass the optimizer that updates the model)"
            )
        group_of[name] = index

    def rates() -> dict[str, float]:
        groups = optimizer.param_groups
        return {name: float(groups[index]["lr"]) for name, index in group_of.items()}

    return rates


class LearningRates:
    """The rate each block's update is applied with: the optimizer's (when given and the
    ``lr`` option is None), else the ``lr`` option (0.1 when unset, with a warning).

    Raises:
        ValueError: As :func:`optimizer_rates`.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | None,
        blocks: Sequence[CurvatureBlock],
        config: KFACConfig,
    ) -> None:
        self._names = [block.name for block in blocks]
        self._read = (
            None
            if optimizer is None
            else optimizer_rates(optimizer, {b.name: b.module for b in blocks})
        )
        if optimizer is None and config.lr is None and config.kl_clip is not None:
            warnings.warn(
                "spdkfac: the KL clip needs the learning rate: pass optimizer= (or lr=); "
                "using lr=0.1 until then",
                UserWarning,
                stacklevel=3,
            )

    def at(self, config: KFACConfig, step: int) -> dict[str, float]:
        """Per block, the learning rate of ``step``."""
        if self._read is not None and config.lr is None:
            return self._read()
        lr = config.lr_at(step)
        return dict.fromkeys(self._names, lr)
