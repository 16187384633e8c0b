"""FSDP2's collectives and K-FAC's extra gradient gathers under FSDP2, priced α-β.

FSDP2 (``fully_shard``) replaces DDP's gradient all-reduce by, per unit (here: every module
that holds parameters, ``fully_shard`` on each), an all-gather of the unit's parameters
before its forward, another before its backward when ``reshard_after_forward``, and a
reduce-scatter of its gradients after it. K-FAC under FSDP2 adds, at ``step()``
(``docs/distributed.md``, "FSDP2 and HSDP"), per registered layer:

* replicated strategies (``d-kfac``, ``spd-kfac``, ``mpd-kfac``, ...): an all-gather of
  each of the layer's parameters' full gradients;
* owner-computes (``osawa``; ``layer-paths``' owner-path layers, its others as the
  replicated strategies'): one reduce-scatter that brings the layer's full gradient to
  its owner (every rank sends the layer's full size in P chunks, the owner's non-empty),
  so its buffer is P times the layer's bytes; the owner's broadcast of the preconditioned
  result is the one the strategy has under DDP too (it needs no inverse broadcast). The
  owner-path layers are the DDP simulation's
  (:attr:`~spdkfac.sim.strategies.StrategySetup.layer_owners`), from the same planners.

Every collective is priced at the world size by the preset's cheapest algorithm
(``Hardware.collective(op, P).predict(n)``, ``n`` the whole buffer as in
:mod:`spdkfac.sim.collectives`); ``bytes_per_rank`` is what each rank sends on a ring,
``(P−1)/P·n``.

The iteration (:func:`simulate_fsdp`) is the DDP row's simulation
(:func:`~spdkfac.sim.simulator.simulate_strategy`) with its exposed gradient
communication (``GradComm``) replaced: FSDP2 prefetches the next unit's all-gather and
overlaps reduce-scatters with backward, so its pass collectives are exposed only beyond
the forward and backward compute, plus the first unit's all-gather (nothing precedes it);
K-FAC's gradient gathers run inside ``step()`` before preconditioning and are exposed
whole. This is an overlay on the DDP timeline, not a per-unit event simulation: the
units' all-gathers do not contend with the factor buckets on the link.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from spdkfac.sim.collectives import CollectiveOp
from spdkfac.sim.costs import WorkloadCosts
from spdkfac.sim.hardware import Hardware
from spdkfac.sim.items import Op
from spdkfac.sim.simulator import StrategyResult, simulate_strategy
from spdkfac.sim.strategies import Strategy, prepare, selection
from spdkfac.sim.workload import Workload

__all__ = [
    "LAYOUTS",
    "FsdpCollective",
    "FsdpResult",
    "fsdp_collectives",
    "fsdp_result",
    "fsdp_section",
    "fsdp_table",
    "pass_compute_seconds",
    "simulate_fsdp",
    "units",
]

#: ``spdkfac simulate --layout`` values: DDP (the default, the simulator's own) or FSDP2.
LAYOUTS: tuple[str, ...] = ("ddp", "fsdp")
_FLOAT32 = 4.0


@dataclass(frozen=True)
class FsdpCollective:
    """One collective of an FSDP2 iteration.

    Attributes:
        label: What it moves (``"forward all-gather <unit>"``, ...).
        op: The collective.
        nbytes: Its whole buffer (an all-gather's output, a reduce-scatter's input).
        bytes_per_rank: What each rank sends on a ring: ``(P−1)/P·nbytes``.
        seconds: Its α-β time on the preset's cheapest algorithm.
        step: Whether it runs inside ``step()`` (K-FAC's gathers) rather than the passes.
    """

    label: str
    op: CollectiveOp
    nbytes: float
    bytes_per_rank: float
    seconds: float
    step: bool = False


def units(workload: Workload) -> tuple[tuple[str, int], ...]:
    """FSDP2 units in parameter order: each module holding parameters and its elements."""
    sizes: dict[str, int] = {}
    for name, numel in workload.parameters:
        module = name.rsplit(".", 1)[0] if "." in name else ""
        sizes[module] = sizes.get(module, 0) + numel
    return tuple(sizes.items())


def _priced(
    hardware: Hardware, world: int, label: str, op: CollectiveOp, nbytes: float, step: bool
) -> FsdpCollective:
    seconds = hardware.collective(op, world).predict(nbytes)
    share = (world - 1) / world * nbytes
    return FsdpCollective(label, op, nbytes, share, seconds, step)


def _kfac_gathers(
    workload: Workload, hardware: Hardware, world: int, owner_layers: Collection[str]
) -> list[FsdpCollective]:
    out: list[FsdpCollective] = []
    numel = dict(workload.parameters)
    for layer in workload.layers:
        names = [name for name in numel if name.startswith(f"{layer.name}.")]
        if layer.name in owner_layers:
            nbytes = world * _FLOAT32 * sum(numel[name] for name in names)
            op = CollectiveOp.REDUCE_SCATTER
            out.append(_priced(hardware, world, f"owner scatter {layer.name}", op, nbytes, True))
            continue
        for name in names:
            nbytes = _FLOAT32 * numel[name]
            op = CollectiveOp.ALL_GATHER
            out.append(_priced(hardware, world, f"grad all-gather {name}", op, nbytes, True))
    return out


def fsdp_collectives(
    workload: Workload,
    hardware: Hardware,
    world_size: int,
    *,
    kfac: str | None = None,
    reshard_after_forward: bool = True,
) -> tuple[FsdpCollective, ...]:
    """Every collective of one FSDP2 iteration of ``workload`` on ``world_size`` ranks (none
    on one rank), with K-FAC's step-time gathers for the strategy ``kfac`` (None or a
    strategy without K-FAC: none)."""
    if world_size < 2:
        return ()
    out: list[FsdpCollective] = []
    gather, scatter = CollectiveOp.ALL_GATHER, CollectiveOp.REDUCE_SCATTER
    for unit, numel in units(workload):
        nbytes = _FLOAT32 * numel
        out.append(
            _priced(hardware, world_size, f"forward all-gather {unit}", gather, nbytes, False)
        )
        if reshard_after_forward:
            label = f"backward all-gather {unit}"
            out.append(_priced(hardware, world_size, label, gather, nbytes, False))
        label = f"grad reduce-scatter {unit}"
        out.append(_priced(hardware, world_size, label, scatter, nbytes, False))
    chosen = None if kfac is None else _row(kfac)
    if chosen is not None and chosen.uses_kfac:
        # The owner-path layers as the DDP simulation plans them (every layer for osawa,
        # the path planner's owner layers for layer-paths, none for the replicated rows).
        setup = prepare(WorkloadCosts(workload, hardware, world_size), chosen)
        out.extend(_kfac_gathers(workload, hardware, world_size, setup.layer_owners))
    return tuple(out)


def _row(name: str) -> Strategy:
    chosen = selection(name)
    if not isinstance(chosen, Strategy):
        raise ValueError(f"FSDP2 projections take a strategy row, not {name!r}")
    return chosen


@dataclass(frozen=True)
class FsdpResult:
    """A strategy's iteration under FSDP2 (see the module docstring).

    Attributes:
        ddp: The DDP simulation it is built on.
        collectives: FSDP2's collectives and K-FAC's gathers.
        iteration_s: Projected iteration time.
        pass_exposed_s: FSDP2's pass collectives' exposed seconds.
        step_comm_s: K-FAC's step-time gathers' seconds.
    """

    ddp: StrategyResult
    collectives: tuple[FsdpCollective, ...]
    iteration_s: float
    pass_exposed_s: float
    step_comm_s: float

    @property
    def bytes_per_rank(self) -> float:
        """What each rank sends per iteration in FSDP2's and K-FAC's collectives."""
        return sum(collective.bytes_per_rank for collective in self.collectives)


def pass_compute_seconds(workload: Workload, hardware: Hardware, world_size: int) -> float:
    """Seconds of the forward and backward ops per rank (what pass collectives hide behind)."""
    costs = WorkloadCosts(workload, hardware, world_size)
    items = (*workload.forward, *workload.backward)
    return sum(costs.op(item) for item in items if isinstance(item, Op))


def fsdp_result(
    ddp: StrategyResult,
    workload: Workload,
    hardware: Hardware,
    *,
    reshard_after_forward: bool = True,
) -> FsdpResult:
    """The DDP simulation ``ddp`` of ``workload`` on ``hardware`` under FSDP2 (see the
    module docstring).

    Raises:
        ValueError: Its strategy is no row (``"auto"``).
    """
    world = ddp.world_size
    collectives = fsdp_collectives(
        workload, hardware, world, kfac=ddp.strategy, reshard_after_forward=reshard_after_forward
    )
    passes = [c.seconds for c in collectives if not c.step]
    exposed = 0.0
    if passes:
        compute = pass_compute_seconds(workload, hardware, world)
        exposed = passes[0] + max(0.0, sum(passes[1:]) - compute)
    step = sum(c.seconds for c in collectives if c.step)
    iteration = ddp.iteration_s - ddp.breakdown["GradComm"] + exposed + step
    return FsdpResult(ddp, collectives, iteration, exposed, step)


def simulate_fsdp(
    workload: Workload,
    hardware: Hardware,
    world_size: int,
    strategy: str,
    *,
    reshard_after_forward: bool = True,
    factor_update_steps: int = 1,
    inv_update_steps: int = 1,
) -> FsdpResult:
    """``strategy`` on ``world_size`` ranks under FSDP2: :func:`fsdp_result` of its DDP
    simulation.

    Raises:
        ValueError: An unknown strategy or one that is no row (``"auto"``).
    """
    _row(strategy)
    ddp = simulate_strategy(
        workload,
        hardware,
        world_size,
        strategy,
        factor_update_steps=factor_update_steps,
        inv_update_steps=inv_update_steps,
    )
    return fsdp_result(ddp, workload, hardware, reshard_after_forward=reshard_after_forward)


def fsdp_table(rows: Sequence[tuple[str, FsdpResult]]) -> str:
    """A markdown table of labelled FSDP2 results: DDP and FSDP2 iteration times, FSDP2's
    exposed pass collectives, K-FAC's step gathers and the bytes each rank sends."""
    lines = [
        "| strategy | DDP ms | FSDP2 ms | FSDP2 passes exposed ms | K-FAC gathers ms "
        "| FSDP2 MB sent/rank |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, result in rows:
        lines.append(
            f"| {label} | {1e3 * result.ddp.iteration_s:.1f} | {1e3 * result.iteration_s:.1f} "
            f"| {1e3 * result.pass_exposed_s:.1f} | {1e3 * result.step_comm_s:.1f} "
            f"| {result.bytes_per_rank / 1e6:.1f} |"
        )
    return "\n".join(lines)


def fsdp_section(
    workload: Workload, hardware: Hardware, results: Mapping[str, StrategyResult]
) -> str:
    """A markdown section: labelled data-parallel ``results`` (one world size) of
    ``workload`` under FSDP2 (``spdkfac simulate --layout fsdp``).

    Raises:
        ValueError: A strategy that is no row (``"auto"``).
    """
    rows = [(label, fsdp_result(ddp, workload, hardware)) for label, ddp in results.items()]
    world = next(iter(results.values())).world_size
    return f"\n\n## FSDP2: {workload.model}, {world} workers\n\n{fsdp_table(rows)}"
