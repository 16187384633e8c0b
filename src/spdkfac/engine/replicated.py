"""The final stage when every rank holds every averaged gradient (DDP, or gradients
all-reduced by the caller): every rank preconditions every block, scales by the KL clip and
writes the result back."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from spdkfac.comm import BucketLaunches
from spdkfac.curvature import CurvatureBlock
from spdkfac.engine.clip import clip_from_sum, clip_terms
from spdkfac.engine.final import StageInputs
from spdkfac.layers import LOCAL_GRADIENTS, GradientAccess
from spdkfac.linalg import all_finite
from spdkfac.profiling import Phase, span_name

__all__ = ["ReplicatedStage", "block_gradients"]


def block_gradients(
    blocks: Iterable[CurvatureBlock], access: GradientAccess = LOCAL_GRADIENTS
) -> dict[str, Tensor]:
    """Each block's gradient matrix in its statistics dtype (float32 for bf16/fp16
    parameters); blocks without a gradient are left out."""
    return {
        block.name: grad.to(block.dtype)
        for block in blocks
        if (grad := block.gradient(access)) is not None
    }


class ReplicatedStage:
    """The final stage when every rank holds every averaged gradient (module docstring).

    Args:
        inputs: The engine's parts (the plan is unused: every rank preconditions every
            block).
    """

    launches: BucketLaunches | None = None

    def __init__(self, inputs: StageInputs) -> None:
        parts = inputs.parts
        self._blocks = parts.blocks
        self._communicator = parts.communicator
        self._profiler = parts.profiler
        self._layout = parts.layout

    def held(self) -> list[CurvatureBlock]:
        """The blocks whose factors this rank keeps: all of them."""
        return list(self._blocks)

    def collect(self) -> tuple[dict[str, Tensor], bool]:
        """The blocks' gradients and whether they are all finite (this rank's view)."""
        gradients = block_gradients(self._blocks, self._layout.gradients)
        return gradients, all_finite(list(gradients.values()))

    def agree(self, usable: bool) -> bool:
        """Skip on every rank or on none: gradients need not be replicated (no DDP)."""
        if self._communicator.world_size == 1:
            return usable
        with self._profiler.span(span_name(Phase.FLAG_COMM, "skip")):
            flag = torch.tensor([0.0 if usable else 1.0], device=self._communicator.device)
            return float(self._communicator.all_reduce_max(flag).wait()) == 0.0

    def apply(
        self,
        gradients: Mapping[str, Tensor],
        rates: Mapping[str, float],
        kl_clip: float | None,
        usable: bool,
    ) -> bool:
        """Precondition, clip and write back; False (nothing written) to skip the step."""
        if not usable:
            return False
        preconditioned = {}
        for block in self._blocks:
            if block.name in gradients:
                with self._profiler.span(span_name(Phase.PRECONDITION, block.name)):
                    preconditioned[block.name] = block.precondition(gradients[block.name])
        with self._profiler.span(span_name(Phase.PRECONDITION, "kl_clip")):
            partial = clip_terms(gradients, preconditioned, rates)
            scale = clip_from_sum(self._layout.clip_sum(partial), kl_clip)
            if scale is None:
                return False
            for block in self._blocks:
                if block.name in preconditioned:
                    matrix = preconditioned[block.name]
                    scaled = matrix.mul_(scale) if scale != 1.0 else matrix
                    block.set_gradient(scaled, self._layout.gradients)
        return True

    def gather_state(self) -> None:
        """Every rank holds every block's state already."""
        return None

    def after_load(self) -> None:
        """Every rank keeps everything."""
