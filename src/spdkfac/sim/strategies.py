"""Strategies as the real run composes them, planned with the real planners.

A :class:`~spdkfac.strategies.Strategy` is a row of the one strategy table (a fusion
policy plus an inverse placement), shared with the preconditioner and ``spdkfac bench``;
:func:`selection` resolves a name (``"auto"`` through
:attr:`~spdkfac.config.KFACConfig.selection`, an :class:`~spdkfac.strategies.AutoStrategy`).
:func:`prepare` makes, for one workload, hardware and world size, exactly the plans a
real ``KFACPreconditioner`` would: the inverse :class:`~spdkfac.planning.placement.Plan` of
the workload's factors (its blocks' ``inverse_specs``, priced in its inverse form) from
:func:`~spdkfac.planning.placement.plan_inversions`, the row's broadcast grouping (in the
form's wire size) and the factor buckets of :mod:`spdkfac.planning.fusion`; the
``optimal`` policy plans from the hand-over times the compute-only timeline gives, as the
real one plans from rank 0's measurements. DDP's
gradient buckets follow the order gradients become final, with its 1 MiB first bucket.

A row with ``owner_computes`` (Osawa et al. 2019) is planned the same way with its own
placement policy (:func:`~spdkfac.planning.placement.plan_layer_owners`: one owner per layer) and
has no inverse broadcasts; :attr:`StrategySetup.layer_owners` says which rank owns each
layer.

``comm_scheduler`` (:mod:`spdkfac.sim.window`) plans the backward window's order with the
runtime's planner: :attr:`StrategySetup.window` (None: ``"fifo"``, or no window).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import cast

from spdkfac.config import KFACConfig
from spdkfac.linalg import packed_size
from spdkfac.planning.broadcasts import BroadcastGroup
from spdkfac.planning.fusion import FusionInputs, FusionPlan, FusionPolicy
from spdkfac.planning.placement import EVERY_RANK, Plan, plan_inversions
from spdkfac.planning.schedule import CommSchedule
from spdkfac.sim.costs import WorkloadCosts
from spdkfac.sim.window import window_policy
from spdkfac.sim.workload import FactorHook, GradReady, Op
from spdkfac.strategies import SGD, STRATEGIES, STRATEGY_NAMES, AutoStrategy, Strategy
from spdkfac.types import StrategyName

__all__ = [
    "DEFAULT_STRATEGIES",
    "SELECTION_NAMES",
    "STRATEGY_TABLE",
    "Strategy",
    "StrategySetup",
    "factor_memory_bytes",
    "parse_strategies",
    "plan_summary",
    "prepare",
    "selection",
]

#: Every strategy row the simulator knows: SGD and the rows of the one strategy table
#: (names match ``spdkfac bench``'s variants).
#: ``layer-paths`` (each layer's gradient path by the cost model) is not modelled yet.
STRATEGY_TABLE: dict[str, Strategy] = {
    SGD.name: SGD,
    **{name: row for name, row in STRATEGIES.items() if not row.final.chooses_paths},
}
#: Every name :func:`selection` takes: the rows, and the ``strategy=`` values that are
#: no row (``"auto"``).
SELECTION_NAMES: tuple[str, ...] = (
    *STRATEGY_TABLE,
    *(name for name in STRATEGY_NAMES if name not in STRATEGIES),
)
DEFAULT_STRATEGIES: tuple[str, ...] = (
    "d-kfac",
    "mpd-kfac",
    "spd-kfac",
    "placement-only",
    "pipelining-only",
)


def selection(strategy: str | Strategy | AutoStrategy) -> Strategy | AutoStrategy:
    """What a strategy name selects: a row of :data:`STRATEGY_TABLE`, or what the
    ``strategy=`` option makes of it (:attr:`~spdkfac.config.KFACConfig.selection`:
    ``"auto"`` is an :class:`~spdkfac.strategies.AutoStrategy` of its default candidates).
    A row or an ``AutoStrategy`` is returned as it is.

    Raises:
        ValueError: An unknown name.
    """
    if not isinstance(strategy, str):
        return strategy
    if strategy in STRATEGY_TABLE:
        return STRATEGY_TABLE[strategy]
    if strategy not in SELECTION_NAMES:
        raise ValueError(f"unknown strategy {strategy!r}")
    return KFACConfig(strategy=cast(StrategyName, strategy)).selection


def parse_strategies(text: str) -> tuple[str, ...]:
    """Strategy names from a comma list (duplicates dropped, order kept).

    Raises:
        ValueError: An unknown or missing name.
    """
    names: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item not in SELECTION_NAMES:
            known = ", ".join(SELECTION_NAMES)
            raise ValueError(f"unknown strategy {item!r}; choose from {known}")
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
        layer_owners: For an owner-computes strategy on more than one rank, layer name →
            the rank that owns it (from ``plan``); empty otherwise.
        comm_scheduler: How the backward window's collectives are ordered
            (:data:`~spdkfac.sim.window.WINDOW_POLICIES`).
        window: The order of factor steps' gradient and factor chunks (None: none planned,
            the buckets go as with ``"fifo"``).
    """

    strategy: Strategy
    costs: WorkloadCosts
    plan: Plan | None
    groups: tuple[BroadcastGroup, ...]
    fusion: FusionPlan | None
    grad_buckets: tuple[tuple[str, ...], ...]
    layer_owners: Mapping[str, int] = field(default_factory=dict)
    comm_scheduler: str = "fifo"
    window: CommSchedule | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_owners", MappingProxyType(dict(self.layer_owners)))

    @property
    def owner_computes(self) -> bool:
        """Owners invert and precondition their layers (Osawa et al.), on > 1 rank."""
        return bool(self.layer_owners)

    def owned_layers(self, rank: int) -> tuple[str, ...]:
        """The layers ``rank`` owns, in forward order (every layer when nobody owns)."""
        layers = self.costs.workload.layers
        if not self.layer_owners:
            return tuple(layer.name for layer in layers)
        return tuple(layer.name for layer in layers if self.layer_owners[layer.name] == rank)

    def parameter_owner(self, parameter: str) -> int | None:
        """The owner of ``parameter``'s layer (``"<layer>.<name>"``); None when its
        module has no owner (a norm layer) or nobody owns layers."""
        return self.layer_owners.get(parameter.rpartition(".")[0])


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


def _fusion(
    costs: WorkloadCosts,
    policy: FusionPolicy,
    busy: tuple[tuple[float, float], ...] = (),
    chunk_elements: int | None = None,
) -> FusionPlan:
    workload = costs.workload
    a_order = tuple(f"{layer.name}/A" for layer in workload.layers)
    g_order = tuple(f"{name}/G" for name in workload.g_order)
    sizes = {
        f"{layer.name}/{kind}": packed_size(dim)
        for layer in workload.layers
        for kind, dim in (("A", layer.a_dim), ("G", layer.g_dim))
    }
    inputs = FusionInputs(
        a_order=a_order,
        g_order=g_order,
        sizes=sizes,
        bucket_cap_elements=max(1, costs.hardware.factor_bucket_bytes // 4),
        allreduce=costs.hardware.cost_model(costs.world_size).allreduce,
        bytes_per_element=4,
    )
    if not policy.measured:
        return policy.plan(inputs)
    # Measured policies plan from the hand-over times of the compute-only timeline, as
    # the real one plans from rank 0's measurements: from the step's first hand-over,
    # the clock of ``busy`` (which counts from the forward pass's start) too.
    a_times, g_times = _hand_overs_by_key(costs)
    a_keys = tuple(sorted(a_order, key=lambda key: a_times[key]))
    g_keys = tuple(sorted(g_order, key=lambda key: g_times[key]))
    origin = min((*a_times.values(), *g_times.values()), default=0.0)
    return policy.plan(
        replace(
            inputs,
            a_order=a_keys,
            g_order=g_keys,
            a_ready=tuple(a_times[key] - origin for key in a_keys),
            g_ready=tuple(g_times[key] - origin for key in g_keys),
            busy=tuple((start - origin, end - origin) for start, end in busy),
            chunk_elements=chunk_elements,
        )
    )


def _hand_overs_by_key(costs: WorkloadCosts) -> tuple[dict[str, float], dict[str, float]]:
    """When each A and G factor is complete on the compute-only timeline, by slot key."""
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


def prepare(
    costs: WorkloadCosts,
    strategy: Strategy,
    plan: Plan | None = None,
    *,
    comm_scheduler: str = "fifo",
) -> StrategySetup:
    """Make the plans ``strategy`` runs with for ``costs``' workload and world size.

    ``plan`` replaces the strategy's inverse placement (for placements of your own; it
    must cover every factor of the workload for this world size). ``comm_scheduler``
    orders the backward window (:mod:`spdkfac.sim.window`).

    Raises:
        ValueError: A plan that does not fit, or an unknown ``comm_scheduler``.
    """
    if strategy.final.chooses_paths:
        raise ValueError(
            f"strategy={strategy.name!r}: the simulator does not model per-layer gradient paths yet"
        )
    scheduler = window_policy(comm_scheduler)
    world_size = costs.world_size
    grad_buckets = _grad_buckets(costs) if world_size > 1 else ()
    if not strategy.uses_kfac:
        return StrategySetup(
            strategy, costs, None, (), None, grad_buckets, comm_scheduler=comm_scheduler
        )
    assert strategy.placement_policy is not None and strategy.fusion is not None
    cost_model = costs.hardware.cost_model(world_size)
    specs = costs.workload.factors
    if plan is None:
        plan = plan_inversions(specs, world_size, strategy.placement_policy, cost_model)
    elif plan.world_size != world_size or sorted(s.key for s in plan.factors) != sorted(
        s.key for s in specs
    ):
        raise ValueError("plan must cover every factor of the workload at this world size")
    groups: tuple[BroadcastGroup, ...] = ()
    fusion = None
    owners: dict[str, int] = {}
    if world_size > 1:
        if strategy.final.owners_precondition:
            owners = _layer_owners(plan)
        else:
            available = {spec.key: None for spec in specs}
            wire = costs.workload.form.wire_size
            groups = tuple(strategy.broadcasts.groups(plan, available, cost_model, wire))
        busy, chunk = (
            scheduler.gradient_busy(costs, strategy, grad_buckets)
            if strategy.fusion.around_gradients
            else ((), None)
        )
        fusion = _fusion(costs, strategy.fusion, busy, chunk)
    return StrategySetup(
        strategy,
        costs,
        plan,
        groups,
        fusion,
        grad_buckets,
        owners,
        comm_scheduler=comm_scheduler,
        window=scheduler.plan(costs, strategy, grad_buckets, fusion),
    )


def _layer_owners(plan: Plan) -> dict[str, int]:
    """Layer → owner rank of an owner-computes plan.

    Raises:
        ValueError: A factor inverted on every rank, or a layer's factors on two ranks.
    """
    owners: dict[str, int] = {}
    for spec, owner in zip(plan.factors, plan.owners, strict=True):
        if owner == EVERY_RANK or owners.setdefault(spec.layer, owner) != owner:
            raise ValueError(
                f"an owner-computes strategy needs every factor of a layer on one rank; "
                f"plan {plan.placement!r} puts {spec.key} on {owner} "
                f"(layer owner {owners.get(spec.layer)})"
            )
    return owners


#: Bytes of one stored factor or inverse element (the real blocks keep float32 squares).
_STORED_BYTES = 4


def factor_memory_bytes(setup: StrategySetup) -> int:
    """Bytes of running factors and inverses the most loaded rank holds.

    As the real blocks store them (``KFACPreconditioner.memory_bytes()``): each A and G
    a full float32 square, each result in its inverse form's shape (a square for a
    damped inverse, ``[d, d + 1]`` for an eigen-basis). D-KFAC, MPD-KFAC and SPD-KFAC hold
    every factor and every result on every rank (broadcast results are unpacked); an
    owner-computes strategy only its own layers'. SGD holds none.
    """
    if not setup.strategy.uses_kfac:
        return 0
    workload = setup.costs.workload
    form = workload.form
    per_layer = {
        layer.name: _STORED_BYTES
        * sum(dim**2 + math.prod(form.shape(dim)) for dim in (layer.a_dim, layer.g_dim))
        for layer in workload.layers
    }
    if not setup.layer_owners:
        return sum(per_layer.values())
    loads: dict[int, int] = {}
    for name, owner in setup.layer_owners.items():
        loads[owner] = loads.get(owner, 0) + per_layer[name]
    return max(loads.values(), default=0)


def plan_summary(setup: StrategySetup) -> str:
    """One line for reports: the inverse placement and the window's schedule, where there
    are ("" for SGD with no window)."""
    lines = [] if setup.plan is None else [_placement_summary(setup, setup.plan)]
    return "; ".join(lines + ([] if setup.window is None else [setup.window.describe()]))


def _placement_summary(setup: StrategySetup, plan: Plan) -> str:
    if setup.owner_computes:
        counts: dict[int, int] = {}
        for owner in setup.layer_owners.values():
            counts[owner] = counts.get(owner, 0) + 1
        return (
            f"{plan.placement}: {len(setup.layer_owners)} layers on {len(counts)} owner(s) (at "
            f"most {max(counts.values())} per rank), max inverse load "
            f"{1000 * max(plan.loads()):.2f} ms, no inverse broadcast, gather in "
            f"{len(counts)} broadcast(s)"
        )
    communicated = sum(owner >= 0 for owner in plan.owners)
    return (
        f"{plan.placement}: {communicated}/{len(plan.factors)} factors communicated in "
        f"{len(setup.groups)} broadcast(s), max CT load {1000 * max(plan.loads()):.2f} ms, "
        f"NCT {1000 * plan.replicated_seconds():.2f} ms"
    )
