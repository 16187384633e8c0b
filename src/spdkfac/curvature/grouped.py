"""Grouped and depthwise convolutions: one Kronecker block per group (block-diagonal).

A convolution with ``groups = k`` is ``k`` independent convolutions, each from its own
``C/k`` input channels to its own ``O/k`` output channels. Its curvature here is exactly
what splitting it into those ``k`` layers would get: per group ``g`` an A factor over the
group's input patches (with the bias column of its own outputs) and a G factor over its
output channels, computed by the ``groups = 1`` adapter's math (fast kernels included).

Per-group factors are small (a depthwise 3×3 layer has 10×10 and 1×1 ones), and there
are many, so they are stacked as ``[k, a, a]`` and ``[k, o, o]`` dense statistics: they join
the one all-reduce of dense statistics after the factor exchange, and every rank inverts
them itself (like normalization blocks) — no placement, no broadcast.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn

from spdkfac.curvature.block import (
    KRONECKER_SECTION,
    Contribution,
    FactorPairState,
    LocalInverses,
    ModuleBlock,
    Slot,
)
from spdkfac.curvature.state import running_average
from spdkfac.layers import LOCAL_GRADIENTS, GradientAccess
from spdkfac.linalg import InversionError

__all__ = ["GroupedConvBlock"]


class GroupedConvBlock(LocalInverses, FactorPairState, ModuleBlock):
    """A ``groups > 1`` Conv1d/Conv2d layer's per-group factors (see the module docstring).

    Args:
        name: The module's name.
        module: The convolution.
        adapter: The ``groups = 1`` adapter of its type (its factor math per group).
        form: What every rank computes from the per-group factors (default: damped
            inverses by Cholesky).
        factor_dtype: Storage dtype of the running factors (None: :attr:`dtype`).
    """

    section = KRONECKER_SECTION

    @property
    def groups(self) -> int:
        """The convolution's ``groups``."""
        return int(getattr(self.module, "groups", 1))

    @property
    def a_dim(self) -> int:
        """Side of one group's A factor."""
        return self.adapter.a_dim(self.module)

    @property
    def g_dim(self) -> int:
        """Side of one group's G factor (output channels per group)."""
        return self.adapter.g_dim(self.module) // self.groups

    def _shapes(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        return (self.groups, self.a_dim, self.a_dim), (self.groups, self.g_dim, self.g_dim)

    def slots(self) -> tuple[Slot, ...]:
        a, g = self._shapes()
        return (
            Slot(f"{self.name}/A", a, symmetric=False, forward=True),
            Slot(f"{self.name}/G", g, symmetric=False, forward=False),
        )

    def describe(self) -> str:
        return f"{self.name}:{self.groups}x({self.a_dim}x{self.g_dim})"

    # ------------------------------------------------------------------ factor steps
    def _per_group(
        self, factor: Callable[[nn.Module, Tensor], Contribution], tensor: Tensor
    ) -> Contribution:
        """One group's factor per channel chunk, stacked, and their (common) weight."""
        parts = [factor(self.module, part) for part in tensor.to(self.dtype).chunk(self.groups, 1)]
        return torch.stack([f for f, _ in parts]), parts[0][1]

    def capture_input(self, inputs: Tensor) -> dict[str, Contribution]:
        return {f"{self.name}/A": self._per_group(self.adapter.a_factor, inputs)}

    def capture_grad(self, inputs: Tensor, grad_output: Tensor) -> dict[str, Contribution]:
        return {f"{self.name}/G": self._per_group(self.adapter.g_factor, grad_output)}

    def absorb(self, new: Mapping[str, Tensor | None], decay: float) -> None:
        a_new, g_new = new.get(f"{self.name}/A"), new.get(f"{self.name}/G")
        if a_new is not None and g_new is not None:
            a_new = a_new.to(device=self.device, dtype=self.dtype).reshape(self._shapes()[0])
            g_new = g_new.to(device=self.device, dtype=self.dtype).reshape(self._shapes()[1])
            self.a_factor = running_average(self.a_factor, self._kept(a_new), decay)
            self.g_factor = running_average(self.g_factor, self._kept(g_new), decay)

    # ------------------------------------------------------------------ inverses
    def update_inverses(self, inverses: Mapping[str, Tensor], damping: float) -> None:
        """Every group's results, on every rank; when one fails all keep the last."""
        if self.a_factor is None or self.g_factor is None:
            return
        try:  # batched calls per factor kind: a depthwise layer has many groups
            a_inverse = self.form.compute_all(self.a_factor, damping)
            g_inverse = self.form.compute_all(self.g_factor, damping)
        except (InversionError, ValueError):
            return
        self.a_inverse, self.g_inverse, self.damping = a_inverse, g_inverse, damping

    # ------------------------------------------------------------------ preconditioning
    def gradient(self, access: GradientAccess = LOCAL_GRADIENTS) -> Tensor | None:
        return self.adapter.gradient(self.module, access)

    def precondition(self, gradient: Tensor) -> Tensor:
        if self.a_inverse is None or self.g_inverse is None:
            return gradient
        per_group = gradient.reshape(self.groups, self.g_dim, self.a_dim)
        result = self.form.kronecker(
            per_group, self.a_inverse, self.g_inverse, self.damping, self.moments
        )
        return result.reshape(gradient.shape)

    def set_gradient(self, matrix: Tensor, access: GradientAccess = LOCAL_GRADIENTS) -> None:
        self.adapter.set_gradient(self.module, matrix, access)

    # ------------------------------------------------------------------ state
    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        a, g = self._shapes()
        return {
            "a_factor": a,
            "g_factor": g,
            "a_inverse": (self.groups, *self.form.shape(self.a_dim)),
            "g_inverse": (self.groups, *self.form.shape(self.g_dim)),
            **self.form.moment_shapes((self.groups, self.g_dim, self.a_dim)),
        }
