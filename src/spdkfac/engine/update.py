"""The last stage of a step: the KL clip with the learning rate actually applied, and the
guard against preconditioning the same gradient twice.

The KL clip (Ba et al. 2017, as in Osawa et al. 2019) scales every preconditioned gradient
by ``ν = min(1, √(κ / |Σ_b η_b² ⟨V_b, ∇_b⟩|))``, where ``η_b`` is the learning rate the
optimizer will apply to block ``b``'s parameters at this step: read from the optimizer's
parameter groups when the preconditioner was given the optimizer (schedulers included),
else the ``lr`` option.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn

from spdkfac.comm import Communicator
from spdkfac.config import KFACConfig
from spdkfac.curvature import CurvatureBlock
from spdkfac.linalg import all_finite
from spdkfac.profiling import Phase, Profiler, span_name

__all__ = [
    "GradientGuard",
    "LearningRates",
    "ReplicatedUpdate",
    "apply_preconditioned",
    "block_gradients",
    "clip_from_sum",
    "clip_terms",
    "kl_clip_scale",
    "optimizer_rates",
    "warn_uncaptured",
]


def block_gradients(blocks: Iterable[CurvatureBlock]) -> dict[str, Tensor]:
    """Each block's gradient matrix in its statistics dtype (float32 for bf16/fp16
    parameters); blocks without a gradient are left out."""
    return {
        block.name: grad.to(block.dtype)
        for block in blocks
        if (grad := block.gradient()) is not None
    }


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


def kl_clip_scale(
    gradients: Mapping[str, Tensor],
    preconditioned: Mapping[str, Tensor],
    rates: Mapping[str, float],
    kl_clip: float | None,
) -> float | None:
    """``ν`` of the module docstring; None when the sum is not finite.

    Args:
        gradients: Plain gradient matrix per block.
        preconditioned: Preconditioned gradient matrix per block (same keys or fewer).
        rates: Learning rate per block.
        kl_clip: κ, or None (ν = 1).
    """
    if kl_clip is None or not preconditioned:
        return 1.0
    return clip_from_sum(clip_terms(gradients, preconditioned, rates), kl_clip)


def apply_preconditioned(
    blocks: Sequence[CurvatureBlock],
    gradients: Mapping[str, Tensor],
    rates: Mapping[str, float],
    kl_clip: float | None,
    profiler: Profiler,
) -> bool:
    """Precondition every block's gradient, scale all by the KL clip and write them back.

    Returns:
        False (nothing written) when the clip's sum is not finite.
    """
    preconditioned = {}
    for block in blocks:
        if block.name in gradients:
            with profiler.span(span_name(Phase.PRECONDITION, block.name)):
                preconditioned[block.name] = block.precondition(gradients[block.name])
    with profiler.span(span_name(Phase.PRECONDITION, "kl_clip")):
        scale = kl_clip_scale(gradients, preconditioned, rates, kl_clip)
        if scale is None:
            return False
        for block in blocks:
            if block.name in preconditioned:
                matrix = preconditioned[block.name]
                block.set_gradient(matrix.mul_(scale) if scale != 1.0 else matrix)
    return True


class ReplicatedUpdate:
    """The last stage when every rank holds every averaged gradient (DDP, or gradients
    all-reduced by the caller): every rank preconditions every block.

    Args:
        blocks: The curvature blocks.
        communicator: The group (for the skip agreement of non-factor steps).
        profiler: Where spans are recorded.
    """

    def __init__(
        self, blocks: Sequence[CurvatureBlock], communicator: Communicator, profiler: Profiler
    ) -> None:
        self._blocks = blocks
        self._communicator = communicator
        self._profiler = profiler

    def held(self) -> list[CurvatureBlock]:
        """The blocks whose factors this rank keeps: all of them."""
        return list(self._blocks)

    def collect(self) -> tuple[dict[str, Tensor], bool]:
        """The blocks' gradients and whether they are all finite (this rank's view)."""
        gradients = block_gradients(self._blocks)
        return gradients, all_finite(list(gradients.values()))

    def agree(self, usable: bool) -> bool:
        """Skip on every rank or on none: gradients need not be replicated (no DDP)."""
        if self._communicator.world_size == 1:
            return usable
        with self._profiler.span(span_name(Phase.FLAG_COMM, "skip")):
            flag = torch.tensor([0.0 if usable else 1.0], device=self._communicator.device)
            return float(self._communicator.all_reduce_max(flag).wait()) == 0.0

    def apply(
        self,
        gradients: Mapping[str, Tensor],
        rates: Mapping[str, float],
        kl_clip: float | None,
        usable: bool,
    ) -> bool:
        """Precondition, clip and write back; False (nothing written) to skip the step."""
        return usable and apply_preconditioned(
            self._blocks, gradients, rates, kl_clip, self._profiler
        )


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


def warn_uncaptured(blocks: Sequence[CurvatureBlock]) -> None:
    """Name the registered blocks whose factors are still empty after a factor step."""
    empty = [
        block.name
        for block in blocks
        if all(
            value is None for key, value in block.stored().items() if not key.endswith("inverse")
        )
    ]
    if empty:
        warnings.warn(
            f"spdkfac: no factors were captured for {empty} on the first factor step: "
            "they keep their plain gradient until a training-mode forward and backward "
            "pass reaches them through their forward()",
            RuntimeWarning,
            stacklevel=5,
        )


def _signature(tensor: Tensor | None) -> tuple[int, int] | None:
    return None if tensor is None else (id(tensor), tensor._version)


class GradientGuard:
    """Tells whether the gradients changed since the last preconditioning.

    A backward pass accumulates into ``.grad`` in place (its version counter moves) or
    creates it (after ``zero_grad(set_to_none=True)``); :meth:`record` notes every
    registered weight's gradient tensor and version after the step wrote it back, and
    :meth:`unchanged` is True when none of them moved since — a second ``step()`` without a
    new backward, which would precondition the preconditioned gradient again.
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self._weights = [m.weight for m in modules if isinstance(m.weight, Tensor)]
        self._recorded: list[tuple[int, int] | None] | None = None

    def record(self) -> None:
        """Note the gradients as the step left them."""
        self._recorded = [_signature(w.grad) for w in self._weights]

    def unchanged(self) -> bool:
        """Whether no gradient changed since :meth:`record` (False before the first)."""
        if self._recorded is None:
            return False
        current = [_signature(w.grad) for w in self._weights]
        return current == self._recorded and any(s is not None for s in current)
