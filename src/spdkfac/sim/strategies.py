"""Strategies as the real run composes them, planned with the real planners.

A :class:`~spdkfac.strategies.Strategy` is a row of the one strategy table (a fusion
policy plus an inverse placement), shared with the preconditioner and ``spdkfac bench``;
:func:`selection` resolves a name (``"auto"`` through
:attr:`~spdkfac.config.KFACConfig.selection`, an :class:`~spdkfac.strategies.AutoStrategy`).
:func:`prepare` makes, for one workload, hardware and world size, exactly the plans a
real ``KFACPreconditioner`` would: the inverse :class:`~spdkfac.planning.placement.Plan` of
the workload's factors (its blocks' ``inverse_specs``, priced in its inverse form) from the
row's final-stage policy (:meth:`~spdkfac.planning.final.FinalPolicy.place`, as the
engine's assembler calls it), the row's broadcast grouping (in the form's wire size) and
the buckets of :mod:`spdkfac.sim.buckets` (the fusion policy's factor buckets, DDP's
gradient buckets).

A row whose owners precondition runs the owner stage (:attr:`StrategySetup.owner_computes`,
on more than one rank; :mod:`spdkfac.sim.owners`), and :attr:`StrategySetup.layer_owners`
says which rank owns each owner-path layer:

- ``osawa`` (Osawa et al. 2019, "Large-scale distributed second-order optimization using
  Kronecker-factored approximate curvature", Sec. 3, Fig. 1): every layer, placed by
  :func:`~spdkfac.planning.placement.plan_layer_owners` (one owner per layer); no inverse
  is broadcast;
- ``layer-paths``: the layers of the plan's ``owner_layers``, which
  :func:`~spdkfac.planning.paths.plan_gradient_paths` sends the owner way by the cost
  model; the others take the replicated path of SPD-KFAC (Shi, Zhang, Li 2021,
  "Accelerating Distributed K-FAC with Smart Parallelism of Computing and Communication
  Tasks", Sec. 4): their factors placed by the row's placement policy (CT/NCT), the CT
  results broadcast in :attr:`StrategySetup.groups`, every rank preconditioning them.

``comm_scheduler`` (:mod:`spdkfac.sim.window`) plans the backward window's order with the
runtime's planner: :attr:`StrategySetup.window` (None: ``"fifo"``, or no window).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import cast

from spdkfac.config import KFACConfig
from spdkfac.planning.broadcasts import BroadcastGroup
from spdkfac.planning.final import FinalPolicy
from spdkfac.planning.fusion import FusionPlan
from spdkfac.planning.paths import LayerGradient
from spdkfac.planning.placement import EVERY_RANK, FactorSpec, Plan
from spdkfac.planning.schedule import CommSchedule
from spdkfac.sim.buckets import factor_fusion, grad_buckets
from spdkfac.sim.costs import WorkloadCosts
from spdkfac.sim.window import window_policy
from spdkfac.sim.workload import Workload
from spdkfac.strategies import SGD, STRATEGIES, STRATEGY_NAMES, AutoStrategy, Strategy
from spdkfac.types import StrategyName

__all__ = [
    "DEFAULT_STRATEGIES",
    "SELECTION_NAMES",
    "STRATEGY_TABLE",
    "Strategy",
    "StrategySetup",
    "factor_memory_bytes",
    "layer_gradients",
    "parse_strategies",
    "plan_summary",
    "prepare",
    "selection",
]

#: Every strategy row the simulator knows: SGD and every row of the one strategy table
#: (names match ``spdkfac bench``'s variants). ``layer-paths`` is modelled as the real run
#: composes it: the real path planner's owner layers take osawa's owner path, the others
#: the replicated path with their inverse broadcasts, on one timeline (:func:`prepare`,
#: :mod:`spdkfac.sim.owners`).
STRATEGY_TABLE: dict[str, Strategy] = {SGD.name: SGD, **STRATEGIES}
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
        layer_owners: With the owner stage, each owner-path layer → the rank that owns
            it (from ``plan``: every layer for ``osawa``, the plan's ``owner_layers`` for
            ``layer-paths``); empty otherwise. The other layers take the replicated path.
        comm_scheduler: How the backward window's collectives are ordered
            (:data:`~spdkfac.sim.window.WINDOW_POLICIES`).
        window: The order of factor steps' gradient and factor chunks (None: none planned,
            the buckets go as with ``"fifo"``).
        owner_computes: The owner stage runs (a row whose owners precondition, on more
            than one rank): factors and gradients travel to ``layer_owners``, owners
            precondition their layers, every rank the rest, and the results are gathered.
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
    owner_computes: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_owners", MappingProxyType(dict(self.layer_owners)))

    def held_layers(self, rank: int) -> tuple[str, ...]:
        """The layers ``rank`` holds the factors of and preconditions, in forward order:
        those it owns and every replicated-path layer (every layer when nobody owns)."""
        owners = self.layer_owners
        return tuple(
            layer.name
            for layer in self.costs.workload.layers
            if owners.get(layer.name, rank) == rank
        )

    def parameter_owner(self, parameter: str) -> int | None:
        """The owner of ``parameter``'s layer (``"<layer>.<name>"``); None when its
        module has no owner (a norm layer) or nobody owns layers."""
        return self.layer_owners.get(parameter.rpartition(".")[0])


def prepare(
    costs: WorkloadCosts,
    strategy: Strategy,
    plan: Plan | None = None,
    *,
    comm_scheduler: str = "fifo",
) -> StrategySetup:
    """Make the plans ``strategy`` runs with for ``costs``' workload and world size.

    ``plan`` replaces the strategy's inverse placement (for placements of your own; it
    must cover every factor of the workload for this world size; for ``layer-paths`` its
    ``owner_layers`` are the owner-path layers). ``comm_scheduler`` orders the backward
    window (:mod:`spdkfac.sim.window`).

    Raises:
        ValueError: A plan that does not fit, or an unknown ``comm_scheduler``.
    """
    scheduler = window_policy(comm_scheduler)
    world_size = costs.world_size
    buckets = grad_buckets(costs) if world_size > 1 else ()
    if not strategy.uses_kfac:
        return StrategySetup(
            strategy, costs, None, (), None, buckets, comm_scheduler=comm_scheduler
        )
    assert strategy.placement_policy is not None and strategy.fusion is not None
    cost_model = costs.hardware.cost_model(world_size)
    workload = costs.workload
    specs = workload.factors
    if plan is None:
        layers = layer_gradients(workload)
        plan = strategy.final.place(strategy.placement_policy, layers, world_size, cost_model)
    elif plan.world_size != world_size or sorted(s.key for s in plan.factors) != sorted(
        s.key for s in specs
    ):
        raise ValueError("plan must cover every factor of the workload at this world size")
    groups: tuple[BroadcastGroup, ...] = ()
    fusion = None
    owners: dict[str, int] = {}
    owner_stage = world_size > 1 and strategy.final.owners_precondition
    if world_size > 1:
        if owner_stage:
            owners = _layer_owners(plan, strategy.final)
        # As the inverse phase groups them: the replicated-path layers' results only
        # (owners keep theirs).
        available = {spec.key: None for spec in specs if spec.layer not in owners}
        wire = workload.form.wire_size
        groups = tuple(strategy.broadcasts.groups(plan, available, cost_model, wire))
        busy, chunk = (
            scheduler.gradient_busy(costs, strategy, buckets)
            if strategy.fusion.around_gradients
            else ((), None)
        )
        fusion = factor_fusion(costs, strategy.fusion, busy, chunk)
    return StrategySetup(
        strategy,
        costs,
        plan,
        groups,
        fusion,
        buckets,
        owners,
        comm_scheduler=comm_scheduler,
        window=scheduler.plan(costs, strategy, buckets, fusion),
        owner_computes=owner_stage,
    )


def layer_gradients(workload: Workload) -> list[LayerGradient]:
    """The layers with placed factors as the placement and the path planner see them (the
    engine's ``layer_gradients``): their factors, in registration order, and the ``g·a``
    elements of their gradient matrix."""
    factors: dict[str, list[FactorSpec]] = {}
    for spec in workload.factors:
        factors.setdefault(spec.layer, []).append(spec)
    return [
        LayerGradient(name, workload.layer(name).g_dim * workload.layer(name).a_dim, tuple(specs))
        for name, specs in factors.items()
    ]


def _layer_owners(plan: Plan, final: FinalPolicy) -> dict[str, int]:
    """Owner-path layer → owner rank: the plan's ``owner_layers`` when the row chooses
    paths, else every layer of the plan.

    Raises:
        ValueError: An owner-path layer's factor inverted on every rank, or its factors on
            two ranks.
    """
    chosen = plan.owner_layers if final.chooses_paths else {spec.layer for spec in plan.factors}
    owners: dict[str, int] = {}
    for spec, owner in zip(plan.factors, plan.owners, strict=True):
        if spec.layer not in chosen:
            continue
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
    every factor and every result on every rank (broadcast results are unpacked); with the
    owner stage a rank holds its own owner-path layers' and every replicated-path layer's
    (``osawa``: its own only). SGD holds none.
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
    shared = sum(size for name, size in per_layer.items() if name not in setup.layer_owners)
    loads: dict[int, int] = {}
    for name, owner in setup.layer_owners.items():
        loads[owner] = loads.get(owner, 0) + per_layer[name]
    return shared + max(loads.values(), default=0)


def plan_summary(setup: StrategySetup) -> str:
    """One line for reports: the inverse placement and the window's schedule, where there
    are ("" for SGD with no window)."""
    lines = [] if setup.plan is None else [_placement_summary(setup, setup.plan)]
    return "; ".join(lines + ([] if setup.window is None else [setup.window.describe()]))


def _placement_summary(setup: StrategySetup, plan: Plan) -> str:
    owned = setup.layer_owners
    shared = [o for s, o in zip(plan.factors, plan.owners, strict=True) if s.layer not in owned]
    communicated = sum(owner != EVERY_RANK for owner in shared)
    broadcasts = (
        f"{communicated}/{len(shared)} factors communicated in {len(setup.groups)} broadcast(s)"
    )
    nct = f"NCT {1000 * plan.replicated_seconds():.2f} ms"
    if not setup.owner_computes:
        return (
            f"{plan.placement}: {broadcasts}, max CT load {1000 * max(plan.loads()):.2f} ms, {nct}"
        )
    counts: dict[int, int] = {}
    for owner in owned.values():
        counts[owner] = counts.get(owner, 0) + 1
    owners = (
        f"{len(owned)} layers on {len(counts)} owner(s) (at most {max(counts.values())} per rank)"
        if owned
        else "no layer on an owner"
    )
    replicated = len({spec.layer for spec in plan.factors} - set(owned))
    rest = (
        f"{replicated} replicated layer(s): {broadcasts}, {nct}"
        if shared
        else "no inverse broadcast"
    )
    return (
        f"{plan.placement}: {owners}, max inverse load {1000 * max(plan.loads()):.2f} ms, "
        f"{rest}, gather in {len(counts)} broadcast(s)"
    )
