"""The parameter-layout seam: what the engine asks of where parameters and gradients live.

A layout answers five questions, so that nothing else in the package assumes a plain or
``DistributedDataParallel`` model: which module holds the user's layers (names, hooks,
state keys are the user's), how a parameter's full gradient is read and written, over
which ranks the KL clip's partial sum must still be reduced, which blocks' factor
statistics this rank forms (ranks that read the same batch split them), and whether the
wrapper's gradient reduction can be routed through a communication hook of the
preconditioner's (the owner-computes exchange, the priority scheduler). A new wrapper (FSDP2's
``fully_shard``) is one new class, chosen in :func:`spdkfac.layout.layout_of`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from torch import Tensor, nn

from spdkfac.comm import Communicator
from spdkfac.layers import GradientAccess
from spdkfac.planning.factor_split import FactorShare

__all__ = ["GradientHook", "ParameterLayout", "unwrap_compiled"]

#: A gradient-bucket communication hook (``DistributedDataParallel.register_comm_hook``).
GradientHook = Callable[[Any, Any], Any]


class ParameterLayout(Protocol):
    """Where a model's parameters and gradients live (module docstring).

    Attributes:
        name: ``"plain"``, ``"ddp"``, ``"fsdp"`` or ``"tp"`` (reports and error messages).
        module: The user's module, inside every wrapper.
        gradients: How each parameter's full gradient is read and written.
        reduces_gradients: The wrapper averages gradients over the group during
            backward (DDP, FSDP2): the preconditioner must not reduce them again.
    """

    name: str
    module: nn.Module
    gradients: GradientAccess
    reduces_gradients: bool

    @property
    def routes_gradients(self) -> bool:
        """Whether :meth:`route_gradients` can take over the gradient reduction."""
        ...

    def route_gradients(self, hook: GradientHook) -> None:
        """Reduce the wrapper's gradient buckets through ``hook`` from now on.

        Raises:
            ValueError: The wrapper cannot take the hook (it has one already).
        """
        ...

    def owner_gradients(
        self, communicator: Communicator, params: Sequence[Tensor], owners: Sequence[int]
    ) -> GradientAccess:
        """The access an owner-computes stage reads its layers' averaged gradients through:
        :attr:`gradients` where every rank holds whole gradients; under FSDP2 each owner's
        gathered ones (a collective over ``communicator``, on every rank, with the same
        ``params`` and ``owners``, ``EVERYONE`` for parameters every rank reads)."""
        ...

    def factor_share(
        self, communicator: Communicator, blocks: Sequence[tuple[str, float]]
    ) -> FactorShare:
        """Which of ``blocks`` (``(name, Gram cost)``, in the same order on every rank)
        this rank forms the factor statistics of: every one where no other rank of
        ``communicator`` reads this rank's batch; under tensor parallelism its share of
        its group's :func:`~spdkfac.planning.factor_split.plan_factor_split` (no
        collective)."""
        ...

    def clip_sum(self, partial: float) -> float:
        """The KL clip's sum over every block from this rank's ``partial`` sum over the
        blocks it preconditioned (the identity where each rank preconditions complete
        gradients)."""
        ...


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """``model`` inside any ``torch.compile`` wrapper.

    Raises:
        ValueError: A module compiled with ``fullgraph=True``.
    """
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        if getattr(getattr(model, "dynamo_ctx", None), "fullgraph", False):
            raise ValueError(
                "model: torch.compile(..., fullgraph=True) is not supported: K-FAC's "
                "capture hooks run Python that Dynamo cannot put in one graph; compile "
                "with the default fullgraph=False (the hooks then break the graph only "
                "around the registered layers)"
            )
        inner = model._orig_mod  # torch.compile's OptimizedModule
        assert isinstance(inner, nn.Module)
        model = inner
    return model
