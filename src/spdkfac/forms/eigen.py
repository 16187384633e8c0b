"""Eigen-bases of the factors: damping on the Kronecker eigenvalues (``"eigen-basis"``) or
Adam's moments in the basis (``"eigen-adam"``)."""

from __future__ import annotations

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
    """Adam's moments in the eigen-bases of A and G (SOAP's recipe with K-FAC's factors);
    see the module docstring. The bases are :class:`EigenBasis` results (their eigenvalues
    unused)."""

    method = "eigen-adam"
    moments = ("exp_avg", "exp_avg_sq", "steps")
    #: SOAP's defaults (Vyas et al. 2024, Section 5).
    betas = (0.95, 0.95)
    eps = 1e-8

    def kronecker(
        self, gradient: Tensor, a: Tensor, g: Tensor | None, damping: float, moments: Moments
    ) -> Tensor:
        assert g is not None
        work, a, g = working(gradient, a, g)
        qa, qg = _split(a)[0], _split(g)[0]
        return self._adam(work, qg.mT, qa, moments).to(gradient.dtype)

    def kronecker_diagonal(
        self, gradient: Tensor, a: Tensor, g: Tensor, damping: float, moments: Moments
    ) -> Tensor:
        work, g = working(gradient, g)
        return self._adam(work, _split(g)[0].mT, None, moments).to(gradient.dtype)

    def _adam(self, work: Tensor, left: Tensor, right: Tensor | None, moments: Moments) -> Tensor:
        """One Adam step in the basis ``left · X · right`` (None: the identity), back in
        the parameters' space; the moments (float32 or wider) are updated in place."""

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
        t = float(steps)
        denominator = (exp_avg_sq / (1 - beta2**t)).sqrt_().add_(self.eps)
        direction = rotate(exp_avg).div_(1 - beta1**t).div_(denominator)
        return rotate(direction, back=True).to(work.dtype)
