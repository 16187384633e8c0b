"""The factor exchange of a preconditioner: pipelined over a group, immediate in a group of one.

:class:`FactorPipeline` owns the :class:`~spdkfac.comm.exchange.FactorExchange` of a
preconditioner and its fusion policy. Hooks hand it each factor when it is final for the
step; it records when (hand-over times are what a measured policy such as ``optimal``
plans from) and the exchange launches complete buckets in plan order. A measured policy
runs its unmeasured plan during ``warmup_steps`` factor steps, then every rank builds the
same plan from rank 0's measurements (one broadcast); :meth:`request_replan` repeats that.
:class:`LocalFactorExchange` has the same interface for a group of one, where nothing
travels: the collector has one code path whatever the world size.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from spdkfac.comm.base import Communicator
from spdkfac.comm.exchange import DEFAULT_BUCKET_CAP_BYTES, ExchangeResult, FactorExchange
from spdkfac.comm.scheduler import CommScheduler
from spdkfac.costmodel import AlphaBetaModel
from spdkfac.linalg import packed_size
from spdkfac.planning.fusion import FusionInputs, FusionPlan, FusionPolicy
from spdkfac.profiling import Phase, Profiler, span_name

__all__ = ["ExchangeSettings", "FactorPipeline", "FactorRoute", "LocalFactorExchange"]

_KEPT_STEPS = 10


@dataclass(frozen=True)
class FactorRoute:
    """What a composition decides about the factor exchange: its fusion policy, the group
    buckets travel on, to whom, and who orders them.

    Attributes:
        fusion: The fusion policy (:data:`~spdkfac.planning.fusion.FUSION_POLICIES`).
        group: The group factors are averaged over (a pipelined policy's own duplicate,
            or a scheduler's factor stream).
        allreduce: All-reduce cost model a measured policy such as ``optimal`` plans with.
        owners: Owner rank per slot (reduce-scatter to owners; None: all-reduce).
        scheduler: The communication scheduler ``group`` hands its calls to
            (``comm_scheduler="priority"``; None: none).
    """

    fusion: FusionPolicy
    group: Communicator
    allreduce: AlphaBetaModel
    owners: Mapping[str, int] | None = None
    scheduler: CommScheduler | None = None


@dataclass(frozen=True, kw_only=True)
class ExchangeSettings:
    """The options of a factor exchange, the same for every composition.

    Attributes:
        bucket_cap_bytes: Bucket cap of ``threshold`` and ``after-backward``.
        warmup_steps: Factor steps measured before a measured plan is made.
        comm_dtype: Dtype factors travel in (None: the reduced factors' dtype).
    """

    bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES
    warmup_steps: int = 5
    comm_dtype: torch.dtype | None = None


class FactorPipeline:
    """Factor slots of every registered layer, exchanged as the route's policy says.

    Args:
        route: The fusion policy, group, owners and scheduler.
        forward_slots: ``(key, dim)`` of the slots produced in the forward pass (A
            factors), in forward (registration) order.
        backward_slots: Likewise for the backward pass (G factors), in backward order.
        settings: Bucket cap, warm-up steps and wire dtype.
        dtype: Dtype of the reduced factors.
        profiler: Where waits are recorded.
    """

    def __init__(
        self,
        route: FactorRoute,
        forward_slots: Sequence[tuple[str, int]],
        backward_slots: Sequence[tuple[str, int]],
        *,
        settings: ExchangeSettings = ExchangeSettings(),
        dtype: torch.dtype = torch.float32,
        profiler: Profiler | None = None,
    ) -> None:
        self._communicator = communicator = route.group
        self._scheduler = scheduler = route.scheduler
        self._warned_late = False
        self._policy = policy = route.fusion
        self._warmup_steps = settings.warmup_steps
        self._profiler = profiler or Profiler()
        comm_dtype = settings.comm_dtype
        self._element_bytes = torch.empty((), dtype=comm_dtype or dtype).element_size()
        self._a_keys = [key for key, _ in forward_slots]
        self._g_keys = [key for key, _ in backward_slots]
        dims = dict(forward_slots) | dict(backward_slots)
        self._dims = dims
        self._order = {key: i for i, key in enumerate(self._a_keys + self._g_keys)}
        self._owners = route.owners
        self._dtype = dtype
        self._comm_dtype = comm_dtype
        self._inputs = FusionInputs(
            a_order=tuple(self._a_keys),
            g_order=tuple(self._g_keys),
            sizes={key: packed_size(dim) for key, dim in dims.items()},
            bucket_cap_elements=max(1, settings.bucket_cap_bytes // self._element_bytes),
            allreduce=route.allreduce,
            bytes_per_element=self._element_bytes,
        )
        self._exchange = FactorExchange(
            communicator,
            [(key, dims[key]) for key in self._a_keys + self._g_keys],
            policy.plan(self._inputs),
            dtype=dtype,
            comm_dtype=comm_dtype,
            owners=route.owners,
        )
        if scheduler is not None:
            scheduler.reset()
        self._factor_steps = 0
        self._replan_requested = False
        self._current: dict[str, float] = {}
        self._history: list[dict[str, float]] = []

    #: Factors may be handed over from hooks, as soon as they are final.
    pipelined = True

    @property
    def plan(self) -> FusionPlan:
        """The fusion plan in use."""
        return self._exchange.plan

    @property
    def settled(self) -> bool:
        """Whether :attr:`plan` is final: a measured policy has planned from measurements."""
        return not self._policy.measured or self._factor_steps >= self._warmup_steps

    def hand_over(
        self, key: str, factor: torch.Tensor | None, weight: float, *, in_pass: bool = True
    ) -> bool:
        """Give the exchange this rank's final factor for ``key`` (from a hook, or at the
        step with ``in_pass=False``; None with weight 0: another rank forms it). The first
        hand-over of a pass opens the scheduler's window.

        Returns:
            False when ``key`` was already handed over this step (ignored).
        """
        if self._exchange.is_added(key):
            return False
        if in_pass and self._scheduler is not None and not self._exchange.in_step:
            self._scheduler.open_window(self._exchange.bucket_sizes)
        self._current[key] = time.perf_counter()
        return self._exchange.add(key, factor, weight)

    def is_handed_over(self, key: str) -> bool:
        """Whether ``key`` was handed over this step."""
        return self._exchange.is_added(key)

    @property
    def window_planned(self) -> bool:
        """Whether this pass's buckets follow the communication scheduler's schedule."""
        return self._scheduler is not None and self._scheduler.planned

    def flush(self) -> None:
        """Launch every bucket now, with what it has (the end of a scheduled pass: slots
        not handed over count with weight 0, as at :meth:`finish`)."""
        self._exchange.flush(len(self._exchange.bucket_sizes) - 1)

    def finish(self, *, local_ok: bool, grown: Iterable[str] = ()) -> ExchangeResult:
        """Launch what is left, wait for everything, and (re)plan when due.

        Collective: every rank calls it once per factor step. ``grown``: slots whose factor
        grew here after its hand-over (extra calls); every rank gets them, with those any
        rank handed over after their bucket left, in :attr:`ExchangeResult.revise`: then
        every rank calls :meth:`revise`.
        """
        if self._scheduler is not None:
            self._scheduler.end_of_gradients()
        pending = self._exchange.finish(local_ok=local_ok, grown=grown)
        with self._profiler.span(span_name(Phase.FACTOR_COMM, "wait")):
            try:
                pending.wait_transfers()
            except RuntimeError as error:  # a peer died or stalled past the group's timeout
                raise RuntimeError(
                    f"spdkfac: the K-FAC factor all-reduce ({self._policy.name} buckets) failed on "
                    f"rank {self._communicator.rank} of {self._communicator.world_size}: "
                    f"{error}"
                ) from error
            # Scaling the packed sums and checking them is host work inside the wait (the
            # breakdown counts it as FactorComm either way); its own span lets a profile
            # tell it from waiting. The span keeps the name it had when this unpacked every
            # factor: the simulator's profiled costs read it under that name.
            with self._profiler.span(span_name(Phase.FACTOR_COMM, "unpack")):
                result = pending.result()
        self._after_schedule()
        self._factor_steps += 1
        if self._current:
            self._history = [*self._history[-(_KEPT_STEPS - 1) :], self._current]
        self._current = {}
        due = self._policy.measured and self._factor_steps == self._warmup_steps
        if due or self._replan_requested:
            self._replan_requested = False
            self._replan()
            if self._scheduler is not None:
                self._scheduler.reset()  # the buckets may change: record them again
        scheduler = self._scheduler
        if scheduler is not None and self.settled and scheduler.plan_due():
            scheduler.plan(self._communicator)  # a collective, at the same step everywhere
        return result

    def revise(self, contributions: Mapping[str, tuple[Tensor | None, float]]) -> ExchangeResult:
        """Exchange again the slots of :attr:`ExchangeResult.revise`, from this rank's
        complete factor and weight per slot (None: nothing captured here). Collective:
        every rank calls it with the same keys, after :meth:`finish` returned them; one
        bucket and its weights, outside any scheduler window."""
        keys = sorted(contributions, key=self._order.__getitem__)
        owners = self._owners
        exchange = FactorExchange(
            self._communicator,
            [(key, self._dims[key]) for key in keys],
            FusionPlan("revision", (tuple(keys),), eager=False),
            dtype=self._dtype,
            comm_dtype=self._comm_dtype,
            owners=None if owners is None else {key: owners[key] for key in keys},
        )
        for key in keys:
            factor, weight = contributions[key]
            if factor is not None:
                exchange.add(key, factor, weight)
        with self._profiler.span(span_name(Phase.FACTOR_COMM, "revision")):
            return exchange.finish().wait()

    def _after_schedule(self) -> None:
        """Close the scheduler's window (warn once about factors it launched too early)."""
        late = sorted(self._exchange.late)
        if late and not self._warned_late:
            self._warned_late = True
            warnings.warn(
                f"spdkfac: comm_scheduler='priority' launched the buckets of {late} before "
                "these factors were ready (the schedule expected them earlier); they were "
                "exchanged again after the step's buckets, an extra collective. Re-plan "
                "with precond.retune() if the model's passes changed",
                RuntimeWarning,
                stacklevel=4,
            )
        if self._scheduler is not None:
            self._scheduler.close_window()

    def request_replan(self) -> None:
        """Re-plan from fresh measurements at the end of the next factor step.

        Call it on every rank at the same step (it leads to a collective).
        """
        self._replan_requested = True

    def _replan(self) -> None:
        """Every rank builds the same plan from rank 0's measured hand-over times."""
        if not self._policy.measured:
            return
        busy: tuple[tuple[float, float], ...] = ()
        if self._scheduler is not None and self._policy.around_gradients:
            busy = self._scheduler.gradient_busy(self._communicator)  # a collective
        a_order, a_ready = self._measured(self._a_keys)
        g_order, g_ready = self._measured(self._g_keys)
        index = {key: i for i, key in enumerate(self._a_keys + self._g_keys)}
        local = torch.tensor(
            [index[k] for k in a_order + g_order] + a_ready + g_ready, dtype=torch.float64
        )
        shared = self._communicator.broadcast(local.to(self._communicator.device), src=0)
        values = shared.wait().cpu().tolist()
        keys = self._a_keys + self._g_keys
        count_a, count = len(self._a_keys), len(keys)
        order = [keys[round(i)] for i in values[:count]]
        ready = values[count:]
        measured = replace(
            self._inputs,
            a_order=tuple(order[:count_a]),
            g_order=tuple(order[count_a:]),
            a_ready=tuple(ready[:count_a]),
            g_ready=tuple(ready[count_a:]),
            busy=busy,
            chunk_elements=None if self._scheduler is None else self._scheduler.chunk_elements,
        )
        self._exchange.replan(self._policy.plan(measured))

    def _measured(self, keys: Sequence[str]) -> tuple[list[str], list[float]]:
        """Keys by median hand-over offset from each step's first hand-over (the
        scheduler's window start: the clock of its gradient calls), unseen ones last."""
        offsets: dict[str, list[float]] = {}
        for record in self._history:
            if not any(k in record for k in keys):
                continue
            origin = min(record.values())
            for key in keys:
                if key in record:
                    offsets.setdefault(key, []).append(record[key] - origin)
        medians = {key: statistics.median(values) for key, values in offsets.items()}
        seen = sorted(medians, key=lambda key: medians[key])
        latest = max(medians.values(), default=0.0)
        unseen = [key for key in keys if key not in medians]
        return seen + unseen, [medians[k] for k in seen] + [latest] * len(unseen)


class LocalFactorExchange:
    """The exchange of a group of one: each handed-over mean is already the global factor.

    Same interface as :class:`FactorPipeline`; no copy, no collective, and no packing:
    factors are handed back as the full matrices they were captured as, so the running
    averages of a group of one stay full. Packing them would cost more than it saves: a
    pack of every new factor at every factor step (more than the half of the average it
    saves) and an unpack at every inversion (``benchmarks/reports/cheaper_step.md``).
    Nothing is gained by handing factors over early, so callers hand them over at the
    step, when every pass of the step has been averaged in.
    """

    pipelined = False
    #: Nothing to plan, nothing to schedule.
    settled = True
    window_planned = False

    def __init__(self) -> None:
        self._factors: dict[str, Tensor | None] = {}

    @property
    def plan(self) -> FusionPlan | None:
        """None: nothing is exchanged."""
        return None

    def hand_over(
        self, key: str, factor: Tensor | None, weight: float, *, in_pass: bool = True
    ) -> bool:
        """Keep ``factor`` as the step's global factor of ``key``; False when repeated."""
        if key in self._factors:
            return False
        self._factors[key] = factor
        return True

    def is_handed_over(self, key: str) -> bool:
        """Whether ``key`` was handed over this step."""
        return key in self._factors

    def finish(self, *, local_ok: bool, grown: Iterable[str] = ()) -> ExchangeResult:
        """The handed-over factors, full (the caller checked they are finite in
        ``local_ok``)."""
        factors, self._factors = self._factors, {}
        return ExchangeResult(factors=factors, flagged_ranks=0 if local_ok else 1, finite=True)

    def flush(self) -> None:
        """Nothing travels."""

    def revise(self, contributions: Mapping[str, tuple[Tensor | None, float]]) -> ExchangeResult:
        """Never needed: factors are handed over at the step, complete."""
        raise RuntimeError("a group of one never re-exchanges factors")

    def request_replan(self) -> None:
        """Nothing to plan in a group of one."""
