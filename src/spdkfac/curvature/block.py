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
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from spdkfac.forms import DampedInverse, InverseForm, Moments
from spdkfac.layers import LOCAL_GRADIENTS, GradientAccess, KFACLayer
from spdkfac.linalg import packed_dim, unpack_triu
from spdkfac.planning.placement import FactorSpec

__all__ = [
    "KRONECKER_SECTION",
    "NORMALIZATION_SECTION",
    "STATE_SECTIONS",
    "Contribution",
    "CurvatureBlock",
    "FactorPairState",
    "LocalInverses",
    "ModuleBlock",
    "Slot",
    "StateSection",
    "full_factor",
]

#: One call's statistic for one slot and the number of examples it averages.
Contribution = tuple[Tensor, int]


@dataclass(frozen=True)
class StateSection:
    """Where a block family's state sits in a preconditioner's state dict (the layout
    predates the block families and is kept, so old checkpoints load).

    Attributes:
        key: The state dict's key.
        label: Prefix of its error messages (``"BatchNorm "``).
        primary: Present in every state dict as ``{name: entry}`` (the Kronecker layers,
            which every preconditioner has); another section is present only when blocks
            of its family exist, as ``{"mode": mode, "layers": {name: entry}}``.
    """

    key: str
    label: str = ""
    primary: bool = False

    def pack(self, entries: dict[str, Any], mode: str | None) -> Any:
        """The section's value in a state dict."""
        return entries if self.primary else {"mode": mode, "layers": entries}

    def entries(self, saved: Any) -> Mapping[str, Any]:
        """The ``{name: entry}`` of a saved section's value."""
        entries: Mapping[str, Any] = saved if self.primary else saved.get("layers", {})
        return entries

    def replaced(self, saved: Any, entries: dict[str, Any]) -> Any:
        """A saved section's value with its entries replaced (its mode kept)."""
        return entries if self.primary else {**saved, "layers": entries}

    def check(self, saved: Any, mode: str | None, count: int) -> None:
        """Raise unless a saved section (None: absent) fits ``count`` blocks of this
        section in ``mode``.

        Raises:
            ValueError: The section is saved without blocks here, or missing with blocks
                here, or saved in another mode.
        """
        if self.primary:
            return
        kind = f"{self.label}curvature"
        if (saved is None) != (count == 0):
            raise ValueError(
                f"state_dict and preconditioner disagree on {kind}: saved "
                f"{'none' if saved is None else saved.get('mode')!r}, "
                f"{self.key}={mode!r} with {count} {self.label}layers"
            )
        if saved is not None and saved.get("mode") != mode:
            raise ValueError(f"state_dict {kind} mode {saved.get('mode')!r} is not {mode!r}")


#: Linear, convolution and embedding blocks (Kronecker factors).
KRONECKER_SECTION = StateSection("layers", primary=True)
#: Normalization blocks (the name predates the other normalization layers).
NORMALIZATION_SECTION = StateSection("batchnorm", "BatchNorm ")
#: Every section a block family declares, in state-dict order (a new family adds its own).
STATE_SECTIONS: tuple[StateSection, ...] = (KRONECKER_SECTION, NORMALIZATION_SECTION)


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
        section: The state-dict section holding its state.
    """

    name: str
    module: nn.Module
    section: StateSection

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
        """The running factors of :meth:`inverse_specs` that exist, by key, as they are
        kept: packed upper triangles (from a group's exchange) or full matrices; the
        inverse phase unpacks only those it inverts."""
        ...

    def previous_inverses(self) -> dict[str, Tensor | None]:
        """The current inverses of :meth:`inverse_specs`, by key (kept on failures)."""
        ...

    def update_inverses(self, inverses: Mapping[str, Tensor], damping: float) -> None:
        """Take the placed inverses (by key) and compute any local ones with ``damping``."""
        ...

    def gradient(self, access: GradientAccess = LOCAL_GRADIENTS) -> Tensor | None:
        """The gradient as the matrix :meth:`precondition` takes, or None without one
        (read through ``access``: the parameter layout's)."""
        ...

    def precondition(self, gradient: Tensor) -> Tensor:
        """The preconditioned gradient (the plain one while there is no inverse)."""
        ...

    def set_gradient(self, matrix: Tensor, access: GradientAccess = LOCAL_GRADIENTS) -> None:
        """Write a preconditioned matrix back as the parameters' gradients (through
        ``access``)."""
        ...

    def factors(self) -> tuple[Tensor | None, ...]:
        """The running statistics in full (None before the first update), for
        introspection: packed ones are unpacked into new tensors."""
        ...

    def inverses(self) -> tuple[Tensor | None, ...]:
        """Their damped inverses (None before the first), for introspection."""
        ...

    def state(self) -> dict[str, Tensor | None]:
        """The tensors to save, in full (packed factors unpacked; others not copied)."""
        ...

    def stored(self) -> dict[str, Tensor | None]:
        """The same entries as they are held now (packed factors packed): what is live."""
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
    """State of a block holding an A and a G factor and their inverses.

    A symmetric factor (:attr:`symmetric_factors`) is kept in the form its statistics
    arrive in from the exchange: a packed upper triangle (``[d(d+1)/2]``) in a group, the
    full ``[d, d]`` matrix in a group of one. :meth:`factors` and :meth:`state` give full
    matrices either way (so a state dict is the same whatever the world size), and
    :meth:`restore` keeps them full until the next update converts them once.
    """

    name: str
    module: nn.Module
    adapter: KFACLayer
    a_factor: Tensor | None
    g_factor: Tensor | None
    a_inverse: Tensor | None
    g_inverse: Tensor | None
    #: Whether A and G are symmetric matrices that may be kept packed.
    symmetric_factors: tuple[bool, bool] = (False, False)
    #: What the inverse phase computes from A and G, and how they precondition.
    form: InverseForm = DampedInverse("cholesky")
    #: Storage dtype of the running factors (None: the statistics dtype).
    factor_dtype: torch.dtype | None = None
    #: The damping of the last inverse update (the eigen-basis form applies it at use).
    damping: float = 0.0
    #: The form's running state (:attr:`~spdkfac.forms.InverseForm.moments`; empty for a
    #: stateless form), kept by whoever preconditions the block.
    moments: Moments

    def __init__(
        self,
        name: str,
        module: nn.Module,
        adapter: KFACLayer,
        *,
        form: InverseForm | None = None,
        factor_dtype: torch.dtype | None = None,
    ) -> None:
        self.name = name
        self.module = module
        self.adapter = adapter
        if form is not None:
            self.form = form
        self.factor_dtype = factor_dtype
        self.a_factor = self.g_factor = self.a_inverse = self.g_inverse = None
        self.moments = dict.fromkeys(self.form.moments)

    def _kept(self, new: Tensor) -> Tensor:
        """A factor step's statistic in the running factors' storage dtype."""
        dtype = self.factor_dtype
        return new if dtype is None or new.dtype == dtype else new.to(dtype)

    def factors(self) -> tuple[Tensor | None, Tensor | None]:
        a_symmetric, g_symmetric = self.symmetric_factors
        return full_factor(self.a_factor, a_symmetric), full_factor(self.g_factor, g_symmetric)

    def inverses(self) -> tuple[Tensor | None, Tensor | None]:
        return self.a_inverse, self.g_inverse

    def state(self) -> dict[str, Tensor | None]:
        a_factor, g_factor = self.factors()
        return {
            "a_factor": a_factor,
            "g_factor": g_factor,
            "a_inverse": self.a_inverse,
            "g_inverse": self.g_inverse,
            **self.form.saved_moments(self.moments, self.state_shapes(), self._like),
        }

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Expected shape of each :meth:`state` entry (the block's)."""
        raise NotImplementedError

    @property
    def _like(self) -> Tensor:
        """The weight (device and dtype of a saved fresh state)."""
        weight = self.module.weight
        assert isinstance(weight, Tensor)
        return weight

    def stored(self) -> dict[str, Tensor | None]:
        return {
            "a_factor": self.a_factor,
            "g_factor": self.g_factor,
            "a_inverse": self.a_inverse,
            "g_inverse": self.g_inverse,
            **self.moments,
        }

    def restore(self, entry: Mapping[str, Tensor | None]) -> None:
        factors, inverses = self.factor_dtype, self.form.dtype
        self.a_factor = _in_dtype(entry["a_factor"], factors)
        self.g_factor = _in_dtype(entry["g_factor"], factors)
        self.a_inverse = _in_dtype(entry["a_inverse"], inverses)
        self.g_inverse = _in_dtype(entry["g_inverse"], inverses)
        self.moments = self.form.restored_moments(entry)


def _in_dtype(value: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    """A restored tensor in its storage dtype (None: as it is; no copy when it already is)."""
    return value if value is None or dtype is None else value.to(dtype)


def full_factor(factor: Tensor | None, symmetric: bool = True) -> Tensor | None:
    """A running factor as a full matrix: a packed symmetric one unpacked (a new tensor),
    anything else as it is."""
    if factor is None or not symmetric or factor.dim() != 1:
        return factor
    return unpack_triu(factor, packed_dim(factor.numel()))
