"""The :class:`InverseForm` interface every form implements (see :mod:`spdkfac.forms`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

import torch
from torch import Tensor

from spdkfac.linalg import batch_capacity, inverse_dtype

__all__ = ["COMPUTE_SCALES", "FORM_METHODS", "FormMethod", "InverseForm", "Moments", "working"]

#: Values of the ``inverse_method`` option.
FormMethod = Literal["cholesky", "eigen", "eigen-basis", "eigen-adam", "one-sided"]
FORM_METHODS: tuple[str, ...] = ("cholesky", "eigen", "eigen-basis", "eigen-adam", "one-sided")
#: A block's running state for a stateful form (e.g. Adam's moments), by name; updated in
#: place by :meth:`InverseForm.kronecker`.
Moments = dict[str, Tensor | None]
#: Compute time of one result of each form relative to a damped inverse by Cholesky (the
#: cost model's inverse-time fit); measured, see the module docstring.
COMPUTE_SCALES: Mapping[str, float] = MappingProxyType(
    {"cholesky": 1.0, "eigen": 5.0, "eigen-basis": 4.5, "eigen-adam": 4.5, "one-sided": 1.0}
)


class InverseForm(ABC):
    """One inverse form; see the module docstring.

    Args:
        dtype: Storage dtype of the results; None keeps the decomposition's
            (:func:`~spdkfac.linalg.inverse_dtype` of the factor).
    """

    method: str
    #: ``"inverse"``, ``"eigen-basis"`` or ``"one-sided"``: results of two forms of one
    #: kind are interchangeable (saved with a state dict; others are recomputed on loading).
    kind: str
    #: The running state a block keeps for this form (none: the form is stateless), in
    #: groups that start together, each ending with its step count: the other entries
    #: are shaped as the gradient matrix (see :meth:`moment_shapes`).
    moment_groups: tuple[tuple[str, ...], ...] = ()
    #: Whether G's result takes part (False: only A's; G is neither captured nor inverted).
    uses_g: bool = True

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype

    @property
    def compute_scale(self) -> float:
        """Compute time of one result relative to the cost model's inverse-time fit (a
        damped inverse by Cholesky): :data:`COMPUTE_SCALES` of :attr:`method`."""
        return COMPUTE_SCALES[self.method]

    @property
    def moments(self) -> tuple[str, ...]:
        """Names of the running state's entries (:attr:`moment_groups`, in order)."""
        return tuple(name for group in self.moment_groups for name in group)

    def moment_shapes(self, matrix: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Shape of each running-state entry for a gradient matrix of shape ``matrix``
        (a step count: a scalar)."""
        return {
            name: () if name == group[-1] else matrix
            for group in self.moment_groups
            for name in group
        }

    def saved_moments(
        self, moments: Moments, shapes: Mapping[str, tuple[int, ...]], like: Tensor
    ) -> Moments:
        """The running state as a state dict holds it: a group not started yet (None) as
        zeros with step count 0, shaped by ``shapes``, on ``like``'s device and at least
        float32, so that a rank that never preconditioned the block saves the same keys
        and shapes as one that did (:meth:`restored_moments` reads them back as fresh)."""
        saved = dict(moments)
        dtype = torch.promote_types(like.dtype, torch.float32)
        for group in self.moment_groups:
            if moments.get(group[-1]) is None:
                for name in group:
                    saved[name] = torch.zeros(shapes[name], dtype=dtype, device=like.device)
        return saved

    def restored_moments(self, entry: Mapping[str, Tensor | None]) -> Moments:
        """The running state from a state dict's entry: a group whose step count is
        missing or 0 is fresh (None), so that the form starts it in its own dtype at the
        next step, as it would have."""
        restored: Moments = {}
        for group in self.moment_groups:
            count = entry.get(group[-1])
            fresh = count is None or not bool(count)
            restored.update({name: None if fresh else entry.get(name) for name in group})
        return restored

    def stored(self, result: Tensor) -> Tensor:
        """``result`` in the storage dtype."""
        return result if self.dtype is None else result.to(self.dtype)

    def compute_all(self, factors: Tensor, damping: float) -> Tensor:
        """Every matrix of a ``[k, d, d]`` stack, stacked and stored: batched first
        attempts (at most :func:`~spdkfac.linalg.batch_capacity` per call), then
        :meth:`compute` alone for each that failed. ``factors`` is not modified.

        Raises:
            ValueError, InversionError: As :meth:`compute`, for the first matrix that no
                fallback handles.
        """
        dtype = inverse_dtype(factors.dtype)
        first: list[Tensor | None] = []
        for chunk in factors.split(batch_capacity(factors.shape[-1], dtype)):
            first.extend(self.compute_batch(chunk.to(dtype, copy=True), damping))
        return torch.stack(
            [
                self.stored(result if result is not None else self.compute(factor, damping))
                for factor, result in zip(factors, first, strict=True)
            ]
        )

    # ------------------------------------------------------------------ computing
    @abstractmethod
    def compute_batch(self, stack: Tensor, damping: float) -> list[Tensor | None]:
        """First attempt on every ``[d, d]`` matrix of a stack in its
        :func:`~spdkfac.linalg.inverse_dtype` (used as workspace); None where it failed."""

    @abstractmethod
    def compute(self, factor: Tensor, damping: float) -> Tensor:
        """One full factor with every fallback (warnings on fallbacks).

        Raises:
            ValueError: A non-finite factor or a bad damping.
            InversionError: Every fallback failed.
        """

    @abstractmethod
    def diagonal(self, factor: Tensor, damping: float) -> Tensor:
        """The result for a diagonal factor kept as a ``[d]`` vector (an embedding's A)."""

    # ------------------------------------------------------------------ wire format
    @abstractmethod
    def shape(self, dim: int) -> tuple[int, ...]:
        """Shape of one result of a ``[dim, dim]`` factor."""

    @abstractmethod
    def wire_size(self, dim: int) -> int:
        """Elements a result of a ``[dim, dim]`` factor occupies in a broadcast."""

    @abstractmethod
    def pack(self, result: Tensor) -> Tensor:
        """A result as the 1-D tensor that travels."""

    @abstractmethod
    def unpack(self, buffer: Tensor, dim: int) -> Tensor:
        """The inverse of :meth:`pack`."""

    # ------------------------------------------------------------------ preconditioning
    @abstractmethod
    def kronecker(
        self, gradient: Tensor, a: Tensor, g: Tensor | None, damping: float, moments: Moments
    ) -> Tensor:
        """The preconditioned ``[.., out, in]`` gradient from A's and G's results (leading
        batch dimensions broadcast: a grouped convolution's groups); ``moments`` is the
        block's running state for this form (empty for a stateless one), updated in place.
        ``g`` is None only for a form that does not use it (:attr:`uses_g`)."""

    @abstractmethod
    def kronecker_diagonal(
        self, gradient: Tensor, a: Tensor, g: Tensor, damping: float, moments: Moments
    ) -> Tensor:
        """The same with A's result from :meth:`diagonal`."""


def working(gradient: Tensor, *results: Tensor) -> tuple[Tensor, ...]:
    """The gradient and results in their promoted dtype: results stored in a low precision
    are applied in the gradient's (at most one matrix's transient copy each)."""
    dtype = gradient.dtype
    for result in results:
        dtype = torch.promote_types(dtype, result.dtype)
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in (gradient, *results))
