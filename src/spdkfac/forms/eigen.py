"""Eigen-bases of the factors: damping on the Kronecker eigenvalues (``"eigen-basis"``) or
Adam's moments in the basis (``"eigen-adam"``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from spdkfac.forms.base import InverseForm, Moments, working
from spdkfac.linalg import InversionError, finite_members, inverse_dtype, is_finite

__all__ = ["EigenAdam", "EigenBasis"]


def _split(result: Tensor) -> tuple[Tensor, Tensor]:
    """``[.., d, d + 1]`` → eigenvectors ``[.., d, d]`` and eigenvalues ``[.., d]``."""
    return result[..., :-1], result[..., -1]


def _eigen_basis(stack: Tensor) -> Tensor:
    """``[Q | λ]`` of every matrix of ``[.., d, d]`` (eigenvalues clamped at 0)."""
    eigenvalues, eigenvectors = torch.linalg.eigh(stack)
    return torch.cat([eigenvectors, eigenvalues.clamp_(min=0.0).unsqueeze(-1)], dim=-1)


def _share_unseen(exp_avg_sq: Tensor, seen: Tensor) -> None:
    """The second moment of the unseen coordinates set to their mean, in place: their
    total is what no rotation of the null spaces changes, their split is arbitrary (and
    kept across a refresh, it would reach directions the next bases resolve)."""
    unseen = (~seen).expand_as(exp_avg_sq)
    count = unseen.sum(dim=(-2, -1), keepdim=True).clamp_(min=1)
    shared = (exp_avg_sq * unseen).sum(dim=(-2, -1), keepdim=True) / count
    exp_avg_sq.copy_(torch.where(unseen, shared, exp_avg_sq))


class EigenBasis(InverseForm):
    """Eigendecompositions; the damping acts on the Kronecker eigenvalues at use."""

    method = "eigen-basis"
    kind = "eigen-basis"

    def compute_batch(self, stack: Tensor, damping: float) -> list[Tensor | None]:
        if not damping > 0:
            raise ValueError(f"damping must be > 0, got {damping!r}")
        results: list[Tensor | None] = [None] * stack.shape[0]
        members = [index for index, ok in enumerate(finite_members(stack)) if ok]
        if not members:
            return results
        try:
            decomposed = _eigen_basis(stack if len(members) == stack.shape[0] else stack[members])
        except RuntimeError:  # some matrix did not converge: each retries alone
            return results
        for index, usable, result in zip(
            members, finite_members(decomposed), decomposed, strict=True
        ):
            if usable:
                results[index] = result
        return results

    def compute(self, factor: Tensor, damping: float) -> Tensor:
        if not damping > 0:
            raise ValueError(f"damping must be > 0, got {damping!r}")
        if not is_finite(factor):
            raise ValueError("factor contains NaN or Inf; refusing to decompose it")
        work = factor.to(inverse_dtype(factor.dtype))
        for attempt in (work, work.double()):
            try:
                result = _eigen_basis(attempt)
            except RuntimeError:  # torch.linalg.LinAlgError: eigh did not converge
                continue
            if is_finite(result):
                return result.to(work.dtype)
        raise InversionError(f"could not decompose a {tuple(factor.shape)} factor")

    def diagonal(self, factor: Tensor, damping: float) -> Tensor:
        return self.stored(factor.clamp(min=0.0))  # its eigenvalues (the basis: identity)

    def shape(self, dim: int) -> tuple[int, ...]:
        return (dim, dim + 1)

    def wire_size(self, dim: int) -> int:
        return dim * (dim + 1)

    def pack(self, result: Tensor) -> Tensor:
        return result.reshape(-1)

    def unpack(self, buffer: Tensor, dim: int) -> Tensor:
        return buffer.reshape(dim, dim + 1)

    def kronecker(
        self, gradient: Tensor, a: Tensor, g: Tensor | None, damping: float, moments: Moments
    ) -> Tensor:
        assert g is not None
        work, a, g = working(gradient, a, g)
        (qa, la), (qg, lg) = _split(a), _split(g)
        rotated = qg.mT @ work @ qa
        rotated.div_(lg.unsqueeze(-1) * la.unsqueeze(-2) + damping)
        return (qg @ rotated @ qa.mT).to(gradient.dtype)

    def kronecker_diagonal(
        self, gradient: Tensor, a: Tensor, g: Tensor, damping: float, moments: Moments
    ) -> Tensor:
        work, a, g = working(gradient, a, g)
        qg, lg = _split(g)
        rotated = qg.mT @ work
        rotated.div_(lg.unsqueeze(-1) * a.unsqueeze(-2) + damping)
        return (qg @ rotated).to(gradient.dtype)


class EigenAdam(EigenBasis):
    """Adam's moments in the eigen-bases of A and G (SOAP's recipe with K-FAC's factors),
    well posed where a factor is rank-deficient; see the module docstring of
    :mod:`spdkfac.forms`. The bases are :class:`EigenBasis` results.

    Per-coordinate normalization is applied only on the coordinates both factors *see*
    (eigenvalue above :meth:`resolution` times the largest); every other coordinate — a
    direction of an eigenspace whose basis ``eigh`` chooses arbitrarily, and where the
    gradient is rounding noise or a component the factor has not yet recorded — is divided
    by the root-mean-square second moment of the whole layer instead, which no rotation
    changes. The second moment of those coordinates is kept as their common mean (what
    no rotation changes), so a refresh carries nothing of the arbitrary basis over.

    Args:
        dtype: Storage dtype of the results (as every form).
        factor_dtype: Dtype the factors are stored in (None: float32); with ``dtype`` it
            sets the eigenvalue resolution.
    """

    method = "eigen-adam"
    moment_groups = (("exp_avg", "exp_avg_sq", "steps"),)
    #: SOAP's defaults (Vyas et al. 2024, Section 5).
    betas = (0.95, 0.95)
    eps = 1e-8

    def __init__(
        self, dtype: torch.dtype | None = None, factor_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(dtype)
        precisions = [d for d in (dtype, factor_dtype) if d is not None] or [torch.float32]
        #: Machine epsilon of the coarsest precision the eigenvalues went through (at
        #: least float32's: decompositions run in float32 or wider).
        self.precision = max(torch.finfo(d).eps for d in (*precisions, torch.float32))

    def resolution(self, dim: int) -> float:
        """Eigenvalues at or below this fraction of a ``dim``-sized factor's largest are
        not resolved: ``√dim · ε`` (Weyl's inequality: rounding each entry by a relative
        ε moves every eigenvalue by at most ``ε‖F‖_F ≤ ε√dim·λ_max``)."""
        return math.sqrt(dim) * self.precision

    def kronecker(
        self, gradient: Tensor, a: Tensor, g: Tensor | None, damping: float, moments: Moments
    ) -> Tensor:
        assert g is not None
        work, a, g = working(gradient, a, g)
        (qa, la), (qg, lg) = _split(a), _split(g)
        seen = self._seen(lg).unsqueeze(-1) & self._seen(la).unsqueeze(-2)
        return self._adam(work, qg.mT, qa, seen, moments).to(gradient.dtype)

    def kronecker_diagonal(
        self, gradient: Tensor, a: Tensor, g: Tensor, damping: float, moments: Moments
    ) -> Tensor:
        work, a, g = working(gradient, a, g)
        qg, lg = _split(g)
        seen = self._seen(lg).unsqueeze(-1) & self._seen(a).unsqueeze(-2)
        return self._adam(work, qg.mT, None, seen, moments).to(gradient.dtype)

    def _seen(self, eigenvalues: Tensor) -> Tensor:
        """Which eigenvalues of ``[.., d]`` the factor resolves (see :meth:`resolution`)."""
        largest = eigenvalues.amax(dim=-1, keepdim=True)
        return eigenvalues > largest * self.resolution(eigenvalues.shape[-1])

    def _adam(
        self, work: Tensor, left: Tensor, right: Tensor | None, seen: Tensor, moments: Moments
    ) -> Tensor:
        """One Adam step in the basis ``left · X · right`` (None: the identity), back in
        the parameters' space, per coordinate where ``seen`` and by the layer's mean second
        moment elsewhere; the moments (float32 or wider) are updated in place."""

        def rotate(x: Tensor, back: bool = False) -> Tensor:
            x = (left.mT if back else left) @ x
            return x if right is None else x @ (right.mT if back else right)

        dtype = torch.promote_types(work.dtype, torch.float32)
        if moments.get("steps") is None:
            moments["exp_avg"] = torch.zeros_like(work, dtype=dtype)
            moments["exp_avg_sq"] = torch.zeros_like(work, dtype=dtype)
            moments["steps"] = torch.zeros((), dtype=dtype, device=work.device)
        exp_avg, exp_avg_sq, steps = moments["exp_avg"], moments["exp_avg_sq"], moments["steps"]
        assert exp_avg is not None and exp_avg_sq is not None and steps is not None
        beta1, beta2 = self.betas
        steps.add_(1)
        exp_avg.lerp_(work.to(dtype), 1 - beta1)
        rotated = rotate(work.to(dtype))
        exp_avg_sq.mul_(beta2).addcmul_(rotated, rotated, value=1 - beta2)
        _share_unseen(exp_avg_sq, seen)
        t = float(steps)
        second = exp_avg_sq / (1 - beta2**t)
        layer = second.mean(dim=(-2, -1), keepdim=True)  # ‖v‖₁/n: no rotation changes it
        denominator = torch.where(seen, second, layer).sqrt_().add_(self.eps)
        direction = rotate(exp_avg).div_(1 - beta1**t).div_(denominator)
        return rotate(direction, back=True).to(work.dtype)
