"""Index bookkeeping of the correlation method: which correlations make which A block.

Pure integer work that depends only on the geometry, done once and cached: for every
block of kernel offsets (p, q), p ≤ q, the window of first positions is the whole image
minus border strips plus their corners (inclusion-exclusion), and each piece is a
correlation over a rectangle at one shift. Pieces that cannot be non-zero (the second
position leaves the image) are dropped, so each border strip is computed only at the few
shifts it needs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from torch import Tensor

from spdkfac.layers.geometry import Conv2dGeometry, Pair

__all__ = [
    "CorrelationPlan",
    "StripGroup",
    "Term",
    "correlation_plan",
    "window_coverage",
]

# A rectangle of first positions: (row start, row stop, column start, column stop).
Region = tuple[int, int, int, int]


@dataclass(frozen=True)
class Term:
    """Correlations over ``region`` at shifts (a·dh, b·dw) for (a, b) in ``shifts``.

    A border strip's shifts fill the rectangle ``a_range × b_range`` (row-major), which
    its batched gather computes anyway; the whole image computes only the shifts needed.
    """

    region: Region
    shifts: tuple[Pair, ...]

    @property
    def a_range(self) -> Pair:
        return (min(a for a, _ in self.shifts), max(a for a, _ in self.shifts))

    @property
    def b_range(self) -> Pair:
        return (min(b for _, b in self.shifts), max(b for _, b in self.shifts))

    @property
    def area(self) -> int:
        return (self.region[1] - self.region[0]) * (self.region[3] - self.region[2])

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Rows, columns, a count, b count: terms of equal shape are batched together."""
        (a0, a1), (b0, b1) = self.a_range, self.b_range
        rows, cols = self.region[1] - self.region[0], self.region[3] - self.region[2]
        return (rows, cols, a1 - a0 + 1, b1 - b0 + 1)


@dataclass(frozen=True)
class StripGroup:
    """Border terms of one shape (rows, columns, a count, b count), one batched product.

    Each term's region starts at ``origins[t]`` (row, column) of the image; its shifts
    are (a·dh, b·dw) for a from ``a0`` and b from ``b0``. Results fill stacked rows
    ``start .. start + terms·shifts``, term by term, shifts row-major. ``grid`` =
    (row count, row step, column count, column step) when the origins, in order, are
    that grid from ``origins[0]``; ``own_shift`` is the index of shift (0, 0), if any.
    """

    start: int
    shape: tuple[int, int, int, int]
    a0: int
    b0: int
    origins: tuple[Pair, ...]
    grid: tuple[int, int, int, int] | None
    own_shift: int | None

    @property
    def terms(self) -> int:
        return len(self.origins)

    @property
    def shifts(self) -> int:
        return self.shape[2] * self.shape[3]


def _grid(origins: list[Pair]) -> tuple[int, int, int, int] | None:
    """(row count, row step, column count, column step) if the sorted origins are a grid."""
    rows = sorted({r for r, _ in origins})
    cols = sorted({c for _, c in origins})
    if len(rows) * len(cols) != len(origins):
        return None
    row_step = rows[1] - rows[0] if len(rows) > 1 else 0
    col_step = cols[1] - cols[0] if len(cols) > 1 else 0
    if rows != [rows[0] + i * row_step for i in range(len(rows))]:
        return None
    if cols != [cols[0] + j * col_step for j in range(len(cols))]:
        return None
    return (len(rows), row_step, len(cols), col_step)


class _Piece(NamedTuple):
    """``sign`` times the correlation over ``region`` at shift (a, b), part of one block."""

    region: Region
    sign: int
    a: int
    b: int


@dataclass(frozen=True)
class CorrelationPlan:
    """Everything about one geometry that does not depend on the data."""

    whole: Term | None  # the whole-image term (one convolution), in stacked rows 0..
    groups: tuple[StripGroup, ...]
    rows: int  # stacked rows, the last one all zeros
    initial: Tensor  # [blocks] stacked row each block starts from
    plus: tuple[Tensor, Tensor]  # (block, stacked row) pairs to add
    minus: tuple[Tensor, Tensor]  # (block, stacked row) pairs to subtract
    first: Tensor  # [blocks] kernel offset p = u·kw + v of the block's rows
    second: Tensor  # [blocks] kernel offset q >= p of its columns; p == q blocks first
    diagonal: int  # number of blocks with p == q
    corners: Tensor  # [4, kh·kw] integral-image indices of each window's corners


def _clip(value: int, high: int) -> int:
    return min(max(value, 0), high)


def _plan_key(geometry: Conv2dGeometry) -> Conv2dGeometry:
    """``geometry`` with every field the plan does not depend on fixed: its cache key.

    A plan depends only on the size, the kernel, the padding and the dilation: one plan
    (one cache entry) serves every batch, channel count, bias and dtype.
    """
    return replace(
        geometry,
        batch=1,
        channels=1,
        stride=(1, 1),
        bias=False,
        compute_dtype=torch.float32,
        device_type="cpu",
    )


def _windows(geometry: Conv2dGeometry) -> list[list[Pair]]:
    """Per dimension, the first positions (clipped to the image) of each kernel offset,
    at stride 1."""
    size, kernel_size = geometry.size, geometry.kernel_size
    padding, dilation = geometry.padding, geometry.dilation
    out = replace(geometry, stride=(1, 1)).output_size
    return [
        [
            (
                _clip(k * dilation[d] - padding[d], size[d]),
                _clip(k * dilation[d] - padding[d] + out[d], size[d]),
            )
            for k in range(kernel_size[d])
        ]
        for d in range(2)
    ]


def _pieces(
    size: Pair, windows: list[list[Pair]], dilation: Pair, kw: int, p: int, q: int
) -> list[_Piece]:
    """Inclusion-exclusion of block (p, q)'s window, minus pieces that are always zero."""
    height, width = size
    (u, v), (u2, v2) = divmod(p, kw), divmod(q, kw)
    a, b = u2 - u, v2 - v
    (r0, r1), (c0, c1) = windows[0][u], windows[1][v]
    pieces = []
    for (top, bottom), row_sign in (((0, height), 1), ((0, r0), -1), ((r1, height), -1)):
        for (left, right), col_sign in (((0, width), 1), ((0, c0), -1), ((c1, width), -1)):
            if top >= bottom or left >= right:
                continue
            # The second position leaves the image for every first one: the piece is 0.
            if top + a * dilation[0] >= height:
                continue
            if left + b * dilation[1] >= width or right - 1 + b * dilation[1] < 0:
                continue
            pieces.append(_Piece((top, bottom, left, right), row_sign * col_sign, a, b))
    return pieces


def correlation_plan(geometry: Conv2dGeometry, device: torch.device) -> CorrelationPlan:
    """The plan of the correlation method for ``geometry``, as if at stride 1 (cached).

    Strip origins are (row, column) of the image; shifts may reach past its bottom and
    right edges and, for b < 0, left of it: the caller's buffer must read zeros there.
    Its index tensors are on ``device``.
    """
    return _cached_plan(_plan_key(geometry), device)


def _block_pairs(kernel_offsets: int) -> list[Pair]:
    """Every block (p, q), p ≤ q, of kernel offsets: the diagonal blocks first."""
    return sorted(
        ((p, q) for p in range(kernel_offsets) for q in range(p, kernel_offsets)),
        key=lambda pq: pq[0] != pq[1],
    )


def _terms(blocks: list[list[_Piece]], whole_region: Region) -> list[Term]:
    """The correlations the blocks' pieces need, one term per region.

    The whole image computes only the shifts its pieces need; a border strip computes the
    rectangle of shifts around them, which its batched gather computes anyway.
    """
    needed: dict[Region, list[Pair]] = {}
    for pieces in blocks:
        for piece in pieces:
            needed.setdefault(piece.region, []).append((piece.a, piece.b))
    terms = []
    for region, shifts in needed.items():
        if region == whole_region:
            terms.append(Term(region, tuple(sorted(set(shifts)))))
            continue
        a_values, b_values = [a for a, _ in shifts], [b for _, b in shifts]
        rectangle = [
            (a, b)
            for a in range(min(a_values), max(a_values) + 1)
            for b in range(min(b_values), max(b_values) + 1)
        ]
        terms.append(Term(region, tuple(rectangle)))
    return terms


class _Layout(NamedTuple):
    """Where each term's correlations lie in the stacked rows."""

    whole: Term | None  # in rows 0 .. len(whole.shifts)
    groups: list[StripGroup]  # then the strips, group by group
    starts: dict[Region, int]  # first stacked row of each term
    rows: int  # stacked rows used (the all-zero row comes next)


def _layout(terms: list[Term], whole_region: Region) -> _Layout:
    """The whole-image term first, then the strips; strips of one shape whose shifts start
    at the same (a, b) share one batched product (a group), in grid order."""
    whole = next((t for t in terms if t.region == whole_region), None)
    starts: dict[Region, int] = {}
    row = 0
    if whole is not None:
        starts[whole.region] = 0
        row = len(whole.shifts)
    by_shape: dict[tuple[int, int, int, int, int, int], list[Term]] = {}
    for term in terms:
        if term is not whole:
            key = (*term.shape, term.a_range[0], term.b_range[0])
            by_shape.setdefault(key, []).append(term)
    groups = []
    for key, members in by_shape.items():
        members.sort(key=lambda term: (term.region[0], term.region[2]))  # grid order
        group_start = row
        for term in members:
            starts[term.region] = row
            row += len(term.shifts)
        origins = [(term.region[0], term.region[2]) for term in members]
        own = (0, 0) in members[0].shifts
        own_shift = members[0].shifts.index((0, 0)) if own else None
        group = StripGroup(
            group_start, key[:4], key[4], key[5], tuple(origins), _grid(origins), own_shift
        )
        groups.append(group)
    return _Layout(whole, groups, starts, row)


def _assembly(
    blocks: list[list[_Piece]], terms: list[Term], layout: _Layout
) -> tuple[list[int], list[Pair], list[Pair]]:
    """Each block's first stacked row (the all-zero row if it has no positive piece), and
    the (block, stacked row) pairs to add and to subtract."""
    by_region = {term.region: term for term in terms}

    def stacked_row(piece: _Piece) -> int:
        start = layout.starts[piece.region]
        return start + by_region[piece.region].shifts.index((piece.a, piece.b))

    initial: list[int] = []
    plus: list[Pair] = []
    minus: list[Pair] = []
    for index, pieces in enumerate(blocks):
        head = next((piece for piece in pieces if piece.sign > 0), None)
        initial.append(layout.rows if head is None else stacked_row(head))
        for piece in pieces:
            if piece is not head:
                (plus if piece.sign > 0 else minus).append((index, stacked_row(piece)))
    return initial, plus, minus


def _corners(windows: list[list[Pair]], width: int) -> list[int]:
    """Integral-image indices of each window's corners: bottom-right, top-right,
    bottom-left, top-left, each over every kernel offset."""
    corners: list[list[int]] = [[], [], [], []]
    for r0, r1 in windows[0]:
        for c0, c1 in windows[1]:
            for bucket, (r, c) in zip(
                corners, ((r1, c1), (r0, c1), (r1, c0), (r0, c0)), strict=True
            ):
                bucket.append(r * (width + 1) + c)
    return [i for bucket in corners for i in bucket]


@functools.lru_cache(maxsize=256)
def _cached_plan(geometry: Conv2dGeometry, device: torch.device) -> CorrelationPlan:
    """:func:`correlation_plan` for a geometry already reduced to its cache key."""
    size, (kh, kw) = geometry.size, geometry.kernel_size
    windows = _windows(geometry)
    pairs = _block_pairs(kh * kw)
    blocks = [_pieces(size, windows, geometry.dilation, kw, p, q) for p, q in pairs]
    whole_region = (0, size[0], 0, size[1])
    terms = _terms(blocks, whole_region)
    layout = _layout(terms, whole_region)
    initial, plus, minus = _assembly(blocks, terms, layout)

    def tensor(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    def pair_tensors(values: list[Pair]) -> tuple[Tensor, Tensor]:
        return tensor([d for d, _ in values]), tensor([s for _, s in values])

    return CorrelationPlan(
        whole=layout.whole,
        groups=tuple(layout.groups),
        rows=layout.rows + 1,
        initial=tensor(initial),
        plus=pair_tensors(plus),
        minus=pair_tensors(minus),
        first=tensor([p for p, _ in pairs]),
        second=tensor([q for _, q in pairs]),
        diagonal=sum(1 for p, q in pairs if p == q),
        corners=tensor(_corners(windows, size[1])).view(4, -1),
    )


def window_coverage(geometry: Conv2dGeometry) -> float:
    """The smallest window of first positions as a fraction of the image (1 for 'same'),
    at stride 1.

    The method subtracts border strips from whole-image sums, so rounding errors of
    those sums grow by up to the inverse of this; it matters for bf16/fp16 products.
    """
    size = geometry.size
    windows = _windows(geometry)
    rows = min(stop - start for start, stop in windows[0]) / size[0]
    cols = min(stop - start for start, stop in windows[1]) / size[1]
    return rows * cols
