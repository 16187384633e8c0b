"""Building blocks of the fast factor methods: symmetric Gram products, workspaces, casts."""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Concatenate, ParamSpec, TypeVar

import torch
from torch import Tensor

__all__ = [
    "LOW_PRECISION_DTYPES",
    "clear_workspace",
    "factor_kernel",
    "gram_into",
    "input_scale",
    "panel_height",
    "resolve_compute_dtype",
    "second_moment",
    "set_workspace_limit",
    "workspace",
]


def panel_height(side: int) -> int:
    """Panel height of :func:`gram_into` for a ``side``-row product: side/4 within [128, 256].

    Measured on one AVX-512 thread: smaller panels skip more of the lower triangle but
    run thinner GEMMs; this was within a few percent of the best panel for sides 144 to
    2048 (side 576: 0.75 of the full product's time, 2048: 0.75, 1152: 0.68).
    """
    return min(256, max(128, side // 4))


_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")


def factor_kernel(
    function: Callable[Concatenate[Tensor, _Params], _Result],
) -> Callable[Concatenate[Tensor, _Params], _Result]:
    """Run a factor function without autograd and without an enclosing autocast.

    Hooks fire inside the user's forward and backward, so an ``autocast`` region of the
    model would otherwise silently run these products in bf16/fp16; the precision is
    ``compute_dtype``'s to decide. The first argument's device picks the autocast type.
    """

    @functools.wraps(function)
    def wrapper(tensor: Tensor, /, *args: _Params.args, **kwargs: _Params.kwargs) -> _Result:
        with torch.no_grad(), torch.autocast(tensor.device.type, enabled=False):
            return function(tensor, *args, **kwargs)

    return wrapper


#: Compute dtypes that trade accuracy for speed; products still accumulate in fp32.
LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)

_FLOAT16_MAX = 65504.0


class _Workspace(threading.local):
    """Per-thread scratch tensors, least recently used first, bounded in bytes."""

    def __init__(self) -> None:
        self.tensors: OrderedDict[tuple[object, ...], Tensor] = OrderedDict()
        self.nbytes = 0
        self.limit = 512 * 2**20


_WORKSPACE = _Workspace()


def workspace(
    tag: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    *,
    zeroed: bool = False,
) -> Tensor:
    """A scratch tensor reused across calls with the same tag, shape, dtype and device.

    Its content is whatever the previous user left: callers overwrite all of it (or the
    parts they read). Never return it, or a view of it, to code outside this package:
    the next call with the same key overwrites it. Buffers are per thread, so concurrent
    factor computations in different threads never share one.

    Args:
        tag: Names the role of the buffer, so two roles with equal shapes never collide.
        shape: Shape of the buffer.
        dtype: Its dtype.
        device: Its device.
        zeroed: Fill with zeros when the buffer is created. For buffers whose users all
            write the same part (the tag must say which) and rely on the rest staying 0.
    """
    key = (tag, tuple(shape), dtype, device, zeroed)
    cache = _WORKSPACE.tensors
    tensor = cache.get(key)
    if tensor is not None:
        cache.move_to_end(key)
        return tensor
    factory = torch.zeros if zeroed else torch.empty
    tensor = factory(tuple(shape), dtype=dtype, device=device)
    size = tensor.numel() * tensor.element_size()
    if size > _WORKSPACE.limit:
        # Too big to keep: the caller still gets a buffer, just not a cached one.
        return tensor
    while cache and _WORKSPACE.nbytes + size > _WORKSPACE.limit:
        _, evicted = cache.popitem(last=False)
        _WORKSPACE.nbytes -= evicted.numel() * evicted.element_size()
    cache[key] = tensor
    _WORKSPACE.nbytes += size
    return tensor


def clear_workspace() -> None:
    """Free this thread's cached scratch tensors."""
    _WORKSPACE.tensors.clear()
    _WORKSPACE.nbytes = 0


def set_workspace_limit(nbytes: int) -> None:
    """Bound this thread's cached scratch tensors to ``nbytes`` (0 disables caching).

    Raises:
        ValueError: If ``nbytes`` is negative.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    _WORKSPACE.limit = nbytes
    clear_workspace()


def resolve_compute_dtype(
    compute_dtype: torch.dtype | None, input_dtype: torch.dtype, *, rows: int, dim: int
) -> torch.dtype:
    """The dtype products are computed in: ``compute_dtype``, or the input's when None.

    A low-precision dtype (bf16, fp16) is used only for a factor of full rank, i.e. with
    more rows (summed outer products) than its side: its output is rounded to 8 or 11
    bits per entry, which moves the zero eigenvalues of a rank-deficient factor to about
    ±2⁻⁹·‖F‖, far below −γ for the usual damping, so ``F + γI`` would lose definiteness.
    Such factors (few rows, e.g. a Linear layer at a small batch) are computed in the
    input's dtype, where low precision would not be faster anyway.

    Args:
        compute_dtype: Requested dtype, or None.
        input_dtype: dtype of the captured tensor (and of the result).
        rows: Number of outer products summed (N).
        dim: Side of the factor without the bias entry (D).

    Raises:
        ValueError: If either dtype is not a floating-point dtype.
    """
    dtype = input_dtype if compute_dtype is None else compute_dtype
    if not dtype.is_floating_point:
        raise ValueError(f"compute_dtype must be a floating-point dtype, got {dtype}")
    if not input_dtype.is_floating_point:
        raise ValueError(f"factor inputs must be floating point, got {input_dtype}")
    if dtype in LOW_PRECISION_DTYPES and rows <= dim:
        return input_dtype
    return dtype


def input_scale(inputs: Tensor, count: int, compute_dtype: torch.dtype) -> float:
    """A power of two ``s`` so that sums of ``count`` products of ``s·inputs`` fit the dtype.

    Only float16 needs it (its largest value is 65504); the scale is a power of two so
    multiplying by it and dividing the result by ``s²`` are exact. 1.0 for other dtypes.
    """
    if compute_dtype != torch.float16:
        return 1.0
    peak = float(inputs.detach().abs().max()) if inputs.numel() else 0.0
    if peak == 0.0 or not torch.isfinite(torch.tensor(peak)):
        return 1.0
    # count·(s·peak)² <= max/4 leaves headroom for rounding in the accumulation.
    target = (_FLOAT16_MAX / 4.0 / float(max(count, 1))) ** 0.5 / peak
    exponent = int(torch.floor(torch.log2(torch.tensor(target, dtype=torch.float64))))
    return float(2.0**exponent)


@functools.lru_cache(maxsize=64)
def _strict_lower_mask(side: int, device: torch.device) -> Tensor:
    """``[side, side]`` boolean mask of the strictly lower triangle, cached per side."""
    return torch.ones(side, side, dtype=torch.bool, device=device).tril_(-1)


def _symmetric_from_upper(upper: Tensor, out: Tensor) -> None:
    """``out`` = the upper triangles of ``upper`` (``[..., p, p]``) mirrored onto the lower.

    BLAS does not promise a bitwise symmetric ``M Mᵀ``: entries (i, j) and (j, i) can come
    from different micro-kernels (edge tiles, AVX2 vs AVX-512 code paths, MKL on AMD CPUs)
    and round differently, so :func:`gram_into` never lets a product's lower triangle
    through on the diagonal. One select over p² entries, against the p²·K multiply-adds
    of the product. ``upper`` must not overlap ``out``; read transposed, it is best
    contiguous (stepping down a column of a wide ``out`` jumps a whole row).
    """
    side = upper.shape[-1]
    torch.where(_strict_lower_mask(side, upper.device), upper.mT, upper, out=out)


def _mirror_upper(blocks: Tensor) -> None:
    """Copy the upper triangle of each ``[..., p, p]`` block onto its lower triangle."""
    if blocks.shape[-1] > 1:
        upper = workspace("gram_into_upper", blocks.shape, blocks.dtype, blocks.device)
        upper.copy_(blocks)
        _symmetric_from_upper(upper, blocks)


def gram_into(matrix: Tensor, out: Tensor, *, alpha: float, panel: int | None = None) -> Tensor:
    """``out = alpha · matrix @ matrixᵀ``, computing only the upper triangle, then mirroring.

    The triangle is computed in row panels of height ``panel`` (``out[i:j, i:] = M[i:j]
    M[i:]ᵀ``), which does (t+1)/2t of a full product's multiply-adds for t panels; each
    panel's transpose then fills the lower part. The diagonal blocks are full products,
    which BLAS does not promise bitwise symmetric (it depends on the CPU's code path), so
    the upper triangle of each is copied onto its lower one: ``out`` is exactly symmetric
    on every machine.

    Args:
        matrix: ``[D, K]`` with unit stride in one dimension (a transposed view is fine).
        out: ``[D, D]`` destination of ``matrix``'s dtype; any strides BLAS accepts (a
            view into a larger tensor is fine). Its content is ignored.
        alpha: Scale of the product.
        panel: Panel height (default :func:`panel_height`); a side of at most ``panel`` is
            one plain product.

    Returns:
        ``out``.
    """
    side = matrix.shape[0]
    panel = panel_height(side) if panel is None else panel
    if side <= panel:
        if side <= 1:
            return torch.addmm(out, matrix, matrix.t(), beta=0.0, alpha=alpha, out=out)
        # Into a contiguous buffer, then mirrored into ``out`` in the same pass.
        product = workspace("gram_into_upper", (side, side), matrix.dtype, matrix.device)
        torch.addmm(product, matrix, matrix.t(), beta=0.0, alpha=alpha, out=product)
        _symmetric_from_upper(product, out)
        return out
    for start in range(0, side, panel):
        stop = min(side, start + panel)
        block = out[start:stop, start:]
        # beta=0 makes BLAS ignore the uninitialised destination (NaNs included).
        torch.addmm(block, matrix[start:stop], matrix[start:].t(), beta=0.0, alpha=alpha, out=block)
        if stop < side:
            out[stop:, start:stop].copy_(out[start:stop, stop:].t())
    # The diagonal blocks, the full ones in one call: [t, p, t, p] -> its diagonal [t, p, p].
    full = side // panel
    square = out[: full * panel, : full * panel].unflatten(0, (full, panel))
    _mirror_upper(square.unflatten(2, (full, panel)).diagonal(dim1=0, dim2=2).movedim(-1, 0))
    _mirror_upper(out[full * panel :, full * panel :])
    return out


def second_moment(
    columns: Tensor,
    *,
    alpha: float,
    bias: bool,
    out_dtype: torch.dtype,
    scale: float = 1.0,
    panel: int | None = None,
) -> Tensor:
    """``alpha · c̄c̄ᵀ`` for the columns of ``columns`` (``[D, N]``), c̄ = [c, 1] with a bias.

    The product runs in ``columns``' dtype (a low-precision copy accumulates in fp32
    inside the GEMM and is rounded once); the result is a new ``[D(+1), D(+1)]`` tensor
    of ``out_dtype`` that aliases no workspace. The bias row and column come from row
    sums of ``columns``, so no ones row is appended.

    Args:
        columns: ``[D, N]`` with unit stride in one dimension (``rows.t()`` is fine).
        alpha: Scale of the product, e.g. ``1/N`` for a mean.
        bias: Append the bias row and column (``alpha·Σc`` and ``alpha·N``).
        out_dtype: dtype of the result.
        scale: ``columns`` holds ``scale·c`` (see :func:`input_scale`); undone exactly.
        panel: Panel height of :func:`gram_into`.
    """
    dim, count = columns.shape
    out = torch.empty(dim + int(bias), dim + int(bias), dtype=out_dtype, device=columns.device)
    main = out[:dim, :dim]
    product_alpha = alpha / (scale * scale)
    if columns.dtype == out_dtype:
        gram_into(columns, main, alpha=product_alpha, panel=panel)
    else:
        low = workspace("second_moment", (dim, dim), columns.dtype, columns.device)
        main.copy_(gram_into(columns, low, alpha=product_alpha, panel=panel))
    if bias:
        sums = columns.sum(dim=1, dtype=out_dtype).mul_(alpha / scale)
        out[:dim, dim] = sums
        out[dim, :dim] = sums
        out[dim, dim] = alpha * float(count)
    return out
