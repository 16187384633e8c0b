"""What the inverse phase computes from a factor, and how a Kronecker block preconditions
with it: the *inverse form* chosen by the ``inverse_method`` option.

``"cholesky"`` / ``"eigen"`` — the damped inverse ``(F + γI)⁻¹`` of each factor (Martens
and Grosse 2015, Section 6.3 with the factored Tikhonov damping of Grosse and Martens
2016 reduced to one γ), kept and broadcast as a packed upper triangle; preconditioning is
``V = (G + γI)⁻¹ ∇ (A + γI)⁻¹``.

``"eigen-basis"`` — each factor's eigendecomposition ``F = Q diag(λ) Qᵀ`` (eigenvalues
clamped at 0), kept as one ``[d, d + 1]`` tensor ``[Q | λ]``; the damping is added to the
*Kronecker product's* eigenvalues (George et al. 2018, "Fast Approximate Natural Gradient
Descent in a Kronecker-factored Eigenbasis", Section 3; the eigen method of KAISA,
Pauloski et al. 2021, Section 3): ``V = Q_G [(Q_Gᵀ ∇ Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ``, the
exact ``(A ⊗ G + γI)⁻¹`` applied to ∇. It damps every direction by γ alone (the inverse
form damps by about γ·(λ_A + λ_G)), costs two more products per step and travels as
``d² + d`` elements instead of ``d(d + 1)/2``.

Results are stored in ``dtype`` (the ``inverse_dtype`` option; decompositions always run
in at least float32) and applied in the gradient's dtype (promoted with theirs).

**Costs.** Each form states what one result costs, so the placement planners, the cost
model's predictions and the simulator price it as the run computes and sends it:
:meth:`InverseForm.wire_size` (elements in a broadcast) and
:attr:`InverseForm.compute_scale`, its compute time relative to the cost model's one
inverse-time curve (:class:`~spdkfac.costmodel.PolynomialInverseModel`), which is fitted
to damped inverses by Cholesky (the default cost model, and ``spdkfac calibrate``'s default
``--method cholesky``). The scales (:data:`COMPUTE_SCALES`) were measured on a 2-core
AMD EPYC (torch 2.13, one thread; ``benchmarks/measure_sim_form_costs.py``, report in
``benchmarks/reports/form_costs_cpu.md``):
over d = 384…2048 a clamped ``eigh`` plus the reconstruction ``Q diag(1/(λ+γ)) Qᵀ`` took
4.2-5.7x a Cholesky inverse, the ``eigh`` of the eigen-basis alone 3.4-4.8x (two runs;
the scales are their middles); below d ≈ 128, where the per-call floor dominates, both
are nearer 2.5-3.6x. They are CPU
figures, not measured on a GPU (the simulator's GPU presets use them as they are). A cost
model calibrated with ``--method eigen`` already prices an eigendecomposition, so these
scales over-price it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Literal

import torch
from torch import Tensor

from spdkfac.linalg import (
    InverseMethod,
    InversionError,
    batch_capacity,
    damped_inverse,
    damped_inverse_batch,
    finite_members,
    inverse_dtype,
    is_finite,
    pack_triu,
    packed_size,
    unpack_triu,
)

__all__ = [
    "COMPUTE_SCALES",
    "FORM_METHODS",
    "DampedInverse",
    "EigenBasis",
    "FormMethod",
    "InverseForm",
    "inverse_form",
]

#: Values of the ``inverse_method`` option.
FormMethod = Literal["cholesky", "eigen", "eigen-basis"]
FORM_METHODS: tuple[str, ...] = ("cholesky", "eigen", "eigen-basis")
#: Compute time of one result of each form relative to a damped inverse by Cholesky (the
#: cost model's inverse-time fit); measured, see the module docstring.
COMPUTE_SCALES: Mapping[str, float] = MappingProxyType(
    {"cholesky": 1.0, "eigen": 5.0, "eigen-basis": 4.5}
)


class InverseForm(ABC):
    """One inverse form; see the module docstring.

    Args:
        dtype: Storage dtype of the results; None keeps the decomposition's
            (:func:`~spdkfac.linalg.inverse_dtype` of the factor).
    """

    method: str
    #: ``"inverse"`` or ``"eigen-basis"``: results of two forms of one kind are
    #: interchangeable (saved with a state dict; others are recomputed on loading).
    kind: str

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype

    @property
    def compute_scale(self) -> float:
        """Compute time of one result relative to the cost model's inverse-time fit (a
        damped inverse by Cholesky): :data:`COMPUTE_SCALES` of :attr:`method`."""
        return COMPUTE_SCALES[self.method]

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
    def kronecker(self, gradient: Tensor, a: Tensor, g: Tensor, damping: float) -> Tensor:
        """The preconditioned ``[.., out, in]`` gradient from A's and G's results (leading
        batch dimensions broadcast: a grouped convolution's groups)."""

    @abstractmethod
    def kronecker_diagonal(self, gradient: Tensor, a: Tensor, g: Tensor, damping: float) -> Tensor:
        """The same with A's result from :meth:`diagonal`."""


def _working(gradient: Tensor, *results: Tensor) -> tuple[Tensor, ...]:
    """The gradient and results in their promoted dtype: results stored in a low precision
    are applied in the gradient's (at most one matrix's transient copy each)."""
    dtype = gradient.dtype
    for result in results:
        dtype = torch.promote_types(dtype, result.dtype)
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in (gradient, *results))


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

    def kronecker(self, gradient: Tensor, a: Tensor, g: Tensor, damping: float) -> Tensor:
        work, a, g = _working(gradient, a, g)
        return (g @ work @ a).to(gradient.dtype)

    def kronecker_diagonal(self, gradient: Tensor, a: Tensor, g: Tensor, damping: float) -> Tensor:
        work, a, g = _working(gradient, a, g)
        return (g @ work).mul_(a).to(gradient.dtype)


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

    def kronecker(self, gradient: Tensor, a: Tensor, g: Tensor, damping: float) -> Tensor:
        work, a, g = _working(gradient, a, g)
        (qa, la), (qg, lg) = _split(a), _split(g)
        rotated = qg.mT @ work @ qa
        rotated.div_(lg.unsqueeze(-1) * la.unsqueeze(-2) + damping)
        return (qg @ rotated @ qa.mT).to(gradient.dtype)

    def kronecker_diagonal(self, gradient: Tensor, a: Tensor, g: Tensor, damping: float) -> Tensor:
        work, a, g = _working(gradient, a, g)
        qg, lg = _split(g)
        rotated = qg.mT @ work
        rotated.div_(lg.unsqueeze(-1) * a.unsqueeze(-2) + damping)
        return (qg @ rotated).to(gradient.dtype)


_FORMS: dict[str, Callable[[torch.dtype | None], InverseForm]] = {
    "cholesky": lambda dtype: DampedInverse("cholesky", dtype),
    "eigen": lambda dtype: DampedInverse("eigen", dtype),
    "eigen-basis": EigenBasis,
}


def inverse_form(method: str, dtype: torch.dtype | None = None) -> InverseForm:
    """The form of an ``inverse_method`` value, storing results in ``dtype``.

    Raises:
        ValueError: An unknown method.
    """
    if method not in _FORMS:
        raise ValueError(f"inverse_method must be one of {FORM_METHODS}, got {method!r}")
    return _FORMS[method](dtype)
