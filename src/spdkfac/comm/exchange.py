"""The factor exchange: packs factors into the buckets of a fusion plan and all-reduces them.

Each rank contributes, per factor slot, its local factor times its weight (the number of
examples it averages) as a packed upper triangle. Buckets launch strictly in plan order:
as soon as they are complete when the plan is eager (pipelined with the forward and
backward passes), else at :meth:`FactorExchange.finish`. ``finish`` then all-reduces one
small tensor with every slot's weight, a flag per slot for ranks whose factor grew after
it was added (a layer called more often than the collector expected: those slots are
re-exchanged, :attr:`ExchangeResult.revise`) and a flag for ranks whose gradients were not
finite. Every rank ends with ``Σ_r w_r F_r / Σ_r w_r``: the example-weighted global
average, the same as single-process K-FAC on the concatenated batch, still packed: running
averages are elementwise, so factors stay packed until (and only where) one is inverted.
A rank that did not use a layer, or whose tensor-parallel group left the layer's
statistics to another of its ranks, sends zeros with weight 0, so the collectives never
depend on local data or on the order hooks fire in.

With ``owners`` (Osawa et al. 2019, Sec. 3: ReduceScatterV), each bucket is laid out by
owner rank and reduce-scattered instead: a slot's global factor arrives at its owner
only, every other rank gets None for it (and keeps no copy). Slots owned by
``EVERY_RANK`` (a layer every rank preconditions, beside owned ones: the ``layer-paths``
strategy) sit after the owned ones and are all-reduced: a bucket holding both issues one
reduce-scatter and one all-reduce, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.futures import Future

from spdkfac.comm.base import Communicator
from spdkfac.linalg import all_finite, pack_triu, packed_size
from spdkfac.planning.fusion import FusionPlan

__all__ = ["DEFAULT_BUCKET_CAP_BYTES", "ExchangeResult", "FactorExchange", "PendingExchange"]

DEFAULT_BUCKET_CAP_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ExchangeResult:
    """What every rank holds after an exchange (identical on all ranks).

    Attributes:
        factors: Global example-weighted average per slot key as a packed upper triangle
            (:func:`~spdkfac.linalg.pack_triu`), None when no rank had one (or, with
            owners, where it went to another rank).
        flagged_ranks: Ranks that reported non-finite gradients.
        finite: Whether every reduced factor is finite (a NaN on any rank reaches all).
        revise: Slots some rank marked as grown after it added them (or added after their
            bucket left): their ``factors`` miss calls and must be exchanged again, by
            every rank (the set is agreed through the weights' all-reduce).
    """

    factors: dict[str, Tensor | None]
    flagged_ranks: int
    finite: bool
    revise: tuple[str, ...] = ()

    @property
    def usable(self) -> bool:
        """Whether the step's factors may be absorbed."""
        return self.flagged_ranks == 0 and self.finite


class PendingExchange:
    """The in-flight collectives of one step; :meth:`wait` gives the result."""

    def __init__(self, exchange: FactorExchange, futures: list[Future[Tensor]]) -> None:
        self._exchange = exchange
        self._futures = futures

    def wait(self) -> ExchangeResult:
        """Block until every bucket and the weights are reduced; scale the factors."""
        self.wait_transfers()
        return self.result()

    def wait_transfers(self) -> None:
        """Block until every bucket and the weights are reduced."""
        for future in self._futures:
            future.wait()

    def result(self) -> ExchangeResult:
        """Each factor's average from the reduced sums (after :meth:`wait_transfers`)."""
        return self._exchange._result()


class FactorExchange:
    """Buckets of a :class:`FusionPlan` over factor slots, identical on every rank.

    Use per step: :meth:`add` each slot's factor when it is final (from a hook, or at the
    step), then :meth:`finish` once, then ``wait()`` on what it returns.

    Args:
        communicator: The group to reduce over (a dedicated one when buckets launch from
            hooks, so they never interleave with DDP's gradient all-reduces).
        slots: ``(key, dim)`` per factor slot.
        plan: Which slots travel together, and when.
        dtype: Dtype of the reduced factors.
        comm_dtype: Dtype factors travel in (e.g. ``torch.bfloat16``); default ``dtype``.
        owners: Owner rank per slot key: reduce-scatter each bucket to the owners instead
            of all-reducing it (None: all-reduce).
    """

    def __init__(
        self,
        communicator: Communicator,
        slots: Sequence[tuple[str, int]],
        plan: FusionPlan,
        *,
        dtype: torch.dtype = torch.float32,
        comm_dtype: torch.dtype | None = None,
        owners: Mapping[str, int] | None = None,
    ) -> None:
        self._communicator = communicator
        if owners is not None:
            missing = sorted(key for key, _ in slots if key not in owners)
            if missing:
                raise ValueError(f"owners: no owner rank for factor slots {missing}")
            owners = {key: owners[key] for key, _ in slots}
        self._owners = owners
        self._dims = dict(slots)
        self._index = {key: index for index, (key, _) in enumerate(slots)}
        self._dtype = dtype
        self._comm_dtype = comm_dtype or dtype
        # Per slot its weight, then per slot whether it grew here, then the bad-rank flag.
        self._weights = torch.zeros(
            2 * len(slots) + 1, dtype=torch.float64, device=communicator.device
        )
        self._futures: list[Future[Tensor]] = []
        self._added: set[str] = set()
        #: Slots added after their bucket was flushed, this step (ignored; see :meth:`flush`).
        self.late: set[str] = set()
        self.replan(plan)

    @property
    def plan(self) -> FusionPlan:
        """The fusion plan in use."""
        return self._plan

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        """Elements per bucket (one all-reduce each)."""
        return tuple(buffer.numel() for buffer in self._buffers)

    def replan(self, plan: FusionPlan) -> None:
        """Switch to another plan (between steps only: every rank must do it alike)."""
        if self._added or self._futures:
            raise RuntimeError("replan() must not be called while a step is in flight")
        if sorted(plan.slots) != sorted(self._dims):
            raise ValueError("the fusion plan must cover exactly the exchange's slots")
        self._plan = plan
        self._location: dict[str, tuple[int, int]] = {}
        self._buffers: list[Tensor] = []
        # With owners, per bucket: elements per owner (its chunk of the reduce-scatter).
        self._chunks: list[list[int]] = []
        self._received: dict[int, Future[Tensor]] = {}
        world = self._communicator.world_size
        for bucket_index, bucket in enumerate(plan.buckets):
            offset = 0
            owners = self._owners
            chunks = [0] * world
            # Laid out by owner (stable), so each owner's slots form one chunk; the slots
            # every rank receives (EVERY_RANK, -1) last.
            for key in bucket if owners is None else sorted(bucket, key=self._position):
                self._location[key] = (bucket_index, offset)
                offset += packed_size(self._dims[key])
                if owners is not None and owners[key] >= 0:
                    chunks[owners[key]] += packed_size(self._dims[key])
            self._chunks.append(chunks)
            device = self._communicator.device
            self._buffers.append(torch.zeros(offset, dtype=self._comm_dtype, device=device))
        self._missing = [len(bucket) for bucket in plan.buckets]
        self._next = 0

    def _position(self, key: str) -> int:
        """Layout order of an owned slot: its owner's rank, every rank's slots last."""
        assert self._owners is not None
        owner = self._owners[key]
        return owner if owner >= 0 else self._communicator.world_size

    def add(self, key: str, factor: Tensor | None, weight: float) -> bool:
        """Contribute this rank's final factor for ``key`` this step (None: nothing from
        this rank, zeros with weight 0, e.g. a factor another rank of a tensor-parallel
        group forms).

        Returns:
            False when ``key`` was already added this step (the call is ignored).
        """
        if key in self._added:
            return False
        if not self._added and not self._futures:
            self._begin()
        self._added.add(key)
        bucket, offset = self._location[key]
        if bucket < self._next:  # launched already (flushed): counts with weight 0
            self.late.add(key)
            return True
        if factor is not None:  # else the zeroed buffer stays, weight 0
            size = packed_size(self._dims[key])
            target = self._buffers[bucket][offset : offset + size]
            target.copy_(pack_triu(factor).mul_(weight) if weight != 1 else pack_triu(factor))
            self._weights[self._index[key]] = weight
        self._missing[bucket] -= 1
        if self._plan.eager:
            self._launch_ready()
        return True

    @property
    def in_step(self) -> bool:
        """Whether a factor of this step was added or a bucket launched."""
        return bool(self._added or self._futures)

    def flush(self, upto: int) -> None:
        """Launch every bucket up to index ``upto`` now, with what it has: slots not added
        yet count with weight 0, as at :meth:`finish` (a communication scheduler's
        deadline; added later, they are ignored this step and listed in :attr:`late`)."""
        if not self.in_step:
            self._begin()
        while self._next <= min(upto, len(self._buffers) - 1):
            self._launch(self._next)

    def is_added(self, key: str) -> bool:
        """Whether ``key`` was contributed this step."""
        return key in self._added

    def finish(self, *, local_ok: bool = True, grown: Iterable[str] = ()) -> PendingExchange:
        """Launch every bucket not yet launched, then the weights and the flags.

        Args:
            local_ok: False when this rank's gradients or statistics are not finite.
            grown: Slots whose factor on this rank changed after it was added (extra
                calls); with the slots in :attr:`late`, they come back in
                :attr:`ExchangeResult.revise` on every rank.
        """
        if not self._added and not self._futures:
            self._begin()
        while self._next < len(self._buffers):
            self._launch(self._next)
        count = len(self._index)
        for key in {*grown, *self.late}:
            self._weights[count + self._index[key]] = 1.0
        self._weights[-1] = 0.0 if local_ok else 1.0
        futures = [*self._futures, self._communicator.all_reduce_sum(self._weights)]
        self._futures = []
        self._added = set()
        return PendingExchange(self, futures)

    def _begin(self) -> None:
        self.late = set()
        for buffer in self._buffers:
            buffer.zero_()
        self._weights.zero_()
        self._missing = [len(bucket) for bucket in self._plan.buckets]
        self._next = 0

    def _launch_ready(self) -> None:
        while self._next < len(self._buffers) and self._missing[self._next] == 0:
            self._launch(self._next)

    def _launch(self, index: int) -> None:
        buffer = self._buffers[index]
        if self._owners is None:
            self._futures.append(self._communicator.all_reduce_sum(buffer))
        else:
            owned = sum(self._chunks[index])
            if owned:
                pieces = list(buffer[:owned].split(self._chunks[index]))
                future = self._communicator.reduce_scatter(pieces)
                self._received[index] = future
                self._futures.append(future)
            if owned < buffer.numel():  # the slots every rank receives, summed in place
                self._futures.append(self._communicator.all_reduce_sum(buffer[owned:]))
        self._next = index + 1

    def _reduced(self, key: str) -> Tensor | None:
        """The summed packed slot, or None where it did not arrive (another owner's)."""
        bucket, offset = self._location[key]
        size = packed_size(self._dims[key])
        if self._owners is None or self._owners[key] < 0:
            return self._buffers[bucket][offset : offset + size]
        rank = self._communicator.rank
        if self._owners[key] != rank:
            return None
        start = offset - sum(self._chunks[bucket][:rank])  # offset within this rank's chunk
        return self._received[bucket].value()[start : start + size]

    def _result(self) -> ExchangeResult:
        weights = self._weights.cpu().tolist()
        factors: dict[str, Tensor | None] = {}
        arrived: list[Tensor] = []
        for key in self._location:
            weight = weights[self._index[key]]
            packed = self._reduced(key)
            if weight <= 0 or packed is None:
                factors[key] = None
                continue
            # A new tensor per factor: the buckets are zeroed and reused by the next step.
            # (Dividing a whole bucket at once was measured slower on the CPU: one large
            # fresh allocation per step instead of many recycled ones.)
            if packed.dtype == self._dtype:
                factor = packed.div(weight)
            else:
                factor = packed.to(self._dtype).div_(weight)
            arrived.append(factor)
            factors[key] = factor
        finite = all_finite(arrived)
        self._received = {}
        if self._owners is not None:  # each rank saw its own factors only: agree
            flag = torch.tensor([0.0 if finite else 1.0], device=self._communicator.device)
            finite = float(self._communicator.all_reduce_max(flag).wait()) == 0.0
        count = len(self._index)
        revise = tuple(key for key in self._location if weights[count + self._index[key]] > 0)
        return ExchangeResult(
            factors=factors, flagged_ranks=round(weights[-1]), finite=finite, revise=revise
        )
