"""Checks on how the user drives the preconditioner: the guard against preconditioning the
same gradient twice or after ``remove()``, one preconditioner per model, and the warning
about registered layers no pass reached."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import ClassVar

from torch import Tensor, nn

from spdkfac.comm.dtensors import local_part
from spdkfac.curvature import CurvatureBlock

__all__ = ["GradientGuard", "ModelClaim", "warn_uncaptured"]


class ModelClaim:
    """One preconditioner per model: the modules of a model a live preconditioner (one not
    ``remove()``d) hooks are claimed by it, and a second one on any of them is refused —
    it would capture every call twice and precondition the gradient twice.

    Args:
        model: The user's module.
        owner: How to name the preconditioner claiming it in the error.

    Raises:
        ValueError: A module of ``model`` is claimed already (naming its preconditioner).
    """

    _claims: ClassVar[weakref.WeakKeyDictionary[nn.Module, str]] = weakref.WeakKeyDictionary()

    def __init__(self, model: nn.Module, owner: str) -> None:
        for name, module in model.named_modules():
            first = self._claims.get(module)
            if first is not None:
                where = f"module {name!r} of this model" if name else "this model"
                raise ValueError(
                    f"spdkfac: {where} is already preconditioned by {first}: call its "
                    "remove() before building another KFACPreconditioner on it (two would "
                    "precondition every gradient twice)"
                )
        self._modules = weakref.WeakSet(model.modules())
        self.owner = owner

    def take(self) -> None:
        """Claim the modules (once the preconditioner is built)."""
        for module in self._modules:
            self._claims[module] = self.owner

    def release(self) -> None:
        """Give them back (``remove()``): another preconditioner may be built on them."""
        for module in self._modules:
            if self._claims.get(module) == self.owner:
                del self._claims[module]


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
        self.removed = False

    def check(self) -> None:
        """Refuse a step the preconditioner cannot take: after ``remove()``, with
        parameters replaced since it was built (a model ``fully_shard``-ed or wrapped
        afterwards), or the same gradients preconditioned twice.

        Raises:
            ValueError: A registered layer's weight is another tensor than at construction
                (every rank sees the same, before any collective).
            RuntimeError: After ``remove()``, or :meth:`unchanged`.
        """
        if self.removed:
            raise RuntimeError(
                "spdkfac: step() after remove(): the hooks are gone and the inverses are "
                "stale; build a new KFACPreconditioner to precondition again"
            )
        for (name, module), weight in zip(self._modules, self._weights, strict=True):
            if module.weight is not weight:
                raise ValueError(
                    f"model: the weight of layer {name!r} was replaced after "
                    "KFACPreconditioner(model) was built (fully_shard, parallelize_module or "
                    "another wrapper applied afterwards?); shard or wrap the model first "
                    "(supported: plain, DistributedDataParallel, FSDP2 fully_shard / HSDP, "
                    "tensor parallelism alone or under FSDP2), then build the preconditioner"
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
