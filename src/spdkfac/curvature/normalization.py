"""Normalization blocks: Osawa et al.'s diagonal or unit-wise Fisher of scale and shift.

For BatchNorm, GroupNorm, LayerNorm and RMSNorm (:mod:`spdkfac.layers.normalization`).
The per-unit blocks are tiny (3 numbers per unit),
so they take none of the Kronecker machinery: no fusion bucket, no placement, no
broadcast. Their statistic is a dense slot: on a factor step every rank adds its
example-weighted blocks of all normalization layers into one buffer and issues **one**
extra all-reduce after the Kronecker-factor exchange, in a fixed layer order, so the
collectives never depend on local data. Every rank then holds the global example-weighted
average (the same as one process on the concatenated batch), folds it into the running
average, and inverts every block itself: a closed-form 2×2 inverse per channel costs less
than any message. They are damped with ``ρ·γ`` (``damping_multiplier`` ρ).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor, nn

from spdkfac.curvature.block import (
    NORMALIZATION_SECTION,
    Contribution,
    LocalInverses,
    ModuleBlock,
    Slot,
)
from spdkfac.curvature.state import running_average
from spdkfac.layers import LOCAL_GRADIENTS, GradientAccess
from spdkfac.layers.batchnorm import precondition_units, unit_inverses
from spdkfac.layers.normalization import (
    NormKind,
    has_shift,
    norm_gradient,
    norm_kind,
    unit_fisher,
    write_norm_gradient,
)
from spdkfac.linalg import is_finite
from spdkfac.types import NormalizationMode

__all__ = ["NormalizationBlock"]


class NormalizationBlock(LocalInverses, ModuleBlock):
    """A normalization layer's ``[P, 3]`` Fisher blocks ``(F_γγ, F_γβ, F_ββ)`` and inverses.

    Args:
        name: The module's name.
        module: A supported normalization layer (:func:`~spdkfac.layers.normalization.norm_kind`).
        mode: ``"diagonal"`` or ``"unit-wise"`` (see :mod:`spdkfac.layers.batchnorm`).
        damping_multiplier: ρ > 0: blocks are damped with ρ·γ.
    """

    section = NORMALIZATION_SECTION

    def __init__(
        self,
        name: str,
        module: nn.Module,
        *,
        mode: NormalizationMode,
        damping_multiplier: float = 1.0,
    ) -> None:
        kind = norm_kind(module)
        if kind is None:
            raise ValueError(f"{name!r} ({type(module).__name__}) is not a supported norm layer")
        self.kind: NormKind = kind
        self.name = name
        self.module = module
        self.mode = mode
        # Decided once: a β frozen now stays out of the block (its blocks' shape and the
        # gradient matrix never change with requires_grad later).
        self.shift = has_shift(module)
        self.damping_multiplier = damping_multiplier
        self.fisher: Tensor | None = None
        self.inverse: Tensor | None = None

    @property
    def channels(self) -> int:
        """Number of units P (channels, or elements of ``normalized_shape``)."""
        return self._weight.numel()

    @property
    def _key(self) -> str:
        return f"{self.name}/BN"

    def slots(self) -> tuple[Slot, ...]:
        return (Slot(self._key, (self.channels, 3), symmetric=False, forward=False),)

    def describe(self) -> str:
        return f"{self.name}:{self.kind.name}{self.channels}:{self.mode}"

    # ------------------------------------------------------------------ factor steps
    def capture_input(self, inputs: Tensor) -> dict[str, Contribution]:
        return {}

    def capture_grad(self, inputs: Tensor, grad_output: Tensor) -> dict[str, Contribution]:
        normalized = self.kind.normalize(self.module, inputs.to(self.dtype))
        blocks, examples = unit_fisher(
            normalized,
            grad_output.to(self.dtype),
            units=self.channels,
            channel_first=self.kind.channel_first,
            diagonal=self.mode == "diagonal",
            shift=self.shift,
        )
        return {self._key: (blocks, examples)}

    def absorb(self, new: Mapping[str, Tensor | None], decay: float) -> None:
        blocks = new.get(self._key)
        if blocks is not None:
            self.fisher = running_average(
                self.fisher, blocks.to(device=self.device, dtype=self.dtype), decay
            )

    # ------------------------------------------------------------------ inverses
    def update_inverses(self, inverses: Mapping[str, Tensor], damping: float) -> None:
        """``(F_c + ργI)⁻¹`` of every channel, on every rank; a non-finite one keeps the last."""
        if self.fisher is None:
            return
        inverse = unit_inverses(self.fisher, self.damping_multiplier * damping)
        if is_finite(inverse):
            self.inverse = inverse

    # ------------------------------------------------------------------ preconditioning
    def gradient(self, access: GradientAccess = LOCAL_GRADIENTS) -> Tensor | None:
        return norm_gradient(self.module, access, shift=self.shift)

    def precondition(self, gradient: Tensor) -> Tensor:
        if self.inverse is None:
            return gradient.clone()
        return precondition_units(gradient, self.inverse)

    def set_gradient(self, matrix: Tensor, access: GradientAccess = LOCAL_GRADIENTS) -> None:
        write_norm_gradient(self.module, matrix, access, shift=self.shift)

    # ------------------------------------------------------------------ state
    def factors(self) -> tuple[Tensor | None]:
        return (self.fisher,)

    def inverses(self) -> tuple[Tensor | None]:
        return (self.inverse,)

    def state(self) -> dict[str, Tensor | None]:
        return {"fisher": self.fisher, "inverse": self.inverse}

    def stored(self) -> dict[str, Tensor | None]:
        return self.state()

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"fisher": (self.channels, 3), "inverse": (self.channels, 3)}

    def restore(self, entry: Mapping[str, Tensor | None]) -> None:
        self.fisher, self.inverse = entry["fisher"], entry["inverse"]
