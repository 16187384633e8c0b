"""The ``CurvatureBlock`` protocol: what K-FAC needs from one registered parameter group.

A block is one layer's curvature: the statistics it contributes to the factor exchange
(:class:`Slot`), their running averages, the factors it hands to the placement for
inversion, its preconditioning and its state. The preconditioner, the factor collector,
the inverse phase and the agreement check see every block only through this protocol, so
a new layer type is a new block class plus a discovery rule, never a branch elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from spdkfac.placement import FactorSpec

__all__ = [
    "Contribution",
    "CurvatureBlock",
    "FactorPairState",
    "LocalInverses",
    "ModuleBlock",
    "Slot",
]

#: One call's statistic for one slot and the number of examples it averages.
Contribution = tuple[Tensor, int]


@dataclass(frozen=True)
class Slot:
    """One statistic a block contributes to the factor exchange on factor steps.

    Attributes:
        key: ``"<layer>/<kind>"``, unique within a model (e.g. ``"fc1/A"``).
        shape: Shape of the statistic.
        symmetric: A symmetric ``[d, d]`` matrix that travels as a packed upper triangle
            in the fusion pipeline (its all-reduce may start from the hook); otherwise it
            joins the one all-reduce of small dense statistics issued after the pipeline.
        forward: Produced in the forward pass (else in the backward pass).
    """

    key: str
    shape: tuple[int, ...]
    symmetric: bool
    forward: bool

    @property
    def numel(self) -> int:
        """Elements of the statistic."""
        return int(torch.Size(self.shape).numel())


class CurvatureBlock(Protocol):
    """One registered layer's curvature; see the module docstring.

    Attributes:
        name: The module's name in the model.
        module: The module.
        section: The state-dict section holding its state (``"layers"`` or
            ``"batchnorm"``).
    """

    name: str
    module: nn.Module
    section: str

    @property
    def device(self) -> torch.device:
        """Where its state lives (the parameters' device)."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """Dtype statistics are kept in (at least float32)."""
        ...

    def slots(self) -> tuple[Slot, ...]:
        """What it contributes to the exchange, at most one forward and one backward slot."""
        ...

    def describe(self) -> str:
        """A text equal on two ranks iff they registered the same block."""
        ...

    def capture_input(self, inputs: Tensor) -> dict[str, Contribution]:
        """Forward-time contributions of one captured call (before the layer runs)."""
        ...

    def capture_grad(self, inputs: Tensor, grad_output: Tensor) -> dict[str, Contribution]:
        """Backward-time contributions of one captured call (its input and output gradient)."""
        ...

    def absorb(self, new: Mapping[str, Tensor | None], decay: float) -> None:
        """Fold a factor step's global statistics (by slot key) into the running averages."""
        ...

    def inverse_specs(self) -> tuple[FactorSpec, ...]:
        """Factors the placement decides where to invert (none for closed-form blocks)."""
        ...

    def placed_factors(self) -> dict[str, Tensor]:
        """The running factors of :meth:`inverse_specs` that exist, by key."""
        ...

    def previous_inverses(self) -> dict[str, Tensor | None]:
        """The current inverses of :meth:`inverse_specs`, by key (kept on failures)."""
        ...

    def update_inverses(self, inverses: Mapping[str, Tensor], damping: float) -> None:
        """Take the placed inverses (by key) and compute any local ones with ``damping``."""
        ...

    def gradient(self) -> Tensor | None:
        """The gradient as the matrix :meth:`precondition` takes, or None without one."""
        ...

    def precondition(self, gradient: Tensor) -> Tensor:
        """The preconditioned gradient (the plain one while there is no inverse)."""
        ...

    def set_gradient(self, matrix: Tensor) -> None:
        """Write a preconditioned matrix back into the parameters' ``.grad``."""
        ...

    def factors(self) -> tuple[Tensor | None, ...]:
        """The running statistics (None before the first update), for introspection."""
        ...

    def inverses(self) -> tuple[Tensor | None, ...]:
        """Their damped inverses (None before the first), for introspection."""
        ...

    def state(self) -> dict[str, Tensor | None]:
        """The tensors to save (not copied)."""
        ...

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected shape of each :meth:`state` entry."""
        ...

    def restore(self, entry: Mapping[str, Tensor | None]) -> None:
        """Set the state from validated tensors."""
        ...


class ModuleBlock:
    """Base of the blocks of one module with a ``weight``: where, and in which dtype, the
    block's state lives."""

    module: nn.Module

    @property
    def _weight(self) -> Tensor:
        weight = self.module.weight
        assert isinstance(weight, Tensor)
        return weight

    @property
    def device(self) -> torch.device:
        """The parameters' device."""
        return self._weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Statistics are kept in at least float32 whatever the parameter dtype."""
        return torch.float64 if self._weight.dtype == torch.float64 else torch.float32


class LocalInverses:
    """Base of blocks every rank inverts itself: nothing for the placement to place."""

    def inverse_specs(self) -> tuple[FactorSpec, ...]:
        return ()

    def placed_factors(self) -> dict[str, Tensor]:
        return {}

    def previous_inverses(self) -> dict[str, Tensor | None]:
        return {}


class FactorPairState:
    """State of a block holding an A and a G factor and their inverses."""

    a_factor: Tensor | None
    g_factor: Tensor | None
    a_inverse: Tensor | None
    g_inverse: Tensor | None

    def factors(self) -> tuple[Tensor | None, Tensor | None]:
        return self.a_factor, self.g_factor

    def inverses(self) -> tuple[Tensor | None, Tensor | None]:
        return self.a_inverse, self.g_inverse

    def state(self) -> dict[str, Tensor | None]:
        return {
            "a_factor": self.a_factor,
            "g_factor": self.g_factor,
            "a_inverse": self.a_inverse,
            "g_inverse": self.g_inverse,
        }

    def restore(self, entry: Mapping[str, Tensor | None]) -> None:
        self.a_factor, self.g_factor = entry["a_factor"], entry["g_factor"]
        self.a_inverse, self.g_inverse = entry["a_inverse"], entry["g_inverse"]
