"""Damped inverses of symmetric factors and packing of symmetric matrices as upper triangles."""

from __future__ import annotations

import functools
import warnings
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "INVERSE_METHODS",
    "InverseMethod",
    "InversionError",
    "damped_inverse",
    "inverse_dtype",
    "is_finite",
    "pack_triu",
    "packed_size",
    "symmetrize",
    "unpack_triu",
]

InverseMethod = Literal["cholesky", "eigen"]
INVERSE_METHODS: tuple[str, ...] = ("cholesky", "eigen")

# Relative floor for clamped eigenvalues in the last-resort fallback: a factor is an average
# of outer products, so it is PSD in exact arithmetic and negative eigenvalues are rounding.
_EIGEN_FLOOR = 0.0


def is_finite(tensor: Tensor) -> bool:
    """Whether every element is finite: one float64 sum and one host sync.

    NaN and ±Inf propagate through a sum, so a finite sum means finite elements; the only
    false alarm is a sum that overflows float64, which no usable factor reaches. About 20x
    cheaper than ``isfinite(t).all()`` on a large factor.
    """
    total = tensor.sum(dtype=torch.float64) if tensor.is_floating_point() else tensor.sum()
    return bool(torch.isfinite(total))


def symmetrize(matrix: Tensor) -> Tensor:
    """Return (M + Mᵀ)/2 in row-major layout, removing the rounding asymmetry of XᵀX.

    The result is exactly symmetric (IEEE addition commutes). Its layout is forced to be
    contiguous: a product with a column-major copy rounds differently, which would make a
    locally computed inverse and a broadcast one give different preconditioned gradients.
    """
    return (matrix + matrix.transpose(-1, -2)).mul_(0.5).contiguous()


def packed_size(dim: int) -> int:
    """Number of elements of the packed upper triangle of a dim x dim matrix."""
    return dim * (dim + 1) // 2


@functools.lru_cache(maxsize=256)
def _triu_flat_indices(dim: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Row-major flat positions of the upper triangle and of its mirror image.

    Cached: packing runs for every factor on every exchange, and ``index_select`` /
    ``index_copy_`` on one flat index are several times faster than 2-D fancy indexing.
    """
    rows, cols = torch.triu_indices(dim, dim, device=device)
    return rows * dim + cols, cols * dim + rows


def pack_triu(matrix: Tensor) -> Tensor:
    """Pack the upper triangle (diagonal included) of a square matrix, row-major, into 1-D."""
    dim = matrix.shape[-1]
    upper, _ = _triu_flat_indices(dim, matrix.device)
    return matrix.reshape(-1).index_select(0, upper)


def unpack_triu(packed: Tensor, dim: int) -> Tensor:
    """Rebuild the symmetric dim x dim matrix from :func:`pack_triu`'s output."""
    if packed.numel() != packed_size(dim):
        raise ValueError(
            f"packed tensor has {packed.numel()} elements, "
            f"expected {packed_size(dim)} for dim={dim}"
        )
    upper, lower = _triu_flat_indices(dim, packed.device)
    out = packed.new_empty(dim * dim)
    out.index_copy_(0, upper, packed)
    out.index_copy_(0, lower, packed)
    return out.view(dim, dim)


def inverse_dtype(factor_dtype: torch.dtype) -> torch.dtype:
    """Dtype of :func:`damped_inverse`'s result: float64 stays, everything else is float32."""
    return factor_dtype if factor_dtype in (torch.float32, torch.float64) else torch.float32


def _add_diagonal(matrix: Tensor, value: float) -> Tensor:
    """A copy of ``matrix`` with ``value`` added to its diagonal (never in place)."""
    out = matrix.clone()
    out.diagonal().add_(value)
    return out


def _row_major_symmetric(matrix: Tensor) -> Tensor:
    """An exactly symmetric matrix in row-major layout; free when it is column-major."""
    if matrix.is_contiguous():
        return matrix
    return matrix.mT if matrix.mT.is_contiguous() else matrix.contiguous()


#: Device types whose ``cholesky_inverse`` computes one triangle and copies it onto the
#: other (LAPACK potri, then a reflection in ATen's CPU kernel): exactly symmetric, checked
#: by the tests. cuSOLVER's solves against the identity (potrs) and computes both.
_CHOLESKY_INVERSE_REFLECTS = frozenset({"cpu"})


def _upper_mirrored(matrix: Tensor) -> Tensor:
    """A copy of ``matrix`` whose strict lower triangle is the transpose of its upper one."""
    lower = torch.ones_like(matrix, dtype=torch.bool).tril_(-1)
    return torch.where(lower, matrix.mT, matrix)


def _cholesky_inverse(matrix: Tensor) -> Tensor | None:
    """(M)⁻¹ by Cholesky, or None when M is not numerically positive definite.

    On the CPU ``cholesky_inverse`` fills both triangles from one, so no symmetrizing pass
    is needed; elsewhere the two triangles are separate solves, which need not round
    alike, so the upper one is mirrored (O(d²) next to the O(d³) inverse).
    """
    factor, info = torch.linalg.cholesky_ex(matrix)
    if int(info) != 0:
        return None
    inverse = torch.cholesky_inverse(factor)
    if inverse.device.type not in _CHOLESKY_INVERSE_REFLECTS:
        inverse = _upper_mirrored(inverse)
    return _row_major_symmetric(inverse) if is_finite(inverse) else None


def _eigen_inverse(factor: Tensor, damping: float) -> Tensor:
    """(F + γI)⁻¹ from an eigendecomposition of F with eigenvalues clamped at 0."""
    eigenvalues, eigenvectors = torch.linalg.eigh(factor)
    eigenvalues = eigenvalues.clamp(min=_EIGEN_FLOOR).add_(damping)
    return torch.matmul(eigenvectors / eigenvalues, eigenvectors.transpose(-1, -2))


class InversionError(RuntimeError):
    """No fallback could invert a damped factor (the caller keeps the previous inverse)."""


def damped_inverse(factor: Tensor, damping: float, method: InverseMethod = "cholesky") -> Tensor:
    """Compute ``(factor + damping·I)⁻¹`` of a symmetric PSD factor, never silently NaN.

    The damping is added to a copy; ``factor`` is not modified. Decompositions run in at
    least float32 and the result has ``factor``'s dtype when that is float32 or float64.

    ``"cholesky"`` falls back, with a warning, when a damped factor is not numerically
    positive definite: Cholesky in float64, then with 10x and 100x the damping, then an
    eigendecomposition with eigenvalues clamped at zero (exact for a PSD factor, well
    defined for any symmetric one). ``"eigen"`` is the clamped eigendecomposition, retried
    in float64 when the working precision fails.

    Args:
        factor: Symmetric ``[d, d]`` matrix.
        damping: Positive scalar γ added to the diagonal.
        method: ``"cholesky"`` or ``"eigen"``.

    Returns:
        The symmetric inverse, shape ``[d, d]``, exactly symmetric and row-major.

    Raises:
        ValueError: On a non-finite factor, a non-positive damping or an unknown method.
        InversionError: When every fallback failed.
    """
    if method not in INVERSE_METHODS:
        raise ValueError(f"inverse_method must be one of {INVERSE_METHODS}, got {method!r}")
    if not damping > 0:
        raise ValueError(f"damping must be > 0, got {damping!r}")
    if not is_finite(factor):
        # Never hand a non-finite matrix to a LAPACK/cuSOLVER routine: some loop forever.
        raise ValueError("factor contains NaN or Inf; refusing to decompose it")
    out_dtype = inverse_dtype(factor.dtype)
    work = factor.to(out_dtype)
    if method == "cholesky":
        inverse = _cholesky_inverse(_add_diagonal(work, damping))
        if inverse is not None:
            return inverse
        wide = work.double()
        for boost in (1.0, 10.0, 100.0):
            inverse = _cholesky_inverse(_add_diagonal(wide, damping * boost))
            if inverse is not None:
                if boost > 1.0:
                    warnings.warn(
                        f"Cholesky failed on a damped factor (not positive definite); "
                        f"inverted it with {boost:g}x the damping",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                return inverse.to(out_dtype)
        warnings.warn(
            "Cholesky failed on a damped factor even with 100x the damping; using a clamped "
            "eigendecomposition instead",
            RuntimeWarning,
            stacklevel=2,
        )
    for attempt in (work, work.double()):
        try:
            inverse = _eigen_inverse(attempt, damping)
        except RuntimeError:  # torch.linalg.LinAlgError: eigh did not converge
            continue
        if is_finite(inverse):
            return symmetrize(inverse).to(out_dtype)
    raise InversionError(f"could not invert a damped {tuple(factor.shape)} factor")
