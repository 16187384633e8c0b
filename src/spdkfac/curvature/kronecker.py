"""Kronecker-factored blocks: ``F ≈ A ⊗ G`` of a layer with a :class:`KFACLayer` adapter."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import Tensor

from spdkfac.curvature.block import (
    KRONECKER_SECTION,
    Contribution,
    FactorPairState,
    ModuleBlock,
    Slot,
)
from spdkfac.curvature.state import running_average, symmetric_running_average
from spdkfac.layers import LOCAL_GRADIENTS, GradientAccess
from spdkfac.planning.placement import FactorSpec

__all__ = ["DiagonalKroneckerBlock", "KroneckerBlock", "OneSidedBlock"]


def _average(symmetric: bool) -> Callable[[Tensor | None, Tensor, float], Tensor]:
    return symmetric_running_average if symmetric else running_average


class KroneckerBlock(FactorPairState, ModuleBlock):
    """A Linear or Conv2d layer's Kronecker factors A (inputs) and G (output gradients).

    The factor math is the adapter's (pure functions of :mod:`spdkfac.layers`); the block
    keeps the running averages and their inverse-form results, and preconditions with
    them (``V = Ĝ ∇ Â`` for damped inverses; see :mod:`spdkfac.forms`). Both factors
    travel as packed triangles: A from the forward pre-hook, G from the output-gradient
    hook; in a group their running averages stay packed (see
    :class:`~spdkfac.curvature.block.FactorPairState`). Their results are placed by the
    strategy.

    Args:
        name: The module's name.
        module: The module.
        adapter: Its factor math.
        form: The inverse form (default: damped inverses by Cholesky).
        factor_dtype: Storage dtype of the running factors (None: :attr:`dtype`).
    """

    section = KRONECKER_SECTION
    symmetric_factors = (True, True)

    @property
    def a_dim(self) -> int:
        """Side of the A factor."""
        return self.adapter.a_dim(self.module)

    @property
    def g_dim(self) -> int:
        """Side of the G factor."""
        return self.adapter.g_dim(self.module)

    @property
    def _a_key(self) -> str:
        return f"{self.name}/A"

    @property
    def _g_key(self) -> str:
        return f"{self.name}/G"

    def slots(self) -> tuple[Slot, ...]:
        a, g = self.a_dim, self.g_dim
        return (
            Slot(self._a_key, (a, a), symmetric=True, forward=True),
            Slot(self._g_key, (g, g), symmetric=True, forward=False),
        )

    def describe(self) -> str:
        return f"{self.name}:{self.a_dim}x{self.g_dim}"

    # ------------------------------------------------------------------ factor steps
    def capture_input(self, inputs: Tensor) -> dict[str, Contribution]:
        if inputs.is_floating_point():  # (an embedding's input is indices)
            inputs = inputs.to(self.dtype)
        return {self._a_key: self.adapter.a_factor(self.module, inputs)}

    def capture_grad(self, inputs: Tensor, grad_output: Tensor) -> dict[str, Contribution]:
        return {self._g_key: self.adapter.g_factor(self.module, grad_output.to(self.dtype))}

    def absorb(self, new: Mapping[str, Tensor | None], decay: float) -> None:
        a_new, g_new = new.get(self._a_key), new.get(self._g_key)
        # A layer seen in forward but not in backward (or vice versa) keeps both factors
        # as they were, so A and G always describe the same examples.
        if a_new is not None and g_new is not None:
            a_symmetric, g_symmetric = self.symmetric_factors
            self.a_factor = _average(a_symmetric)(self.a_factor, self._kept(a_new), decay)
            self.g_factor = _average(g_symmetric)(self.g_factor, self._kept(g_new), decay)

    # ------------------------------------------------------------------ inverses
    def inverse_specs(self) -> tuple[FactorSpec, ...]:
        return (
            FactorSpec.for_form(self.name, "A", self.a_dim, self.form),
            FactorSpec.for_form(self.name, "G", self.g_dim, self.form),
        )

    def placed_factors(self) -> dict[str, Tensor]:
        if self.a_factor is None or self.g_factor is None:
            return {}
        return {self._a_key: self.a_factor, self._g_key: self.g_factor}

    def previous_inverses(self) -> dict[str, Tensor | None]:
        return {self._a_key: self.a_inverse, self._g_key: self.g_inverse}

    def update_inverses(self, inverses: Mapping[str, Tensor], damping: float) -> None:
        if self.a_factor is None or self.g_factor is None:
            return
        # A factor that failed with no previous inverse leaves the layer on its plain
        # gradient until an inversion succeeds.
        self.a_inverse = inverses.get(self._a_key)
        self.g_inverse = inverses.get(self._g_key)
        self.damping = damping

    # ------------------------------------------------------------------ preconditioning
    def gradient(self, access: GradientAccess = LOCAL_GRADIENTS) -> Tensor | None:
        return self.adapter.gradient(self.module, access)

    def precondition(self, gradient: Tensor) -> Tensor:
        if self.a_inverse is None or self.g_inverse is None:
            return gradient
        return self.form.kronecker(
            gradient, self.a_inverse, self.g_inverse, self.damping, self.moments
        )

    def set_gradient(self, matrix: Tensor, access: GradientAccess = LOCAL_GRADIENTS) -> None:
        self.adapter.set_gradient(self.module, matrix, access)

    # ------------------------------------------------------------------ state
    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        a, g = self.a_dim, self.g_dim
        return {
            "a_factor": (a, a),
            "g_factor": (g, g),
            "a_inverse": self.form.shape(a),
            "g_inverse": self.form.shape(g),
            **self.form.moment_shapes((g, a)),
        }


class DiagonalKroneckerBlock(KroneckerBlock):
    """A Kronecker block whose A factor is diagonal (``nn.Embedding``: one-hot inputs).

    A is a ``[V]`` vector: it joins the one all-reduce of dense statistics and every rank
    inverts it in closed form, ``1/(a + γ)`` (no placement, no broadcast); G is placed by
    the strategy like any Kronecker factor. Preconditioning is ``Ĝ ∇ diag(â)``.
    """

    symmetric_factors = (False, True)

    def slots(self) -> tuple[Slot, ...]:
        a, g = self.a_dim, self.g_dim
        return (
            Slot(self._a_key, (a,), symmetric=False, forward=True),
            Slot(self._g_key, (g, g), symmetric=True, forward=False),
        )

    def describe(self) -> str:
        return f"{self.name}:diag{self.a_dim}x{self.g_dim}"

    def absorb(self, new: Mapping[str, Tensor | None], decay: float) -> None:
        a_new = new.get(self._a_key)
        if a_new is not None:
            new = {**new, self._a_key: a_new.to(device=self.device, dtype=self.dtype)}
        super().absorb(new, decay)

    def inverse_specs(self) -> tuple[FactorSpec, ...]:
        return (FactorSpec.for_form(self.name, "G", self.g_dim, self.form),)

    def placed_factors(self) -> dict[str, Tensor]:
        if self.a_factor is None or self.g_factor is None:
            return {}
        return {self._g_key: self.g_factor}

    def previous_inverses(self) -> dict[str, Tensor | None]:
        return {self._g_key: self.g_inverse}

    def update_inverses(self, inverses: Mapping[str, Tensor], damping: float) -> None:
        if self.a_factor is None or self.g_factor is None:
            return
        self.g_inverse = inverses.get(self._g_key)
        self.a_inverse = self.form.diagonal(self.a_factor, damping)
        self.damping = damping

    def precondition(self, gradient: Tensor) -> Tensor:
        if self.a_inverse is None or self.g_inverse is None:
            return gradient
        return self.form.kronecker_diagonal(
            gradient, self.a_inverse, self.g_inverse, self.damping, self.moments
        )

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        a, g = self.a_dim, self.g_dim
        return {
            "a_factor": (a,),
            "g_factor": (g, g),
            "a_inverse": (a,),
            "g_inverse": self.form.shape(g),
            **self.form.moment_shapes((g, a)),
        }


class OneSidedBlock(KroneckerBlock):
    """A Kronecker block preconditioned by A's result alone (the ``"one-sided"`` form,
    :class:`~spdkfac.forms.OneSided`): ``V = ∇ Â``. G is neither captured, exchanged nor
    inverted; its entries stay None in the state."""

    def slots(self) -> tuple[Slot, ...]:
        a = self.a_dim
        return (Slot(self._a_key, (a, a), symmetric=True, forward=True),)

    def describe(self) -> str:
        return f"{self.name}:{self.a_dim}x{self.g_dim}:A-only"

    def capture_grad(self, inputs: Tensor, grad_output: Tensor) -> dict[str, Contribution]:
        return {}

    def absorb(self, new: Mapping[str, Tensor | None], decay: float) -> None:
        a_new = new.get(self._a_key)
        if a_new is not None:
            self.a_factor = symmetric_running_average(self.a_factor, self._kept(a_new), decay)

    def inverse_specs(self) -> tuple[FactorSpec, ...]:
        return (FactorSpec.for_form(self.name, "A", self.a_dim, self.form),)

    def placed_factors(self) -> dict[str, Tensor]:
        return {} if self.a_factor is None else {self._a_key: self.a_factor}

    def previous_inverses(self) -> dict[str, Tensor | None]:
        return {self._a_key: self.a_inverse}

    def update_inverses(self, inverses: Mapping[str, Tensor], damping: float) -> None:
        if self.a_factor is not None:
            self.a_inverse = inverses.get(self._a_key)
            self.damping = damping

    def precondition(self, gradient: Tensor) -> Tensor:
        if self.a_inverse is None:
            return gradient
        return self.form.kronecker(gradient, self.a_inverse, None, self.damping, self.moments)
