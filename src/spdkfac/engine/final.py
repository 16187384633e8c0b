"""The final stage of a step: one Protocol for the replicated and the owner-computes
stages, and what every stage is built from."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from spdkfac.comm import BucketLaunches, Communicator
from spdkfac.comm.ddp_hooks import SwitchableHook
from spdkfac.costmodel import CostModel
from spdkfac.curvature import CurvatureBlock
from spdkfac.layout import ParameterLayout
from spdkfac.planning.placement import Plan
from spdkfac.profiling import Profiler

__all__ = ["EngineParts", "FinalStage", "StageInputs"]


@dataclass(frozen=True)
class EngineParts:
    """What every stage of a preconditioner is built from, whatever the composition.

    Attributes:
        blocks: The curvature blocks, in the same order on every rank.
        communicator: The group.
        layout: Where parameters and gradients live.
        costs: The cost model the placement and the fusion plan with.
        profiler: Where spans are recorded.
        enabled: Whether this step's passes are captured.
        grad_scale: The loss scale of a ``GradScaler`` (None without one).
    """

    blocks: Sequence[CurvatureBlock]
    communicator: Communicator
    layout: ParameterLayout
    costs: CostModel
    profiler: Profiler
    enabled: Callable[[], bool]
    grad_scale: Callable[[], float] | None = None


@dataclass(frozen=True)
class StageInputs:
    """What a final stage is built from (the assembler's, for one composition).

    Attributes:
        parts: The blocks, group, layout, costs and profiler.
        plan: The composition's placement (owners of the placed factors).
        hooks: The gradient-routing hook registered once on a DDP model (None otherwise).
        gradients: The communicator gradient buckets are reduced over when routed (a
            communication scheduler's gradient stream; None: the group).
    """

    parts: EngineParts
    plan: Plan
    hooks: SwitchableHook | None = None
    gradients: Communicator | None = None


class FinalStage(Protocol):
    """Collect the gradients, agree on the skip, precondition, clip and write back; and
    what the state dict needs of where factors are held."""

    #: Launch times of the gradient buckets when this stage routes them (else None).
    launches: BucketLaunches | None

    def held(self) -> list[CurvatureBlock]:
        """The blocks whose factors this rank keeps."""
        ...

    def collect(self) -> tuple[dict[str, Tensor], bool]:
        """This rank's block gradients (averaged where the stage averages them) and
        whether they are all finite."""
        ...

    def agree(self, usable: bool) -> bool:
        """On a step without a factor exchange: whether every rank may apply the update."""
        ...

    def apply(
        self,
        gradients: Mapping[str, Tensor],
        rates: Mapping[str, float],
        kl_clip: float | None,
        usable: bool,
    ) -> bool:
        """Precondition, clip and write every block's gradient; False (nothing written)
        to skip the step."""
        ...

    def gather_state(self) -> dict[str, dict[str, Tensor | None]] | None:
        """Every block's state on every rank (a collective where owners hold it), or None
        when each rank already holds every block's."""
        ...

    def after_load(self) -> None:
        """Forget what this rank does not hold after a full state was loaded."""
        ...
