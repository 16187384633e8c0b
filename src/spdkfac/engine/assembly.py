"""The stages of a preconditioner that depend on its composition (a strategy row): the
factor collector (fusion policy), the inverse phase (placement) and the last stage
(replicated or owner-computes). ``strategy="auto"`` assembles them again for each
candidate it tries."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from spdkfac.comm import Communicator
from spdkfac.comm.ddp_hooks import SwitchableHook
from spdkfac.comm.scheduler import CommScheduler
from spdkfac.config import KFACConfig
from spdkfac.costmodel import CostModel
from spdkfac.curvature import CurvatureBlock, FactorCollector
from spdkfac.engine.inversion import InversePhase
from spdkfac.engine.owners import OwnerUpdate, find_ddp, register_ddp_hook
from spdkfac.engine.update import ReplicatedUpdate
from spdkfac.planning.schedule import GRADIENTS
from spdkfac.profiling import Profiler
from spdkfac.strategies import Strategy

__all__ = ["Stages", "assemble", "pipeline_group_for", "routing_hook", "scheduler_for"]


@dataclass(frozen=True)
class Stages:
    """The composition-dependent stages of one preconditioner."""

    composition: Strategy
    update: ReplicatedUpdate | OwnerUpdate
    inverses: InversePhase
    collector: FactorCollector


def assemble(
    composition: Strategy,
    *,
    model: nn.Module,
    blocks: Sequence[CurvatureBlock],
    communicator: Communicator,
    config: KFACConfig,
    costs: CostModel,
    enabled: Callable[[], bool],
    grad_scale: Callable[[], float] | None,
    profiler: Profiler,
    hooks: SwitchableHook | None = None,
    scheduler: CommScheduler | None = None,
    pipeline_group: Communicator | None = None,
) -> Stages:
    """Plan the placement and build the stages of ``composition`` (no collective: the
    process groups it may need are created once, by :func:`scheduler_for` and
    :func:`pipeline_group_for`).

    Args:
        composition: The strategy row.
        model: The model as the user passed it (a DDP wrapper may get a hook).
        blocks: The curvature blocks, in the same order on every rank.
        communicator: The group.
        config: The options.
        costs: The cost model the placement and the fusion plan with.
        enabled: Whether this step's passes are captured.
        grad_scale: The loss scale of a ``GradScaler`` (None without one).
        profiler: Where spans are recorded.
        hooks: The DDP hook registered once by :func:`routing_hook` (None otherwise).
        scheduler: The communication scheduler (``comm_scheduler="priority"``; None).
        pipeline_group: The group a pipelined fusion's buckets travel on (required then,
            with several ranks).
    """
    assert composition.fusion is not None and composition.placement_policy is not None
    if composition.fusion.eager and communicator.world_size > 1:
        assert pipeline_group is not None, "a pipelined fusion needs pipeline_group_for()"
        exchange_group = pipeline_group
    else:
        exchange_group = communicator
    if not composition.scheduler.orders_traffic:
        scheduler = None  # the hook's default path is DDP's all-reduce then
    specs = [spec for block in blocks for spec in block.inverse_specs()]
    plan = composition.placement_policy.plan(specs, communicator.world_size, costs)
    owners = composition.final.owners_precondition
    if hooks is not None:
        hooks.use(None)  # DDP's all-reduce unless the owner update routes it
    update: ReplicatedUpdate | OwnerUpdate = (
        OwnerUpdate(
            model,
            blocks,
            plan,
            communicator,
            profiler,
            hooks,
            gradients=None if scheduler is None else scheduler.stream(GRADIENTS, communicator),
        )
        if owners
        else ReplicatedUpdate(blocks, communicator, profiler)
    )
    inverses = InversePhase(
        plan,
        communicator,
        config.inverse_form,
        min_group_elements=composition.broadcasts.min_group_elements(costs),
        owners_keep=owners,
        max_failures=config.max_inverse_failures,
        profiler=profiler,
    )
    collector = FactorCollector(
        blocks,
        communicator,
        composition.fusion,
        enabled=enabled,
        allreduce=costs.allreduce,
        accumulation_steps=config.accumulation_steps,
        bucket_cap_bytes=int(config.bucket_cap_mb * 2**20),
        fusion_warmup_steps=config.fusion_warmup_steps,
        comm_dtype=config.factor_comm_dtype,
        owners=plan.owner_by_key if owners else None,
        grad_scale=grad_scale,
        examples=config.factor_options.examples,
        scheduler=scheduler,
        exchange_group=exchange_group,
        profiler=profiler,
    )
    return Stages(composition, update, inverses, collector)


def scheduler_for(
    config: KFACConfig, communicator: Communicator, costs: CostModel
) -> CommScheduler | None:
    """The communication scheduler, with a process group of its own (a collective), when
    a composition the preconditioner may use has ``comm_scheduler="priority"`` on a group
    of several ranks; None otherwise."""
    wanted = any(row.scheduler.orders_traffic for row in config.selection.rows)
    if not wanted or communicator.world_size == 1:
        return None
    return CommScheduler(communicator.duplicate(), costs.allreduce)


def pipeline_group_for(config: KFACConfig, communicator: Communicator) -> Communicator | None:
    """The process group pipelined factor buckets travel on (a collective), created once
    when a composition the preconditioner may use has a pipelined fusion on a group of
    several ranks, and shared by every collector ``strategy="auto"`` assembles; None
    otherwise."""
    wanted = any(row.fusion is not None and row.fusion.eager for row in config.selection.rows)
    if not wanted or communicator.world_size == 1:
        return None
    return communicator.duplicate()


def routing_hook(
    model: nn.Module, config: KFACConfig, scheduler: CommScheduler | None = None
) -> SwitchableHook | None:
    """The DDP hook registered once when the gradient buckets' communication may differ
    from DDP's own (DDP takes one hook per model, and never gives it back): a composition
    the preconditioner may use computes on owners, or a ``scheduler`` orders the buckets;
    None otherwise. ``remove()`` turns it back into DDP's all-reduce.

    Raises:
        ValueError: The DDP model already has a hook.
    """
    ddp = find_ddp(model)
    if ddp is None:
        return None
    owners = any(row.final.owners_precondition for row in config.selection.rows)
    if scheduler is None and not owners:
        return None
    hooks = SwitchableHook(scheduler)
    register_ddp_hook(ddp, hooks.function)
    return hooks
