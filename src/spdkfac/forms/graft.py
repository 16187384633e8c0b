"""Layer-wise grafting: any form's direction with another optimizer's step size per layer.

Grafting (Agarwal et al. 2020, "Disentangling Adaptive Gradient Methods from Learning
Rates", Section 3; Shampoo's practice, Anil et al. 2020, "Scalable Second Order
Optimization for Deep Learning", Section 4) keeps the direction of a preconditioned
gradient ``V`` and takes its size from a simpler method's step ``D`` on the same layer:
``V ← V · ‖D‖ / ‖V‖`` (Frobenius norms over the layer's whole gradient matrix, bias column
and groups included). ``"sgd"``: ``D = ∇``. ``"adam"``: ``D = ∇ / (√v̂ + ε)`` with
``v ← β₂v + (1-β₂)∇²`` and ``v̂ = v / (1-β₂ᵗ)`` (Adam's second moment alone: the momentum is
the optimizer's; β₂ = 0.999, ε = 1e-8, Adam's defaults). ``v`` is the block's running
state next to the form's own, kept by whoever preconditions and saved in state dicts.

A grafted layer's step size follows the learning rate of the grafted method, so a
learning rate tuned for SGD (or Adam) transfers; the KL clip, when on, still applies
afterwards to the whole update.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from spdkfac.forms.base import InverseForm, Moments

__all__ = ["GRAFTINGS", "Grafted", "GraftingName"]

#: Values of the ``grafting`` option.
GraftingName = Literal["sgd", "adam"]
GRAFTINGS: tuple[str, ...] = ("sgd", "adam")


class Grafted(InverseForm):
    """``inner``'s results and direction, rescaled per layer to the norm of ``grafting``'s
    step (see the module docstring). Everything but :meth:`kronecker` and
    :meth:`kronecker_diagonal` is ``inner``'s: a grafted form computes, sends and prices
    what ``inner`` does.

    Args:
        inner: The form whose direction is kept.
        grafting: ``"sgd"`` or ``"adam"``: whose step size each layer takes.

    Raises:
        ValueError: An unknown ``grafting``.
    """

    #: Adam's defaults for the ``"adam"`` grafting's second moment.
    beta2 = 0.999
    eps = 1e-8

    def __init__(self, inner: InverseForm, grafting: str) -> None:
        if grafting not in GRAFTINGS:
            raise ValueError(f"grafting must be one of {GRAFTINGS} or None, got {grafting!r}")
        super().__init__(inner.dtype)
        self.inner = inner
        self.grafting = grafting
        self.method = inner.method
        self.kind = inner.kind
        self.uses_g = inner.uses_g
        own = (("graft_exp_avg_sq", "graft_steps"),) if grafting == "adam" else ()
        self.moment_groups = (*inner.moment_groups, *own)

    # ------------------------------------------------------------------ inner's
    def compute_batch(self, stack: Tensor, damping: float) -> list[Tensor | None]:
        return self.inner.compute_batch(stack, damping)

    def compute(self, factor: Tensor, damping: float) -> Tensor:
        return self.inner.compute(factor, damping)

    def diagonal(self, factor: Tensor, damping: float) -> Tensor:
        return self.inner.diagonal(factor, damping)

    def shape(self, dim: int) -> tuple[int, ...]:
        return self.inner.shape(dim)

    def wire_size(self, dim: int) -> int:
        return self.inner.wire_size(dim)

    def pack(self, result: Tensor) -> Tensor:
        return self.inner.pack(result)

    def unpack(self, buffer: Tensor, dim: int) -> Tensor:
        return self.inner.unpack(buffer, dim)

    # ------------------------------------------------------------------ preconditioning
    def kronecker(
        self, gradient: Tensor, a: Tensor, g: Tensor | None, damping: float, moments: Moments
    ) -> Tensor:
        direction = self.inner.kronecker(gradient, a, g, damping, moments)
        return self._graft(direction, gradient, moments)

    def kronecker_diagonal(
        self, gradient: Tensor, a: Tensor, g: Tensor, damping: float, moments: Moments
    ) -> Tensor:
        direction = self.inner.kronecker_diagonal(gradient, a, g, damping, moments)
        return self._graft(direction, gradient, moments)

    def _graft(self, direction: Tensor, gradient: Tensor, moments: Moments) -> Tensor:
        """``direction`` scaled to the norm of the grafted step (no host sync: a zero
        direction stays zero)."""
        dtype = torch.promote_types(gradient.dtype, torch.float32)
        step = gradient.to(dtype)
        if self.grafting == "adam":
            step = self._adam(step, moments)
        work = direction.to(dtype)
        size: Tensor = torch.linalg.vector_norm(step)
        norm: Tensor = torch.linalg.vector_norm(work)
        return (work * (size / norm.clamp(min=torch.finfo(dtype).tiny))).to(direction.dtype)

    def _adam(self, step: Tensor, moments: Moments) -> Tensor:
        """Adam's step without momentum, ``∇ / (√v̂ + ε)``; ``v`` updated in place."""
        if moments.get("graft_steps") is None:
            moments["graft_exp_avg_sq"] = torch.zeros_like(step)
            moments["graft_steps"] = torch.zeros((), dtype=step.dtype, device=step.device)
        exp_avg_sq, steps = moments["graft_exp_avg_sq"], moments["graft_steps"]
        assert exp_avg_sq is not None and steps is not None
        steps.add_(1)
        exp_avg_sq.mul_(self.beta2).addcmul_(step, step, value=1 - self.beta2)
        correction = 1 - self.beta2 ** float(steps)
        denominator: Tensor = (exp_avg_sq / correction).sqrt_().add_(self.eps)
        return step / denominator
