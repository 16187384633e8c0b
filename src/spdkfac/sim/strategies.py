"""Strategies as the real run composes them, planned with the real planners.

A :class:`Strategy` is a fusion policy plus an inverse placement (``config.STRATEGIES``
and the benchmark's ablations). :func:`prepare` makes, for one workload, hardware and
world size, exactly the plans a real ``KFACPreconditioner`` would: the inverse
:class:`~spdkfac.placement.Plan` from :func:`~spdkfac.placement.plan_inversions`, the
broadcast grouping of :func:`~spdkfac.inversion.broadcast_groups` and the factor buckets
of :mod:`spdkfac.comm.fusion`; the ``optimal`` policy plans from the hand-over times the
compute-only timeline gives, as the real one plans from rank 0's measurements. DDP's
gradient buckets follow the order gradients become final, with its 1 MiB first bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

from spdkfac.comm.fusion import (
    FusionPlan,
    plan_after_backward,
    plan_layerwise,
    plan_optimal,
    plan_threshold,
)
from spdkfac.config import STRATEGIES
from spdkfac.inversion import BroadcastGroup, broadcast_groups
from spdkfac.linalg import packed_size
from spdkfac.placement import FactorSpec, Plan, plan_inversions
from spdkfac.sim.costs import WorkloadCosts
from spdkfac.sim.workload import FactorHook, GradReady, Op

__all__ = [
    "DEFAULT_STRATEGIES",
    "STRATEGY_TABLE",
    "Strategy",
    "StrategySetup",
    "parse_strategies",
    "prepare",
]


@dataclass(frozen=True)
class Strategy:
    """One optimizer configuration.

    Attributes:
        name: Key of :data:`STRATEGY_TABLE`.
        factor_exchange: Fusion policy (None: plain SGD, no K-FAC).
        placement: Inverse placement (None: plain SGD).
        fuse_broadcasts: Whether an owner's inverses share broadcasts.
        description: One line for reports.
    """

    name: str
    factor_exchange: str | None
    placement: str | None
    fuse_broadcasts: bool
    description: str

    @property
    def uses_kfac(self) -> bool:
        """False for the SGD baseline."""
        return self.factor_exchange is not None


def _composed(name: str, preset: str, exchange: str | None, description: str) -> Strategy:
    base = STRATEGIES[preset]
    return Strategy(
        name,
        exchange or base.factor_exchange,
        base.placement,
        base.fuse_broadcasts,
        description,
    )


#: Every strategy the simulator knows; names match ``spdkfac bench``'s variants.
STRATEGY_TABLE: dict[str, Strategy] = {
    "sgd": Strategy("sgd", None, None, False, "momentum SGD, no K-FAC"),
    "d-kfac": _composed("d-kfac", "d-kfac", None, "after-backward, replicated inverses"),
    "mpd-kfac": _composed("mpd-kfac", "mpd-kfac", None, "after-backward, round-robin inverses"),
    "spd-kfac": _composed("spd-kfac", "spd-kfac", None, "optimal fusion, balanced CT/NCT"),
    "placement-only": _composed(
        "placement-only", "spd-kfac", "after-backward", "SPD-KFAC placement, after-backward"
    ),
    "pipelining-only": _composed(
        "pipelining-only", "d-kfac", "optimal", "replicated inverses, optimal fusion"
    ),
    **{
        f"fusion:{policy}": _composed(
            f"fusion:{policy}", "spd-kfac", policy, f"SPD-KFAC placement, {policy} exchange"
        )
        for policy in ("after-backward", "layerwise", "threshold", "optimal")
    },
}
DEFAULT_STRATEGIES: tuple[str, ...] = (
    "d-kfac",
    "mpd-kfac",
    "spd-kfac",
    "placement-only",
    "pipelining-only",
)


def parse_strategies(text: str) -> tuple[str, ...]:
    """Strategy names from a comma list (duplicates dropped, order kept).

    Raises:
        ValueError: An unknown or missing name.
    """
    names: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item not in STRATEGY_TABLE:
            raise ValueError(f"unknown strategy {item!r}; choose from {', '.join(STRATEGY_TABLE)}")
        if item not in names:
            names.append(item)
    if not names:
        raise ValueError(f"expected at least one strategy, got {text!r}")
    return tuple(names)


@dataclass(frozen=True)
class StrategySetup:
    """The plans one strategy runs with.

    Attributes:
        strategy: The strategy.
        costs: Per-piece seconds of the workload.
        plan: Inverse placement (None for SGD).
        groups: Broadcasts of communicated inverses, in issue order.
        fusion: Factor buckets (None for SGD or one rank).
        grad_buckets: DDP's gradient buckets (parameter names), in launch order.
    """

    strategy: Strategy
    costs: WorkloadCosts
    plan: Plan | None
    groups: tuple[BroadcastGroup, ...]
    fusion: FusionPlan | None
    grad_buckets: tuple[tuple[str, ...], ...]


def _grad_buckets(costs: WorkloadCosts) -> tuple[tuple[str, ...], ...]:
    hardware = costs.hardware
    ready = [item for item in costs.workload.backward if isinstance(item, GradReady)]
    buckets: list[list[str]] = []
    size = 0
    for item in ready:
        cap = hardware.first_grad_bucket_bytes if len(buckets) <= 1 else hardware.grad_bucket_bytes
        nbytes = item.numel * 4
        if not buckets or (size and size + nbytes > cap):
            buckets.append([])
            size = 0
        buckets[-1].append(item.parameter)
        size += nbytes
    return tuple(tuple(bucket) for bucket in buckets)


def hand_over_times(costs: WorkloadCosts) -> tuple[list[float], list[float]]:
    """When each A (forward order) and G (hook order) is handed to the exchange, on a
    compute-only timeline (what the ``optimal`` policy measures during warm-up)."""
    now = 0.0
    a_ready: list[float] = []
    g_ready: list[float] = []
    workload = costs.workload
    for items, ready in ((workload.forward, a_ready), (workload.backward, g_ready)):
        for item in items:
            if isinstance(item, Op):
                now += costs.op(item)
            elif isinstance(item, FactorHook):
                now += costs.factor(workload.layer(item.layer), item.kind)
                ready.append(now)
    return a_ready, g_ready


def _fusion(costs: WorkloadCosts, policy: str) -> FusionPlan:
    workload = costs.workload
    a_order = [f"{layer.name}/A" for layer in workload.layers]
    g_order = [f"{name}/G" for name in workload.g_order]
    sizes = {
        f"{layer.name}/{kind}": packed_size(dim)
        for layer in workload.layers
        for kind, dim in (("A", layer.a_dim), ("G", layer.g_dim))
    }
    cap = max(1, costs.hardware.factor_bucket_bytes // 4)
    if policy == "after-backward":
        return plan_after_backward(a_order, g_order, sizes, cap)
    if policy == "layerwise":
        return plan_layerwise(a_order, g_order)
    if policy == "threshold":
        return plan_threshold(a_order, g_order, sizes, cap)
    if policy != "optimal":
        raise ValueError(f"unknown factor exchange {policy!r}")
    a_times, g_times = _first_hand_overs(costs)
    allreduce = costs.hardware.cost_model(costs.world_size).allreduce
    a_keys = sorted(a_order, key=lambda key: a_times[key])
    g_keys = sorted(g_order, key=lambda key: g_times[key])
    return plan_optimal(
        a_keys,
        g_keys,
        sizes,
        [a_times[key] - a_times[a_keys[0]] for key in a_keys],
        [g_times[key] - g_times[g_keys[0]] for key in g_keys],
        allreduce,
        4,
    )


def _first_hand_overs(costs: WorkloadCosts) -> tuple[dict[str, float], dict[str, float]]:
    a_ready, g_ready = hand_over_times(costs)
    workload = costs.workload
    a_hooks = [i.layer for i in workload.forward if isinstance(i, FactorHook)]
    g_hooks = [i.layer for i in workload.backward if isinstance(i, FactorHook)]
    # A layer called several times hands its factor over after its last call.
    a_times = {f"{name}/A": when for name, when in zip(a_hooks, a_ready, strict=True)}
    g_times = {f"{name}/G": when for name, when in zip(g_hooks, g_ready, strict=True)}
    for layer in workload.layers:
        a_times.setdefault(f"{layer.name}/A", max(a_ready, default=0.0))
        g_times.setdefault(f"{layer.name}/G", max(g_ready, default=0.0))
    return a_times, g_times


def prepare(costs: WorkloadCosts, strategy: Strategy, plan: Plan | None = None) -> StrategySetup:
    """Make the plans ``strategy`` runs with for ``costs``' workload and world size.

    ``plan`` replaces the strategy's inverse placement (for placements of your own; it
    must cover every factor of the workload for this world size).
    """
    world_size = costs.world_size
    grad_buckets = _grad_buckets(costs) if world_size > 1 else ()
    if not strategy.uses_kfac:
        return StrategySetup(strategy, costs, None, (), None, grad_buckets)
    assert strategy.placement is not None and strategy.factor_exchange is not None
    cost_model = costs.hardware.cost_model(world_size)
    specs: list[FactorSpec] = []
    for layer in costs.workload.layers:
        specs += [
            FactorSpec(layer.name, "A", layer.a_dim),
            FactorSpec(layer.name, "G", layer.g_dim),
        ]
    if plan is None:
        plan = plan_inversions(specs, world_size, strategy.placement, cost_model)
    elif plan.world_size != world_size or sorted(s.key for s in plan.factors) != sorted(
        s.key for s in specs
    ):
        raise ValueError("plan must cover every factor of the workload at this world size")
    groups: tuple[BroadcastGroup, ...] = ()
    fusion = None
    if world_size > 1:
        minimum = cost_model.broadcast_group_elements() if strategy.fuse_broadcasts else 0
        groups = tuple(broadcast_groups(plan, {spec.key: None for spec in specs}, minimum))
        fusion = _fusion(costs, strategy.factor_exchange)
    return StrategySetup(strategy, costs, plan, groups, fusion, grad_buckets)
