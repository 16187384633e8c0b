"""Damped inverses: both sides (``"cholesky"``, ``"eigen"``) or A's alone (``"one-sided"``)."""

from __future__ import annotations

import torch
from torch import Tensor

from spdkfac.forms.base import InverseForm, Moments, working
from spdkfac.linalg import (
    InverseMethod,
    damped_inverse,
    damped_inverse_batch,
    is_finite,
    pack_triu,
    packed_size,
    unpack_triu,
)

__all__ = ["DampedInverse", "OneSided"]


class DampedInverse(InverseForm):
    """``(F + γI)⁻¹`` by Cholesky (with fallbacks) or a clamped eigendecomposition."""

    kind = "inverse"

    def __init__(self, method: InverseMethod, dtype: torch.dtype | None = None) -> None:
        super().__init__(dtype)
        self.method = method

    def compute_batch(self, stack: Tensor, damping: float) -> list[Tensor | None]:
        return damped_inverse_batch(stack, damping, self.method)  # type: ignore[arg-type]

    def compute(self, factor: Tensor, damping: float) -> Tensor:
        return damped_inverse(factor, damping, self.method)  # type: ignore[arg-type]

    def diagonal(self, factor: Tensor, damping: float) -> Tensor:
        return self.stored(torch.reciprocal(factor + damping))

    def shape(self, dim: int) -> tuple[int, ...]:
        return (dim, dim)

    def wire_size(self, dim: int) -> int:
        return packed_size(dim)

    def pack(self, result: Tensor) -> Tensor:
        return pack_triu(result)

    def unpack(self, buffer: Tensor, dim: int) -> Tensor:
        return unpack_triu(buffer, dim)

    def kronecker(
        self, gradient: Tensor, a: Tensor, g: Tensor | None, damping: float, moments: Moments
    ) -> Tensor:
        assert g is not None
        work, a, g = working(gradient, a, g)
        return (g @ work @ a).to(gradient.dtype)

    def kronecker_diagonal(
        self, gradient: Tensor, a: Tensor, g: Tensor, damping: float, moments: Moments
    ) -> Tensor:
        work, a, g = working(gradient, a, g)
        return (g @ work).mul_(a).to(gradient.dtype)


def _mean_eigenvalue(stack: Tensor) -> Tensor:
    """``tr(F)/d`` of every matrix of ``[.., d, d]``, shaped to broadcast over them (a
    floor keeps an all-zero factor invertible)."""
    mean = stack.diagonal(dim1=-2, dim2=-1).mean(-1).clamp(min=1e-30)
    return mean[..., None, None]


class OneSided(DampedInverse):
    """``(A + γ·tr(A)/d·I)⁻¹`` by Cholesky (with fallbacks), applied on the right only.

    Computed as ``(A/m + γI)⁻¹ / m`` with ``m = tr(A)/d``: the damped inverse of the
    normalised factor, so batched first attempts share one damping.
    """

    method = "one-sided"
    kind = "one-sided"
    uses_g = False

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__("cholesky", dtype)
        self.method = "one-sided"

    def compute_batch(self, stack: Tensor, damping: float) -> list[Tensor | None]:
        mean = _mean_eigenvalue(stack)
        results = damped_inverse_batch(stack.div_(mean), damping, "cholesky")
        return [None if r is None else r / m for r, m in zip(results, mean, strict=True)]

    def compute(self, factor: Tensor, damping: float) -> Tensor:
        if not is_finite(factor):  # (the mean would be NaN: the same error as Cholesky's)
            return damped_inverse(factor, damping, "cholesky")
        mean = _mean_eigenvalue(factor)
        return damped_inverse(factor / mean, damping, "cholesky") / mean

    def diagonal(self, factor: Tensor, damping: float) -> Tensor:
        mean = factor.mean().clamp(min=1e-30)
        return self.stored(torch.reciprocal(factor + damping * mean))

    def kronecker(
        self, gradient: Tensor, a: Tensor, g: Tensor | None, damping: float, moments: Moments
    ) -> Tensor:
        work, a = working(gradient, a)
        return (work @ a).to(gradient.dtype)

    def kronecker_diagonal(
        self, gradient: Tensor, a: Tensor, g: Tensor, damping: float, moments: Moments
    ) -> Tensor:
        work, a = working(gradient, a)
        return (work * a).to(gradient.dtype)
