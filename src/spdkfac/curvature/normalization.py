"""Normalization blocks: Osawa et al.'s diagonal or unit-wise Fisher of scale and shift.

The per-channel blocks of :mod:`spdkfac.layers.batchnorm` are tiny (3 numbers per channel),
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

from spdkfac.curvature.block import Contribution, ModuleBlock, Slot
from spdkfac.curvature.state import running_average
from spdkfac.layers.batchnorm import (
    batchnorm_fisher,
    batchnorm_gradient,
    normalized_input,
    precondition_units,
    unit_inverses,
    write_batchnorm_gradient,
)
from spdkfac.linalg import is_finite
from spdkfac.placement import FactorSpec
from spdkfac.types import NormalizationMode

__all__ = ["NormalizationBlock"]


class NormalizationBlock(ModuleBlock):
    """A BatchNorm layer's ``[C, 3]`` Fisher blocks ``(F_γγ, F_γβ, F_ββ)`` and inverses.

    Args:
        name: The module's name.
        module: The BatchNorm layer.
        mode: ``"diagonal"`` or ``"unit-wise"`` (see :mod:`spdkfac.layers.batchnorm`).
        damping_multiplier: ρ > 0: blocks are damped with ρ·γ.
    """

    section = "batchnorm"

    def __init__(
        self,
        name: str,
        module: nn.Module,
        *,
        mode: NormalizationMode,
        damping_multiplier: float = 1.0,
    ) -> None:
        self.name = name
        self.module = module
        self.mode = mode
        self.damping_multiplier = damping_multiplier
        self.fisher: Tensor | None = None
        self.inverse: Tensor | None = None

    @property
    def channels(self) -> int:
        """Number of channels C."""
        return self._weight.shape[0]

    @property
    def _key(self) -> str:
        return f"{self.name}/BN"

    def slots(self) -> tuple[Slot, ...]:
        return (Slot(self._key, (self.channels, 3), symmetric=False, forward=False),)

    def describe(self) -> str:
        return f"{self.name}:bn{self.channels}:{self.mode}"

    # ------------------------------------------------------------------ factor steps
    def capture_input(self, inputs: Tensor) -> dict[str, Contribution]:
        return {}

    def capture_grad(self, inputs: Tensor, grad_output: Tensor) -> dict[str, Contribution]:
        normalized = normalized_input(
            inputs.to(self.dtype), float(getattr(self.module, "eps", 1e-5))
        )
        blocks = batchnorm_fisher(
            normalized, grad_output.to(self.dtype), diagonal=self.mode == "diagonal"
        )
        return {self._key: (blocks, grad_output.shape[0])}

    def absorb(self, new: Mapping[str, Tensor | None], decay: float) -> None:
        blocks = new.get(self._key)
        if blocks is not None:
            self.fisher = running_average(
                self.fisher, blocks.to(device=self.device, dtype=self.dtype), decay
            )

    # ------------------------------------------------------------------ inverses
    def inverse_specs(self) -> tuple[FactorSpec, ...]:
        return ()

    def placed_factors(self) -> dict[str, Tensor]:
        return {}

    def previous_inverses(self) -> dict[str, Tensor | None]:
        return {}

    def update_inverses(self, inverses: Mapping[str, Tensor], damping: float) -> None:
        """``(F_c + ργI)⁻¹`` of every channel, on every rank; a non-finite one keeps the last."""
        if self.fisher is None:
            return
        inverse = unit_inverses(self.fisher, self.damping_multiplier * damping)
        if is_finite(inverse):
            self.inverse = inverse

    # ------------------------------------------------------------------ preconditioning
    def gradient(self) -> Tensor | None:
        return batchnorm_gradient(self.module)

    def precondition(self, gradient: Tensor) -> Tensor:
        if self.inverse is None:
            return gradient.clone()
        return precondition_units(gradient, self.inverse)

    def set_gradient(self, matrix: Tensor) -> None:
        write_batchnorm_gradient(self.module, matrix)

    # ------------------------------------------------------------------ state
    def factors(self) -> tuple[Tensor | None]:
        return (self.fisher,)

    def inverses(self) -> tuple[Tensor | None]:
        return (self.inverse,)

    def state(self) -> dict[str, Tensor | None]:
        return {"fisher": self.fisher, "inverse": self.inverse}

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"fisher": (self.channels, 3), "inverse": (self.channels, 3)}

    def restore(self, entry: Mapping[str, Tensor | None]) -> None:
        self.fisher, self.inverse = entry["fisher"], entry["inverse"]
