"""The pipelined factor exchange: factors go out as hooks produce them, fused by a policy.

:class:`FactorPipeline` owns the :class:`~spdkfac.comm.exchange.FactorExchange` of a
preconditioner and its fusion policy. Hooks hand it each factor when it is final for the
step; it records when (hand-over times are what the ``optimal`` policy plans from) and the
exchange launches complete buckets in plan order. For ``optimal`` it measures during
``warmup_steps`` factor steps with a threshold plan, then every rank builds the same Eq.
15 plan from rank 0's measurements (one broadcast); :meth:`request_replan` repeats that.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from spdkfac.comm.base import Communicator
from spdkfac.comm.exchange import DEFAULT_BUCKET_CAP_BYTES, ExchangeResult, FactorExchange
from spdkfac.comm.fusion import (
    FACTOR_EXCHANGES,
    FusionPlan,
    plan_after_backward,
    plan_layerwise,
    plan_optimal,
    plan_threshold,
)
from spdkfac.costmodel import AlphaBetaModel
from spdkfac.linalg import packed_size
from spdkfac.profiling import Profiler, span_name

__all__ = ["FactorPipeline"]

_KEPT_STEPS = 10


class FactorPipeline:
    """Factor slots of every registered layer, exchanged as the policy says.

    Args:
        communicator: The group factors are averaged over.
        layers: Registered layer names with their (A, G) dims, in registration order.
        policy: One of :data:`~spdkfac.comm.fusion.FACTOR_EXCHANGES`.
        allreduce: All-reduce cost model the ``optimal`` policy plans with.
        bucket_cap_bytes: Bucket cap of ``threshold`` and ``after-backward``.
        warmup_steps: Factor steps measured before the ``optimal`` plan is made.
        dtype: Dtype of the reduced factors.
        comm_dtype: Dtype factors travel in (None: ``dtype``).
        profiler: Where waits are recorded.
    """

    def __init__(
        self,
        communicator: Communicator,
        layers: Sequence[tuple[str, int, int]],
        policy: str,
        *,
        allreduce: AlphaBetaModel,
        bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
        warmup_steps: int = 5,
        dtype: torch.dtype = torch.float32,
        comm_dtype: torch.dtype | None = None,
        profiler: Profiler | None = None,
    ) -> None:
        if policy not in FACTOR_EXCHANGES:
            raise ValueError(f"factor_exchange must be one of {FACTOR_EXCHANGES}, got {policy!r}")
        self._communicator = communicator
        self._policy = policy
        self._allreduce = allreduce
        self._warmup_steps = warmup_steps
        self._profiler = profiler or Profiler()
        self._element_bytes = torch.empty((), dtype=comm_dtype or dtype).element_size()
        self._cap = max(1, bucket_cap_bytes // self._element_bytes)
        self._a_keys = [f"{name}/A" for name, _, _ in layers]
        self._g_keys = [f"{name}/G" for name, _, _ in reversed(layers)]
        dims = {f"{name}/A": a for name, a, _ in layers} | {f"{name}/G": g for name, _, g in layers}
        self._sizes = {key: packed_size(dim) for key, dim in dims.items()}
        self._exchange = FactorExchange(
            communicator,
            [(key, dims[key]) for key in self._a_keys + self._g_keys],
            self._initial_plan(),
            dtype=dtype,
            comm_dtype=comm_dtype,
        )
        self._factor_steps = 0
        self._replan_requested = False
        self._current: dict[str, float] = {}
        self._history: list[dict[str, float]] = []

    @property
    def plan(self) -> FusionPlan:
        """The fusion plan in use."""
        return self._exchange.plan

    def _initial_plan(self) -> FusionPlan:
        if self._policy == "after-backward":
            return plan_after_backward(self._a_keys, self._g_keys, self._sizes, self._cap)
        if self._policy == "layerwise":
            return plan_layerwise(self._a_keys, self._g_keys)
        # threshold, and optimal until it has measurements
        return plan_threshold(self._a_keys, self._g_keys, self._sizes, self._cap)

    def hand_over(self, key: str, factor: torch.Tensor, weight: float) -> bool:
        """Give the exchange this rank's final factor for ``key`` (from a hook).

        Returns:
            False when ``key`` was already handed over this step (ignored).
        """
        if self._exchange.is_added(key):
            return False
        self._current[key] = time.perf_counter()
        return self._exchange.add(key, factor, weight)

    def is_handed_over(self, key: str) -> bool:
        """Whether ``key`` was handed over this step."""
        return self._exchange.is_added(key)

    def finish(self, *, local_ok: bool) -> ExchangeResult:
        """Launch what is left, wait for everything, and (re)plan when due.

        Collective: every rank calls it once per factor step.
        """
        pending = self._exchange.finish(local_ok=local_ok)
        with self._profiler.span(span_name("factor_comm", "wait")):
            try:
                pending.wait_transfers()
            except RuntimeError as error:  # a peer died or stalled past the group's timeout
                raise RuntimeError(
                    f"spdkfac: the K-FAC factor all-reduce ({self._policy} buckets) failed on "
                    f"rank {self._communicator.rank} of {self._communicator.world_size}: "
                    f"{error}"
                ) from error
            # Unpacking is host work inside the wait (the breakdown counts it as
            # FactorComm either way); its own span lets a profile tell it from waiting.
            with self._profiler.span(span_name("factor_comm", "unpack")):
                result = pending.unpack()
        self._factor_steps += 1
        if self._current:
            self._history = [*self._history[-(_KEPT_STEPS - 1) :], self._current]
        self._current = {}
        due = self._policy == "optimal" and self._factor_steps == self._warmup_steps
        if due or self._replan_requested:
            self._replan_requested = False
            self._replan()
        return result

    def request_replan(self) -> None:
        """Re-plan from fresh measurements at the end of the next factor step.

        Call it on every rank at the same step (it leads to a collective).
        """
        self._replan_requested = True

    def _replan(self) -> None:
        """Every rank builds the same plan from rank 0's measured hand-over times."""
        if self._policy != "optimal":
            return
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
        plan = plan_optimal(
            order[:count_a],
            order[count_a:],
            self._sizes,
            ready[:count_a],
            ready[count_a:],
            self._allreduce,
            self._element_bytes,
        )
        self._exchange.replan(plan)

    def _measured(self, keys: Sequence[str]) -> tuple[list[str], list[float]]:
        """Keys by median hand-over offset (from each step's first), unseen ones last."""
        offsets: dict[str, list[float]] = {}
        for record in self._history:
            times = [record[k] for k in keys if k in record]
            if not times:
                continue
            origin = min(times)
            for key in keys:
                if key in record:
                    offsets.setdefault(key, []).append(record[key] - origin)
        medians = {key: statistics.median(values) for key, values in offsets.items()}
        seen = sorted(medians, key=lambda key: medians[key])
        latest = max(medians.values(), default=0.0)
        unseen = [key for key in keys if key not in medians]
        return seen + unseen, [medians[k] for k in seen] + [latest] * len(unseen)
