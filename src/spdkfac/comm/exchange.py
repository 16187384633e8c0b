"""The factor exchange: packs every layer's factors into buckets and all-reduces them.

Each rank contributes, for every registered factor slot, its local factor times its weight
(the number of examples it averages) as a packed upper triangle, plus the weight itself,
plus a flag saying the rank saw non-finite values. After a sum all-reduce every rank holds
``Σ_r w_r F_r`` and ``Σ_r w_r`` and divides: the example-weighted global average, the same
as single-process K-FAC on the concatenated batch. A rank that did not use a layer this
step sends zeros with weight 0, so the collectives never depend on local data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.futures import Future

from spdkfac.comm.base import Communicator
from spdkfac.linalg import pack_triu, packed_size, unpack_triu

__all__ = ["DEFAULT_BUCKET_CAP_BYTES", "ExchangeResult", "FactorExchange", "PendingExchange"]

DEFAULT_BUCKET_CAP_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class _Segment:
    key: str
    dim: int
    bucket: int
    offset: int

    @property
    def size(self) -> int:
        return packed_size(self.dim)


@dataclass(frozen=True)
class ExchangeResult:
    """What every rank holds after an exchange (identical on all ranks).

    Attributes:
        factors: Global example-weighted average per slot key, None when no rank had one.
        flagged_ranks: Number of ranks that reported non-finite local values.
    """

    factors: dict[str, Tensor | None]
    flagged_ranks: int


class PendingExchange:
    """In-flight all-reduces of one exchange; :meth:`wait` unpacks the result."""

    def __init__(
        self, futures: list[Future[Tensor]], layout: FactorExchange, buckets: list[Tensor]
    ) -> None:
        self._futures = futures
        self._layout = layout
        self._buckets = buckets

    def wait(self) -> ExchangeResult:
        """Block until every bucket is reduced; return the unpacked global factors."""
        for future in self._futures:
            future.wait()
        return self._layout.unpack(self._buckets)


class FactorExchange:
    """A fixed bucket layout over factor slots, identical on every rank.

    Args:
        communicator: The group to reduce over.
        slots: ``(key, dim)`` per factor, in registration order (replicated on all ranks).
        dtype: Dtype factors travel in.
        bucket_cap_bytes: Largest bucket; bigger factors get a bucket of their own.
    """

    def __init__(
        self,
        communicator: Communicator,
        slots: Sequence[tuple[str, int]],
        *,
        dtype: torch.dtype = torch.float32,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
    ) -> None:
        if bucket_cap_bytes < 1:
            raise ValueError(f"bucket_cap_bytes must be >= 1, got {bucket_cap_bytes}")
        self._communicator = communicator
        self._dtype = dtype
        self._keys = [key for key, _ in slots]
        cap = max(1, bucket_cap_bytes // torch.empty((), dtype=dtype).element_size())
        segments: list[_Segment] = []
        sizes: list[int] = [0]
        for key, dim in slots:
            size = packed_size(dim)
            if sizes[-1] and sizes[-1] + size > cap:
                sizes.append(0)
            segments.append(_Segment(key, dim, len(sizes) - 1, sizes[-1]))
            sizes[-1] += size
        # The weights and the non-finite flag ride at the end of the last bucket.
        self._meta_offset = sizes[-1]
        sizes[-1] += len(slots) + 1
        self._segments = segments
        self._bucket_sizes = sizes

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        """Elements per bucket (one all-reduce each)."""
        return tuple(self._bucket_sizes)

    def start(
        self, contributions: Mapping[str, tuple[Tensor, float]], *, flagged: bool = False
    ) -> PendingExchange:
        """Launch the all-reduces of this rank's contributions.

        Args:
            contributions: Slot key → (local averaged factor, weight); missing keys send
                zeros with weight 0.
            flagged: This rank saw non-finite values; every rank learns the count.
        """
        device = self._communicator.device
        buckets = [
            torch.zeros(size, dtype=self._dtype, device=device) for size in self._bucket_sizes
        ]
        meta = buckets[-1][self._meta_offset :]
        for index, segment in enumerate(self._segments):
            entry = contributions.get(segment.key)
            if entry is None:
                continue
            factor, weight = entry
            target = buckets[segment.bucket][segment.offset : segment.offset + segment.size]
            target.copy_(pack_triu(factor)).mul_(weight)
            meta[index] = weight
        meta[-1] = float(flagged)
        futures = [self._communicator.all_reduce_sum(bucket) for bucket in buckets]
        return PendingExchange(futures, self, buckets)

    def unpack(self, buckets: list[Tensor]) -> ExchangeResult:
        """Turn reduced buckets into per-slot weighted averages."""
        meta = buckets[-1][self._meta_offset :]
        factors: dict[str, Tensor | None] = {}
        for index, segment in enumerate(self._segments):
            weight = float(meta[index])
            if weight <= 0:
                factors[segment.key] = None
                continue
            packed = buckets[segment.bucket][segment.offset : segment.offset + segment.size]
            factors[segment.key] = unpack_triu(packed.div(weight), segment.dim)
        return ExchangeResult(factors=factors, flagged_ranks=round(float(meta[-1])))
