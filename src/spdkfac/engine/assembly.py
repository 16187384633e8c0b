"""The assembler: built once per preconditioner, it holds what every composition shares
(the process groups, the gradient-routing hook, the communication scheduler) and builds a
composition's stages — the factor collector, the inverse phase and the final stage —
from its axis objects. ``strategy="auto"`` builds the stages again for each candidate."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from spdkfac.comm import Communicator, release
from spdkfac.comm.ddp_hooks import SwitchableHook
from spdkfac.comm.pipeline import FactorRoute
from spdkfac.comm.scheduler import CommScheduler
from spdkfac.config import KFACConfig
from spdkfac.curvature import CurvatureBlock, FactorCollector
from spdkfac.engine.final import EngineParts, FinalStage, StageInputs
from spdkfac.engine.inversion import InversePhase, ResultDelivery
from spdkfac.engine.owners import OwnerStage
from spdkfac.engine.replicated import ReplicatedStage
from spdkfac.planning.factor_split import gram_cost
from spdkfac.planning.final import LAYER_PATHS, OWNER_COMPUTES, REPLICATED, FinalPolicy
from spdkfac.planning.paths import LayerGradient
from spdkfac.planning.placement import Plan
from spdkfac.planning.schedule import FACTORS, GRADIENTS
from spdkfac.strategies import Strategy

__all__ = ["FINAL_STAGES", "Assembler", "Stages", "factor_costs", "layer_gradients"]

#: The final stage each final-stage policy builds.
FINAL_STAGES: Mapping[FinalPolicy, Callable[[StageInputs], FinalStage]] = MappingProxyType(
    {REPLICATED: ReplicatedStage, OWNER_COMPUTES: OwnerStage, LAYER_PATHS: OwnerStage}
)


def layer_gradients(blocks: Sequence[CurvatureBlock]) -> list[LayerGradient]:
    """The blocks with placed factors as the placement and the path planner see them:
    their factors and the elements of their gradient matrix (``[g, a]``; a diagonal A's
    side is its vector's length)."""
    layers = []
    for block in blocks:
        specs = block.inverse_specs()
        if specs:
            shapes = block.state_shapes()
            elements = shapes["g_factor"][0] * shapes["a_factor"][0]
            layers.append(LayerGradient(block.name, elements, tuple(specs)))
    return layers


def factor_costs(blocks: Sequence[CurvatureBlock]) -> list[tuple[str, float]]:
    """Each block's name and the Gram cost of its statistics (``d_in² + d_out²`` for a
    Kronecker block), as the factor split sees them."""
    return [
        (block.name, gram_cost([(slot.shape, slot.symmetric) for slot in block.slots()]))
        for block in blocks
    ]


@dataclass(frozen=True)
class Stages:
    """The composition-dependent stages of one preconditioner."""

    composition: Strategy
    final: FinalStage
    inverses: InversePhase
    collector: FactorCollector


class Assembler:
    """Builds the stages of any composition ``config`` may use (module docstring).

    Construction is a collective on several ranks: it creates the process groups the
    compositions need (a scheduler's, a pipelined fusion's), once, and registers the
    gradient-routing hook on a layout that takes one when a composition routes gradients
    (an owner-computes final stage, or a scheduler ordering DDP's buckets).

    Args:
        parts: The blocks, group, layout, costs and profiler.
        config: The options (its :attr:`~spdkfac.KFACConfig.selection` says which
            compositions may be used).

    Raises:
        ValueError: The layout cannot take the routing hook.
    """

    def __init__(self, parts: EngineParts, config: KFACConfig) -> None:
        self.parts = parts
        rows = config.selection.rows
        communicator = parts.communicator
        several = communicator.world_size > 1
        self.scheduler: CommScheduler | None = None
        if several and any(row.scheduler.orders_traffic for row in rows):
            self.scheduler = CommScheduler(communicator.duplicate(), parts.costs.allreduce)
        eager = any(row.fusion is not None and row.fusion.eager for row in rows)
        self._pipeline_group = communicator.duplicate() if several and eager else None
        self.hooks: SwitchableHook | None = None
        #: Which blocks' statistics this rank forms (its tensor-parallel group's split).
        self.share = parts.layout.factor_share(communicator, factor_costs(parts.blocks))
        owners = any(row.final.owners_precondition for row in rows)
        if parts.layout.routes_gradients and (self.scheduler is not None or owners):
            self.hooks = SwitchableHook(self.scheduler)
            parts.layout.route_gradients(self.hooks.function)

    @property
    def groups(self) -> list[Communicator]:
        """The process groups this assembler created."""
        created = [None if self.scheduler is None else self.scheduler.group]
        return [group for group in (*created, self._pipeline_group) if group is not None]

    def build(self, composition: Strategy, config: KFACConfig) -> Stages:
        """Plan the placement and build the stages of ``composition`` (no collective)."""
        parts = self.parts
        assert composition.fusion is not None and composition.placement_policy is not None
        world = parts.communicator.world_size
        policy = composition.placement_policy
        plan = composition.final.place(policy, layer_gradients(parts.blocks), world, parts.costs)
        scheduler = self.scheduler if composition.scheduler.orders_traffic else None
        if self.hooks is not None:
            self.hooks.use(None)  # DDP's all-reduce unless the final stage routes it
        final = FINAL_STAGES[composition.final](self._stage_inputs(plan, scheduler))
        delivery = ResultDelivery(
            min_group_elements=composition.broadcasts.min_group_elements(parts.costs),
            owners_keep=composition.final.owners_precondition,
        )
        inverses = InversePhase(
            plan,
            parts.communicator,
            config.inverse_form,
            delivery=delivery,
            max_failures=config.max_inverse_failures,
            profiler=parts.profiler,
        )
        collector = FactorCollector(
            parts.blocks,
            parts.communicator,
            self._route(composition, plan, scheduler),
            settings=config.collector_settings,
            enabled=parts.enabled,
            grad_scale=parts.grad_scale,
            profiler=parts.profiler,
            share=self.share,
        )
        return Stages(composition, final, inverses, collector)

    def _stage_inputs(self, plan: Plan, scheduler: CommScheduler | None) -> StageInputs:
        parts = self.parts
        gradients = None if scheduler is None else scheduler.stream(GRADIENTS, parts.communicator)
        return StageInputs(parts, plan, hooks=self.hooks, gradients=gradients)

    def _route(
        self, composition: Strategy, plan: Plan, scheduler: CommScheduler | None
    ) -> FactorRoute:
        """Where the composition's factor buckets travel: a pipelined fusion on its own
        group (through the scheduler's factor stream when one orders the traffic)."""
        fusion = composition.fusion
        assert fusion is not None
        group = self.parts.communicator
        if fusion.eager and self._pipeline_group is not None:
            group = self._pipeline_group
        ordering = scheduler if fusion.eager else None
        if ordering is not None:
            group = ordering.stream(FACTORS, group)
        return FactorRoute(
            fusion,
            group,
            self.parts.costs.allreduce,
            owners=composition.final.factor_owners(plan),
            scheduler=ordering,
        )

    def close(self) -> None:
        """Give the gradient reduction back to the wrapper, end the scheduler and release
        the groups created (every rank, after the last step)."""
        if self.hooks is not None:
            self.hooks.plain()
        if self.scheduler is not None:
            self.scheduler.close()
        for group in self.groups:
            release(group)
        self._pipeline_group = None
        self.scheduler = None
