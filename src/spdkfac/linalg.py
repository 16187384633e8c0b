"""Damped inverses of symmetric factors (one or a batch) and packing of symmetric matrices
as upper triangles."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "BATCH_BYTES",
    "INVERSE_METHODS",
    "InverseMethod",
    "InversionError",
    "all_finite",
    "batch_capacity",
    "damped_inverse",
    "damped_inverse_batch",
    "finite_members",
    "inverse_dtype",
    "is_finite",
    "pack_triu",
    "packed_dim",
    "packed_size",
    "symmetrize",
    "unpack_triu",
]

InverseMethod = Literal["cholesky", "eigen"]
INVERSE_METHODS: tuple[str, ...] = ("cholesky", "eigen")

# Relative floor for clamped eigenvalues in the last-resort fallback: a factor is an average
# of outer products, so it is PSD in exact arithmetic and negative eigenvalues are rounding.
_EIGEN_FLOOR = 0.0


#: Dtypes summed in float32 by the finiteness checks: their own range overflows early.
_HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})


def is_finite(tensor: Tensor) -> bool:
    """Whether every element is finite: one sum and one host sync.

    NaN and ±Inf propagate through a sum, so a finite sum means finite elements. The sum
    runs in the tensor's own precision (float32 for half types): accumulating float32 in
    float64 is 5-10x slower on the CPU. Its only false alarm, a sum that overflows, is
    checked again elementwise. Several times cheaper than ``isfinite(t).all()`` on a large
    factor (about 40x at 576 x 576).
    """
    if not tensor.is_floating_point():
        return bool(torch.isfinite(tensor.sum()))
    dtype = torch.float32 if tensor.dtype in _HALF_DTYPES else None
    return bool(torch.isfinite(tensor.sum(dtype=dtype))) or bool(torch.isfinite(tensor).all())


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """:func:`is_finite` of every floating-point tensor, with one host sync (True for none)."""
    if not tensors:
        return True
    sums = [t.sum(dtype=torch.float32 if t.dtype in _HALF_DTYPES else None) for t in tensors]
    flags = torch.isfinite(torch.stack([total.double() for total in sums])).tolist()
    return all(ok or bool(torch.isfinite(t).all()) for ok, t in zip(flags, tensors, strict=True))


def finite_members(batch: Tensor) -> list[bool]:
    """:func:`is_finite` of every matrix of a ``[k, d, d]`` batch, with one host sync."""
    flat = batch.mT if not batch.is_contiguous() and batch.mT.is_contiguous() else batch
    dtype = torch.float32 if batch.dtype in _HALF_DTYPES else None
    sums = flat.reshape(flat.shape[0], -1).sum(dim=1, dtype=dtype)
    return [
        ok or bool(torch.isfinite(member).all())
        for ok, member in zip(torch.isfinite(sums).tolist(), batch, strict=True)
    ]


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


def packed_dim(size: int) -> int:
    """The side d of a matrix whose packed upper triangle has ``size`` elements.

    Raises:
        ValueError: When ``size`` is not d(d+1)/2 for any d.
    """
    dim = (math.isqrt(8 * size + 1) - 1) // 2
    if packed_size(dim) != size:
        raise ValueError(f"{size} elements are not the packed upper triangle of a square matrix")
    return dim


@functools.lru_cache(maxsize=256)
def _triu_flat_indices(dim: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Row-major flat positions of the upper triangle, and for every position of the full
    matrix the packed position of its upper-triangle twin.

    Cached: packing runs for every factor on every exchange. ``index_select`` on one flat
    index is several times faster than 2-D fancy indexing, and gathering each element of
    the full matrix from the triangle about twice as fast as scattering the triangle twice.
    """
    rows, cols = torch.triu_indices(dim, dim, device=device)
    index = torch.arange(dim, device=device)
    low = torch.minimum(index[:, None], index[None, :])
    high = torch.maximum(index[:, None], index[None, :])
    # Row r of the triangle starts at r·d − r(r−1)/2 and holds columns r..d−1.
    twin = low * dim - low * (low - 1) // 2 + (high - low)
    return rows * dim + cols, twin.reshape(-1)


def pack_triu(matrix: Tensor) -> Tensor:
    """Pack the upper triangle (diagonal included) of a square matrix, row-major, into 1-D."""
    dim = matrix.shape[-1]
    upper, _ = _triu_flat_indices(dim, matrix.device)
    return matrix.reshape(-1).index_select(0, upper)


def unpack_triu(packed: Tensor, dim: int, *, out: Tensor | None = None) -> Tensor:
    """Rebuild the symmetric dim x dim matrix from :func:`pack_triu`'s output.

    Both triangles are copies of the same packed elements, so the result is exactly
    symmetric whatever produced the triangle.

    Args:
        packed: The packed upper triangle, ``dim·(dim+1)/2`` elements.
        dim: The side of the matrix.
        out: A contiguous ``[dim, dim]`` tensor of ``packed``'s dtype to write into (e.g.
            one matrix of a batch), instead of a new one.
    """
    if packed.numel() != packed_size(dim):
        raise ValueError(
            f"packed tensor has {packed.numel()} elements, "
            f"expected {packed_size(dim)} for dim={dim}"
        )
    _, twin = _triu_flat_indices(dim, packed.device)
    if out is None:
        return packed.reshape(-1).index_select(0, twin).view(dim, dim)
    torch.index_select(packed.reshape(-1), 0, twin, out=out.view(-1))
    return out


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
    """(F + γI)⁻¹ from an eigendecomposition of F with eigenvalues clamped at 0 (of each
    matrix of a batch)."""
    eigenvalues, eigenvectors = torch.linalg.eigh(factor)
    eigenvalues = eigenvalues.clamp(min=_EIGEN_FLOOR).add_(damping)
    return torch.matmul(eigenvectors / eigenvalues.unsqueeze(-2), eigenvectors.transpose(-1, -2))


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


def damped_inverse_batch(
    stack: Tensor, damping: float, method: InverseMethod = "cholesky"
) -> list[Tensor | None]:
    """The first attempt of :func:`damped_inverse` on every matrix of a stack, batched.

    One batched decomposition instead of one call per matrix. The results equal
    :func:`damped_inverse`'s to floating-point tolerance (on the CPU the same LAPACK
    routine runs on each matrix: bit for bit for Cholesky on the machines measured). A
    matrix that is not finite is never decomposed.

    Args:
        stack: ``[k, d, d]`` symmetric factors in :func:`inverse_dtype` of their dtype.
            Used as workspace: its contents are overwritten.
        damping: Positive scalar γ added to every diagonal.
        method: ``"cholesky"`` or ``"eigen"``.

    Returns:
        Per matrix, the inverse :func:`damped_inverse` returns when its first attempt
        succeeds, or None when that attempt fails (non-finite, not positive definite, or
        a non-finite inverse): call :func:`damped_inverse` on that matrix for its
        fallbacks, warnings and errors.

    Raises:
        ValueError: On a non-positive damping, an unknown method or a stack whose dtype is
            not its own :func:`inverse_dtype`.
    """
    if method not in INVERSE_METHODS:
        raise ValueError(f"inverse_method must be one of {INVERSE_METHODS}, got {method!r}")
    if not damping > 0:
        raise ValueError(f"damping must be > 0, got {damping!r}")
    if stack.dtype != inverse_dtype(stack.dtype) or stack.dim() != 3:
        raise ValueError(
            f"stack must be [k, d, d] float32 or float64, got {tuple(stack.shape)} {stack.dtype}"
        )
    results: list[Tensor | None] = [None] * stack.shape[0]
    finite = finite_members(stack)
    members = [index for index, ok in enumerate(finite) if ok]
    if not members:
        return results
    work = stack if len(members) == len(finite) else stack[members]
    if method == "cholesky":
        work.diagonal(dim1=-2, dim2=-1).add_(damping)
        factor, info = torch.linalg.cholesky_ex(work)
        decomposed = (info == 0).reshape(-1).expand(len(members))
        if not bool(decomposed.all()):  # never invert a failed factorization's leftovers
            eye = torch.eye(work.shape[-1], dtype=work.dtype, device=work.device)
            factor = torch.where(decomposed[:, None, None], factor, eye)
        inverse = torch.cholesky_inverse(factor)
        if inverse.device.type not in _CHOLESKY_INVERSE_REFLECTS:
            inverse = _upper_mirrored(inverse)
    else:
        try:
            inverse = _eigen_inverse(work, damping)
        except RuntimeError:  # some matrix did not converge: each retries alone
            return results
        decomposed = torch.ones(len(members), dtype=torch.bool, device=work.device)
        inverse = symmetrize(inverse)
    usable = [
        ok and inverse_ok
        for ok, inverse_ok in zip(decomposed.tolist(), finite_members(inverse), strict=True)
    ]
    for position, (index, ok) in enumerate(zip(members, usable, strict=True)):
        if ok:
            results[index] = _row_major_symmetric(inverse[position])
    return results


#: Bytes of one batch of :func:`damped_inverse_batch` (per matrix in the working dtype).
#: Batching saves the per-call overhead that dominates small factors; large ones are
#: LAPACK-bound either way, and on the CPU a large fresh batch buffer (and the
#: decompositions' own copies of it) faults its pages in at every inversion, which costs
#: more than batching saves (``benchmarks/reports/cheaper_step.md``).
BATCH_BYTES = 2 * 2**20


def batch_capacity(dim: int, dtype: torch.dtype) -> int:
    """How many ``[dim, dim]`` matrices of ``dtype`` one batched inversion takes (>= 1)."""
    matrix_bytes = dim * dim * torch.empty((), dtype=dtype).element_size()
    return max(1, BATCH_BYTES // matrix_bytes)
