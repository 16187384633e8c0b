"""The inverse phase: each rank inverts what the plan gives it and broadcasts CT results."""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.futures import Future

from spdkfac.comm import Communicator
from spdkfac.curvature import CurvatureBlock
from spdkfac.forms import DampedInverse, InverseForm
from spdkfac.linalg import batch_capacity, inverse_dtype, unpack_triu
from spdkfac.planning.broadcasts import BroadcastGroup, broadcast_groups
from spdkfac.planning.placement import EVERY_RANK, Plan
from spdkfac.profiling import Phase, Profiler, span_name

__all__ = [
    "InverseOutcome",
    "InversePhase",
    "ResultDelivery",
    "invert_factors",
]


@dataclass(frozen=True)
class InverseOutcome:
    """Result of an inverse phase, identical on every rank.

    Attributes:
        inverses: Factor key → damped inverse. A factor whose inversion failed on any rank
            maps to its previous inverse, or is absent when it had none.
        failed: Keys whose inversion failed on some rank (agreed by an all-reduce).
    """

    inverses: dict[str, Tensor]
    failed: frozenset[str]


@dataclass(frozen=True)
class ResultDelivery:
    """How the placed inversions' results reach the ranks that apply them.

    Attributes:
        min_group_elements: Broadcast grouping of communicated results
            (:func:`~spdkfac.planning.broadcasts.broadcast_groups`; 0: one per factor).
        owners_keep: Owners keep their results and nothing is broadcast (Osawa et al.'s
            owner-computes exchange).
    """

    min_group_elements: int = 0
    owners_keep: bool = False


def invert_factors(
    factors: Mapping[str, Tensor],
    plan: Plan,
    communicator: Communicator,
    damping: float,
    form: InverseForm | None = None,
    *,
    previous: Mapping[str, Tensor | None] | None = None,
    delivery: ResultDelivery = ResultDelivery(),
    profiler: Profiler | None = None,
) -> InverseOutcome:
    """Compute every factor's result in ``form`` (default: ``(F + γI)⁻¹`` by Cholesky),
    placed as ``plan`` says.

    ``factors`` must be identical on every rank (global factors after the exchange), each
    a full ``[d, d]`` matrix or its packed upper triangle; a packed factor is unpacked
    only on a rank that inverts it, straight into a batch of same-sized factors inverted
    in one call (:meth:`~spdkfac.forms.InverseForm.compute_batch`). The owner of a
    communicated factor inverts it (batched with its broadcast group's other members) and
    broadcasts the result in the form's wire format asynchronously (grouped as
    :func:`~spdkfac.planning.broadcasts.broadcast_groups` says), so the broadcast overlaps
    its next inversions; other ranks post the receive at once. Non-communicated factors
    are inverted locally, batched, after every broadcast has been issued, overlapping the
    transfers. Batches are formed from replicated facts only, so every rank computes a
    non-communicated inverse alike.

    An inversion that fails (non-finite factor, or every fallback of
    :func:`~spdkfac.linalg.damped_inverse` failed) never skips a collective: the owner
    still sends (zeros) and, with more than one rank, one all-reduce of per-factor failure
    flags ends the phase, so every rank replaces the same factors by their ``previous``
    inverse.

    With ``delivery.owners_keep`` (Osawa et al.'s owner-computes exchange) the factors of
    the plan's ``owner_layers`` are held by their owners only: each owner inverts its own
    and keeps them, nothing of theirs is broadcast; the other factors (a ``layer-paths``
    plan's replicated layers) are placed and broadcast as above. The failure flags then
    cover every factor of the plan, so the all-reduce is the same on every rank.
    """
    profiler = profiler or Profiler()
    keys = [spec.key for spec in plan.factors if spec.key in factors]
    dims = {spec.key: spec.dim for spec in plan.factors}
    invert = _Inverter(factors, dims, damping, form or DampedInverse("cholesky"), profiler)
    if communicator.world_size == 1:
        invert(keys)
        return _outcome(invert.inverses, invert.failed, previous)
    kept = {s.key for s in plan.factors if delivery.owners_keep and s.layer in plan.owner_layers}
    shared = {key: factor for key, factor in factors.items() if key not in kept}
    groups = broadcast_groups(plan, shared, delivery.min_group_elements, invert.form.wire_size)
    pending = _send_and_post(groups, invert, communicator)
    # The owners' own and the non-communicated ones overlap the broadcasts.
    invert(
        [
            spec.key
            for spec, owner in zip(plan.factors, plan.owners, strict=True)
            if spec.key in factors and (spec.key in kept or owner == EVERY_RANK)
        ]
    )
    _receive(pending, invert, communicator.rank, profiler)
    # The keys are replicated (factors are, but for the owners' own), so every rank
    # issues this alike.
    agreed = [spec.key for spec in plan.factors] if kept else keys
    failed = _agree_failures(communicator, agreed, invert.failed, profiler)
    return _outcome(invert.inverses, failed, previous)


def _send_and_post(
    groups: Sequence[BroadcastGroup], invert: _Inverter, communicator: Communicator
) -> list[tuple[BroadcastGroup, Future[Tensor]]]:
    """Each group's broadcast, in order: its owner inverts and sends (zeros for a failed
    member), the others post the receive."""
    form, factors = invert.form, invert.factors
    pending: list[tuple[BroadcastGroup, Future[Tensor]]] = []
    for group in groups:
        dtype = form.dtype or inverse_dtype(factors[group.keys[0]].dtype)
        if group.owner == communicator.rank:
            invert(group.keys)
            with invert.profiler.span(span_name(Phase.INVERSE_COMPUTE, "pack")):
                parts = [
                    form.pack(inverse).to(dtype)
                    if (inverse := invert.inverses[key]) is not None
                    else torch.zeros(size, dtype=dtype)
                    for key, size in zip(group.keys, group.sizes, strict=True)
                ]
                buffer = torch.cat(parts).to(device=communicator.device, dtype=dtype)
        else:
            buffer = torch.empty(group.elements, dtype=dtype, device=communicator.device)
        pending.append((group, communicator.broadcast(buffer, src=group.owner)))
    return pending


def _receive(
    pending: Sequence[tuple[BroadcastGroup, Future[Tensor]]],
    invert: _Inverter,
    rank: int,
    profiler: Profiler,
) -> None:
    """Wait for every broadcast and unpack the results this rank did not compute."""
    for group, future in pending:
        with profiler.span(span_name(Phase.INVERSE_COMM, "wait")):
            received = future.wait()
        if group.owner == rank:
            continue
        offset = 0
        for key, dim, size in zip(group.keys, group.dims, group.sizes, strict=True):
            piece = received[offset : offset + size]
            invert.inverses[key] = invert.form.unpack(piece, dim).to(invert.factors[key].device)
            offset += size


class _Inverter:
    """The inversions of one inverse phase on this rank: same-sized factors in batched
    calls, each packed factor unpacked straight into its batch (the only place a running
    factor is unpacked), failures recorded.

    A member whose batched attempt fails is computed alone by
    :meth:`~spdkfac.forms.InverseForm.compute` (its fallbacks and warnings); when that fails
    too, it is recorded in :attr:`failed` with a warning and maps to None.
    """

    def __init__(
        self,
        factors: Mapping[str, Tensor],
        dims: Mapping[str, int],
        damping: float,
        form: InverseForm,
        profiler: Profiler,
    ) -> None:
        self.factors = factors
        self._dims = dims
        self._damping = damping
        self.form = form
        self.profiler = profiler
        self.inverses: dict[str, Tensor | None] = {}
        self.failed: set[str] = set()

    def __call__(self, keys: Sequence[str]) -> None:
        """Invert ``keys``: batches of one dimension, dtype and device (at most
        :func:`~spdkfac.linalg.batch_capacity` each), in first-seen order."""
        batches: dict[tuple[int, torch.dtype, torch.device], list[str]] = {}
        for key in keys:
            factor = self.factors[key]
            kind = (self._dims[key], inverse_dtype(factor.dtype), factor.device)
            batches.setdefault(kind, []).append(key)
        for (dim, dtype, device), members in batches.items():
            capacity = batch_capacity(dim, dtype)
            for start in range(0, len(members), capacity):
                self._batch(members[start : start + capacity], dim, dtype, device)

    def _batch(
        self, members: list[str], dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        start = time.perf_counter()
        stack = torch.empty(len(members), dim, dim, dtype=dtype, device=device)
        for matrix, key in zip(stack, members, strict=True):
            factor = self.factors[key]
            if factor.dim() == 1 and factor.dtype == dtype:
                unpack_triu(factor, dim, out=matrix)
            else:
                matrix.copy_(factor if factor.dim() == 2 else unpack_triu(factor, dim))
        try:
            first = self.form.compute_batch(stack, self._damping)
        except (ValueError, RuntimeError):  # e.g. a bad damping: each member reports it
            first = [None] * len(members)
        if self.profiler.enabled:
            # Per-factor spans (what the simulator's profiled costs read): equal shares of
            # the batch, whose members have the same size.
            share = (time.perf_counter() - start) / len(members)
            for position, key in enumerate(members):
                begin = start + position * share
                name = span_name(Phase.INVERSE_COMPUTE, key)
                self.profiler.record(name, begin, begin + share)
        for key, inverse in zip(members, first, strict=True):
            result = inverse if inverse is not None else self._alone(key, dim)
            self.inverses[key] = None if result is None else self.form.stored(result)

    def _alone(self, key: str, dim: int) -> Tensor | None:
        factor = self.factors[key]
        with self.profiler.span(span_name(Phase.INVERSE_COMPUTE, key)):
            try:
                full = unpack_triu(factor, dim) if factor.dim() == 1 else factor
                return self.form.compute(full, self._damping)
            except (ValueError, RuntimeError) as error:  # InversionError, LinAlgError, …
                self.failed.add(key)
                warnings.warn(
                    f"spdkfac: inverting {key} failed ({error}); keeping its previous inverse",
                    RuntimeWarning,
                    stacklevel=5,  # invert_factors' caller
                )
                return None


def _agree_failures(
    communicator: Communicator, keys: Sequence[str], failed_here: set[str], profiler: Profiler
) -> set[str]:
    """The keys whose inversion failed on some rank (one all-reduce; none without keys)."""
    if not keys:
        return set()
    flags = torch.tensor([float(key in failed_here) for key in keys], device=communicator.device)
    with profiler.span(span_name(Phase.INVERSE_COMM, "failures")):
        agreed = communicator.all_reduce_max(flags).wait().cpu().tolist()
    return {key for key, flag in zip(keys, agreed, strict=True) if flag > 0}


def _outcome(
    inverses: Mapping[str, Tensor | None],
    failed: set[str],
    previous: Mapping[str, Tensor | None] | None,
) -> InverseOutcome:
    result: dict[str, Tensor] = {}
    for key, inverse in inverses.items():
        chosen = (previous or {}).get(key) if key in failed else inverse
        if chosen is not None:
            result[key] = chosen
    return InverseOutcome(inverses=result, failed=frozenset(failed))


class InversePhase:
    """The inverse phase of a preconditioner: placed inversions, then each block's own.

    Args:
        plan: Where each placed factor is inverted.
        communicator: The group.
        form: What is computed from each factor (the ``inverse_method``'s form).
        delivery: How results reach the ranks that apply them.
        max_failures: Consecutive inverse updates with a failed inversion tolerated.
        profiler: Where spans are recorded.
    """

    def __init__(
        self,
        plan: Plan,
        communicator: Communicator,
        form: InverseForm,
        *,
        delivery: ResultDelivery,
        max_failures: int,
        profiler: Profiler,
    ) -> None:
        self.plan = plan
        self._delivery = delivery
        self._communicator = communicator
        self.form = form
        self._max_failures = max_failures
        self._profiler = profiler
        self._failures = 0

    def run(self, blocks: Sequence[CurvatureBlock], damping: float) -> None:
        """Invert every block's factors with damping ``damping``.

        Collective (the same on every rank: factors are replicated after the exchange).

        Raises:
            RuntimeError: After more than ``max_failures`` consecutive failed updates.
        """
        factors: dict[str, Tensor] = {}
        previous: dict[str, Tensor | None] = {}
        for block in blocks:
            factors.update(block.placed_factors())
            previous.update(block.previous_inverses())
        outcome = invert_factors(
            factors,
            self.plan,
            self._communicator,
            damping,
            self.form,
            previous=previous,
            delivery=self._delivery,
            profiler=self._profiler,
        )
        # Blocks take their placed inverses and compute any closed-form ones of their own.
        with self._profiler.span(span_name(Phase.INVERSE_COMPUTE, "local")):
            for block in blocks:
                block.update_inverses(outcome.inverses, damping)
        # The failure set is agreed by every rank, so this counter is replicated state.
        self._failures = self._failures + 1 if outcome.failed else 0
        if self._failures > self._max_failures:
            raise RuntimeError(
                f"spdkfac: inverting factors failed on {self._failures} consecutive "
                f"inverse updates (max_inverse_failures={self._max_failures}); "
                f"last failures: {sorted(outcome.failed)}"
            )
