"""The inverse phase: each rank inverts what the plan gives it and broadcasts CT results."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.futures import Future

from spdkfac.comm import Communicator
from spdkfac.curvature import CurvatureBlock
from spdkfac.linalg import (
    InverseMethod,
    damped_inverse,
    inverse_dtype,
    pack_triu,
    packed_size,
    unpack_triu,
)
from spdkfac.placement import EVERY_RANK, Plan
from spdkfac.profiling import Phase, Profiler, span_name

__all__ = [
    "BroadcastGroup",
    "InverseOutcome",
    "InversePhase",
    "broadcast_groups",
    "invert_factors",
]


@dataclass(frozen=True)
class BroadcastGroup:
    """Inverses one owner sends in a single broadcast, as concatenated packed triangles."""

    owner: int
    keys: tuple[str, ...]
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        """Length of the concatenated packed buffer."""
        return sum(packed_size(dim) for dim in self.dims)


def broadcast_groups(
    plan: Plan, available: Mapping[str, object], min_group_elements: int = 0
) -> list[BroadcastGroup]:
    """Communicated factors grouped into broadcasts, in the order every rank issues them.

    Each owner's factors are taken in plan order and packed into groups of at least
    ``min_group_elements`` elements (0: one broadcast per factor, as in the SPD-KFAC paper;
    larger values save per-message start-up time when it dominates). Owners' groups are
    interleaved (first group of every rank, then second, …) so all ranks start computing
    at once and each broadcast is issued as soon as its owner can have it ready. Depends
    only on the plan and on which factors exist, both replicated on every rank.
    """
    per_owner: list[list[BroadcastGroup]] = [[] for _ in range(plan.world_size)]
    open_groups: list[list[tuple[str, int]]] = [[] for _ in range(plan.world_size)]
    for spec, owner in zip(plan.factors, plan.owners, strict=True):
        if owner == EVERY_RANK or spec.key not in available:
            continue
        members = open_groups[owner]
        members.append((spec.key, spec.dim))
        if sum(packed_size(dim) for _, dim in members) >= min_group_elements:
            per_owner[owner].append(_close(owner, members))
            open_groups[owner] = []
    for owner, members in enumerate(open_groups):
        if members:
            per_owner[owner].append(_close(owner, members))
    order: list[BroadcastGroup] = []
    for position in range(max((len(groups) for groups in per_owner), default=0)):
        order.extend(groups[position] for groups in per_owner if position < len(groups))
    return order


def _close(owner: int, members: list[tuple[str, int]]) -> BroadcastGroup:
    return BroadcastGroup(owner, tuple(key for key, _ in members), tuple(dim for _, dim in members))


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


def invert_factors(
    factors: Mapping[str, Tensor],
    plan: Plan,
    communicator: Communicator,
    damping: float,
    method: InverseMethod = "cholesky",
    *,
    previous: Mapping[str, Tensor | None] | None = None,
    min_group_elements: int = 0,
    profiler: Profiler | None = None,
) -> InverseOutcome:
    """Compute ``(F + γI)⁻¹`` for every factor, placed as ``plan`` says.

    ``factors`` must be identical on every rank (global factors after the exchange). The
    owner of a communicated factor inverts it and broadcasts the packed upper triangle
    asynchronously (grouped as :func:`broadcast_groups` says), so the broadcast overlaps
    its next inversion; other ranks post the receive at once. Non-communicated factors are
    inverted locally after every broadcast has been issued, overlapping the transfers.

    An inversion that fails (non-finite factor, or every fallback of
    :func:`~spdkfac.linalg.damped_inverse` failed) never skips a collective: the owner
    still sends (zeros) and, with more than one rank, one all-reduce of per-factor failure
    flags ends the phase, so every rank replaces the same factors by their ``previous``
    inverse.
    """
    rank = communicator.rank
    profiler = profiler or Profiler()
    keys = [spec.key for spec in plan.factors if spec.key in factors]
    failed_here: set[str] = set()

    def invert(key: str) -> Tensor | None:
        with profiler.span(span_name(Phase.INVERSE_COMPUTE, key)):
            try:
                return damped_inverse(factors[key], damping, method)
            except (ValueError, RuntimeError) as error:  # InversionError, LinAlgError, …
                failed_here.add(key)
                warnings.warn(
                    f"spdkfac: inverting {key} failed ({error}); keeping its previous inverse",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return None

    inverses: dict[str, Tensor | None] = {}
    if communicator.world_size == 1:
        inverses = {key: invert(key) for key in keys}
        return _outcome(inverses, failed_here, previous)
    pending: list[tuple[BroadcastGroup, Future[Tensor]]] = []
    for group in broadcast_groups(plan, factors, min_group_elements):
        dtype = inverse_dtype(factors[group.keys[0]].dtype)
        if group.owner == rank:
            for key in group.keys:
                inverses[key] = invert(key)
            with profiler.span(span_name(Phase.INVERSE_COMPUTE, "pack")):
                parts = [
                    pack_triu(inverse)
                    if (inverse := inverses[key]) is not None
                    else torch.zeros(packed_size(dim), dtype=dtype)
                    for key, dim in zip(group.keys, group.dims, strict=True)
                ]
                buffer = torch.cat(parts).to(device=communicator.device, dtype=dtype)
        else:
            buffer = torch.empty(group.elements, dtype=dtype, device=communicator.device)
        pending.append((group, communicator.broadcast(buffer, src=group.owner)))
    for spec, owner in zip(plan.factors, plan.owners, strict=True):
        if owner == EVERY_RANK and spec.key in factors:
            inverses[spec.key] = invert(spec.key)
    for group, future in pending:
        with profiler.span(span_name(Phase.INVERSE_COMM, "wait")):
            received = future.wait()
        if group.owner == rank:
            continue
        offset = 0
        for key, dim in zip(group.keys, group.dims, strict=True):
            size = packed_size(dim)
            inverses[key] = unpack_triu(received[offset : offset + size], dim).to(
                factors[key].device
            )
            offset += size
    failed: set[str] = set()
    if keys:  # the keys are replicated, so every rank skips this alike
        flags = torch.tensor(
            [float(key in failed_here) for key in keys], device=communicator.device
        )
        with profiler.span(span_name(Phase.INVERSE_COMM, "failures")):
            agreed = communicator.all_reduce_max(flags).wait().cpu().tolist()
        failed = {key for key, flag in zip(keys, agreed, strict=True) if flag > 0}
    return _outcome(inverses, failed, previous)


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
        method: ``"cholesky"`` or ``"eigen"``.
        min_group_elements: Broadcast grouping (see :func:`broadcast_groups`).
        max_failures: Consecutive inverse updates with a failed inversion tolerated.
        profiler: Where spans are recorded.
    """

    def __init__(
        self,
        plan: Plan,
        communicator: Communicator,
        method: InverseMethod,
        *,
        min_group_elements: int,
        max_failures: int,
        profiler: Profiler,
    ) -> None:
        self.plan = plan
        self._communicator = communicator
        self._method = method
        self._min_group_elements = min_group_elements
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
            self._method,
            previous=previous,
            min_group_elements=self._min_group_elements,
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
