"""Checks on how the user drives the step: the guard against preconditioning the same
gradient twice, and the warning about registered layers no pass reached."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import Tensor, nn

from spdkfac.comm.dtensors import local_part
from spdkfac.curvature import CurvatureBlock

__all__ = ["GradientGuard", "warn_uncaptured"]


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
    # A DTensor's own version counter stays put when its local shard is written.
    local = local_part(tensor)
    return None if local is None else (id(local), local._version)


class GradientGuard:
    """Tells whether the gradients changed since the last preconditioning.

    A backward pass accumulates into ``.grad`` in place (its version counter moves) or
    creates it (after ``zero_grad(set_to_none=True)``); :meth:`record` notes every
    registered weight's gradient tensor and version after the step wrote it back, and
    :meth:`unchanged` is True when none of them moved since — a second ``step()`` without a
    new backward, which would precondition the preconditioned gradient again.
    """

    def __init__(self, blocks: Sequence[CurvatureBlock]) -> None:
        self._modules: list[tuple[str, nn.Module]] = []
        self._weights: list[Tensor] = []
        for block in blocks:
            if isinstance(weight := block.module.weight, Tensor):
                self._modules.append((block.name, block.module))
                self._weights.append(weight)
        self._recorded: list[tuple[int, int] | None] | None = None

    def check(self) -> None:
        """Refuse a step the preconditioner cannot take: parameters replaced since it was
        built (a model ``fully_shard``-ed or wrapped afterwards), or the same gradients
        preconditioned twice.

        Raises:
            ValueError: A registered layer's weight is another tensor than at construction
                (every rank sees the same, before any collective).
            RuntimeError: :meth:`unchanged`.
        """
        for (name, module), weight in zip(self._modules, self._weights, strict=True):
            if module.weight is not weight:
                raise ValueError(
                    f"model: the weight of layer {name!r} was replaced after "
                    "KFACPreconditioner(model) was built (fully_shard or another wrapper "
                    "applied afterwards?); shard or wrap the model first (supported: plain, "
                    "DistributedDataParallel, FSDP2 fully_shard / HSDP), then build the "
                    "preconditioner"
                )
        if self.unchanged():
            raise RuntimeError(
                "spdkfac: step() called again without a new backward pass: the gradients "
                "are already preconditioned (call step() once per optimizer step)"
            )

    def record(self) -> None:
        """Note the gradients as the step left them."""
        self._recorded = [_signature(w.grad) for w in self._weights]

    def unchanged(self) -> bool:
        """Whether no gradient changed since :meth:`record` (False before the first)."""
        if self._recorded is None:
            return False
        current = [_signature(w.grad) for w in self._weights]
        return current == self._recorded and any(s is not None for s in current)
