"""The last stage of Osawa et al.'s hybrid exchange: owners precondition, all-gather.

Osawa et al. 2019 ("Large-scale distributed second-order optimization using
Kronecker-factored approximate curvature", Sec. 3, Fig. 1): every registered layer has
one owner (the placement's :class:`~spdkfac.planning.placement.Plan`). Gradients reach the owners
averaged by a reduce-scatter — under ``DistributedDataParallel`` through a communication
hook that replaces DDP's all-reduce, otherwise issued here at the step — the owner
preconditions its layers with the factors and inverses only it holds, and the
preconditioned gradients are all-gathered, so every rank applies the same update.
Blocks without placed factors (normalization layers, grouped convolutions), the layers
a ``layer-paths`` plan sends the replicated way (:mod:`spdkfac.planning.paths`: not in
its ``owner_layers``) and parameters of no block are averaged on every rank (all-gathered
whole under FSDP2) and preconditioned everywhere, as in the other strategies.

One small all-reduce per step carries the KL clip's partial sums, a non-finite flag and
which owned layers have a gradient; every rank decides from its result alone whether to
skip and which segments the all-gather holds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from spdkfac.comm import Communicator
from spdkfac.comm.ddp_hooks import (
    BucketLaunches,
    owner_reduce_hook,
)
from spdkfac.comm.owners import EVERYONE, gather_from_owners, reduce_to_owners
from spdkfac.curvature import CurvatureBlock
from spdkfac.engine.clip import clip_from_sum, clip_terms
from spdkfac.engine.final import StageInputs
from spdkfac.engine.replicated import block_gradients
from spdkfac.linalg import all_finite
from spdkfac.planning.placement import EVERY_RANK, Plan
from spdkfac.profiling import Phase, span_name

__all__ = [
    "OwnerStage",
    "block_owners",
    "drop_unowned",
    "gather_states",
]


def block_owners(blocks: Sequence[CurvatureBlock], plan: Plan) -> dict[str, int]:
    """Owner rank of each of the plan's owner layers; ``EVERYONE`` for the other blocks
    (without placed factors, or a ``layer-paths`` plan's replicated layers).

    Raises:
        ValueError: When an owner layer's factors have different owners.
    """
    owners = plan.owner_by_key
    result: dict[str, int] = {}
    for block in blocks:
        if block.name not in plan.owner_layers:
            result[block.name] = EVERYONE
            continue
        ranks = {owners[spec.key] for spec in block.inverse_specs()}
        if len(ranks) > 1 or EVERY_RANK in ranks:
            raise ValueError(
                f"placement={plan.placement!r} splits layer {block.name!r} over ranks "
                f"{sorted(ranks)}: the owner-computes exchange needs one owner per layer"
            )
        result[block.name] = ranks.pop() if ranks else EVERYONE
    return result


class OwnerStage:
    """Gradients to owners, owners precondition, all-gather (see the module docstring).

    Args:
        inputs: The engine's parts, the plan whose owners precondition, and (for a layout
            whose gradient reduction is routed, on several ranks) the routing hook and the
            communicator buckets are reduced over.

    Raises:
        ValueError: When the placement splits a layer.
    """

    def __init__(self, inputs: StageInputs) -> None:
        parts = inputs.parts
        blocks, communicator = parts.blocks, parts.communicator
        self._blocks = blocks
        self._communicator = communicator
        self._profiler = parts.profiler
        self._layout = parts.layout
        self.owner_of = block_owners(blocks, inputs.plan)
        self._parameters = [p for p in parts.layout.module.parameters() if p.requires_grad]
        self._block_parameters = {
            block.name: [p for p in block.module.parameters(recurse=False) if p.requires_grad]
            for block in blocks
        }
        param_owner = {
            id(p): self.owner_of[name]
            for name, params in self._block_parameters.items()
            for p in params
            if self.owner_of[name] != EVERYONE
        }
        self._param_owner = param_owner
        routed = parts.layout.routes_gradients and communicator.world_size > 1
        # A wrapper that averages gradients itself (FSDP2; DDP on one rank) needs nothing.
        self.reduces_in_step = not routed and not parts.layout.reduces_gradients
        #: Launch times of the routed buckets (None when gradients reduce at the step).
        self.launches: BucketLaunches | None = None
        if routed:
            hooks = inputs.hooks
            assert hooks is not None, "a routed layout needs the assembler's routing hook"
            self.launches = hooks.launches
            group = inputs.gradients or communicator
            hooks.use(owner_reduce_hook(group, param_owner, hooks.launches))

    def _mine(self, block: CurvatureBlock) -> bool:
        return self.owner_of[block.name] in (EVERYONE, self._communicator.rank)

    def held(self) -> list[CurvatureBlock]:
        """The blocks whose factors this rank keeps: its own and everyone's."""
        return [block for block in self._blocks if self._mine(block)]

    # ------------------------------------------------------------------ the stages
    def collect(self) -> tuple[dict[str, Tensor], bool]:
        """This rank's own and everyone's block gradients, averaged, and whether finite.

        Without DDP this issues the reduce-scatter (and the all-reduce of parameters
        without an owner): gradients must not have been averaged before (if they were,
        the result is the same, averaging again only costs time).
        """
        if self.reduces_in_step and self._communicator.world_size > 1:
            with self._profiler.span(span_name(Phase.GRAD_COMM, "reduce_scatter")):
                self._reduce_in_step()
        owners = [self._param_owner.get(id(p), EVERYONE) for p in self._parameters]
        access = self._layout.owner_gradients(self._communicator, self._parameters, owners)
        mine = (b for b in self._blocks if self._mine(b))
        gradients = block_gradients(mine, access)
        return gradients, all_finite(list(gradients.values()))

    def _reduce_in_step(self) -> None:
        """Average every parameter's gradient to its owner (a missing one counts as zero;
        it stays missing where no rank had one)."""
        params = self._parameters
        present = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64)
        pieces = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        owners = [self._param_owner.get(id(p), EVERYONE) for p in params]
        wide = any(p.dtype == torch.float64 for p in params)
        reduce_to_owners(
            self._communicator,
            [*pieces, present],
            [*owners, EVERYONE],
            dtype=torch.float64 if wide else torch.float32,
        ).wait()
        for param, piece, seen in zip(params, pieces, present.tolist(), strict=True):
            if seen > 0 and param.grad is None:
                param.grad = piece

    def agree(self, usable: bool) -> bool:
        """Nothing to agree yet: :meth:`apply`'s all-reduce carries the flag."""
        return usable

    def apply(
        self,
        gradients: Mapping[str, Tensor],
        rates: Mapping[str, float],
        kl_clip: float | None,
        usable: bool,
    ) -> bool:
        """Precondition this rank's blocks, agree on the clip and the skip, all-gather the
        owners' results and write every block's gradient. Collective.

        Returns:
            False (no gradient written) when some rank saw a non-finite value.
        """
        rank = self._communicator.rank
        preconditioned: dict[str, Tensor] = {}
        for block in self._blocks:
            if block.name in gradients:
                with self._profiler.span(span_name(Phase.PRECONDITION, block.name)):
                    preconditioned[block.name] = block.precondition(gradients[block.name])
        owned = [b for b in self._blocks if self.owner_of[b.name] == rank]
        shared = [b for b in self._blocks if self.owner_of[b.name] == EVERYONE]
        with self._profiler.span(span_name(Phase.PRECONDITION, "kl_clip")):
            own_sum = clip_terms(
                gradients,
                {b.name: preconditioned[b.name] for b in owned if b.name in gradients},
                rates,
            )
            shared_sum = clip_terms(
                gradients,
                {b.name: preconditioned[b.name] for b in shared if b.name in gradients},
                rates,
            )
        agreed = self._agree(own_sum, usable, preconditioned)
        if agreed is None:
            return False
        total, present = agreed
        scale = clip_from_sum(total + self._layout.clip_sum(shared_sum), kl_clip)
        if scale is None:
            return False
        self._gather_and_write(preconditioned, present, scale)
        return True

    def _agree(
        self, own_sum: float, usable: bool, preconditioned: Mapping[str, Tensor]
    ) -> tuple[float, set[str]] | None:
        """One all-reduce: the clip's sum over owners, any rank's non-finite flag, and the
        owned blocks that have a gradient. None when the step must be skipped."""
        rank = self._communicator.rank
        names = [b.name for b in self._blocks]
        flags = [float(self.owner_of[name] == rank and name in preconditioned) for name in names]
        local = torch.tensor(
            [own_sum, 0.0 if usable else 1.0, *flags],
            dtype=torch.float64,
            device=self._communicator.device,
        )
        with self._profiler.span(span_name(Phase.FLAG_COMM, "kl_clip")):
            reduced = self._communicator.all_reduce_sum(local).wait().cpu().tolist()
        total, flagged = reduced[0], reduced[1]
        if flagged > 0 or not torch.isfinite(torch.tensor(total)):
            return None
        present = {name for name, seen in zip(names, reduced[2:], strict=True) if seen > 0}
        return total, present

    def _gather_and_write(
        self, preconditioned: Mapping[str, Tensor], present: set[str], scale: float
    ) -> None:
        rank, world = self._communicator.rank, self._communicator.world_size
        segments: list[list[CurvatureBlock]] = [[] for _ in range(world)]
        for block in self._blocks:
            owner = self.owner_of[block.name]
            if owner != EVERYONE and block.name in present:
                segments[owner].append(block)
        shapes = {b.name: self._matrix_shape(b, preconditioned) for s in segments for b in s}
        sizes = [sum(_numel(shapes[b.name]) for b in segment) for segment in segments]
        dtype = torch.float64 if any(b.dtype == torch.float64 for b in self._blocks) else None
        dtype = dtype or torch.float32
        mine = torch.cat(
            [preconditioned[b.name].reshape(-1).to(dtype) for b in segments[rank]]
            or [torch.zeros(0, dtype=dtype)]
        ).to(self._communicator.device)
        with self._profiler.span(span_name(Phase.GRAD_COMM, "all_gather")):
            futures = gather_from_owners(self._communicator, sizes, mine)
            received = [future.wait() for future in futures]
        with self._profiler.span(span_name(Phase.PRECONDITION, "write")):
            for segment, flat in zip(segments, received, strict=True):
                offset = 0
                for block in segment:
                    shape = shapes[block.name]
                    size = _numel(shape)
                    matrix = flat[offset : offset + size].view(shape)
                    offset += size
                    self._write(block, matrix.to(device=block.device, dtype=block.dtype), scale)
            for block in self._blocks:
                if self.owner_of[block.name] == EVERYONE and block.name in preconditioned:
                    self._write(block, preconditioned[block.name], scale)

    def gather_state(self) -> dict[str, dict[str, Tensor | None]] | None:
        """Every block's state on every rank, from the owners (a collective on several
        ranks; None on one, where this rank holds everything)."""
        if self._communicator.world_size == 1:
            return None
        return gather_states(self._blocks, self.owner_of, self._communicator)

    def after_load(self) -> None:
        """Forget the state of the blocks other ranks own (owners were planned for this
        world size)."""
        drop_unowned(self._blocks, self.owner_of, self._communicator.rank)

    def _matrix_shape(
        self, block: CurvatureBlock, preconditioned: Mapping[str, Tensor]
    ) -> tuple[int, ...]:
        """Shape of a block's gradient matrix, known on every rank."""
        if block.name in preconditioned:
            return tuple(preconditioned[block.name].shape)
        shapes = block.state_shapes()
        if "g_factor" in shapes and "a_factor" in shapes:
            return (shapes["g_factor"][0], shapes["a_factor"][0])
        raise AssertionError(f"{block.name} has no placed factors and no owner")

    def _write(self, block: CurvatureBlock, matrix: Tensor, scale: float) -> None:
        for param in self._block_parameters[block.name]:
            if param.grad is None and param.requires_grad:  # not one frozen since (I7)
                param.grad = torch.zeros_like(param)
        block.set_gradient(matrix.mul_(scale) if scale != 1.0 else matrix, self._layout.gradients)


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def gather_states(
    blocks: Sequence[CurvatureBlock], owner_of: Mapping[str, int], communicator: Communicator
) -> dict[str, dict[str, Tensor | None]]:
    """Every block's state on every rank, from the owners (a collective).

    One all-reduce says which entries exist at their owners, then one broadcast per
    existing owned entry (in block order) copies it bit for bit. Blocks without an owner
    are replicated already: their local state is used.
    """
    rank = communicator.rank
    entries = [
        (block, key, shape)
        for block in blocks
        if owner_of[block.name] != EVERYONE
        for key, shape in block.state_shapes().items()
    ]
    local = {block.name: block.state() for block in blocks}
    exists = torch.tensor(
        [
            float(owner_of[block.name] == rank and local[block.name][key] is not None)
            for block, key, _ in entries
        ],
        dtype=torch.float64,
        device=communicator.device,
    )
    if entries:
        exists = communicator.all_reduce_sum(exists).wait()
    states = {block.name: dict(local[block.name]) for block in blocks}
    for (block, key, shape), seen in zip(entries, exists.tolist(), strict=True):
        owner = owner_of[block.name]
        if seen <= 0:
            states[block.name][key] = None
            continue
        value = local[block.name][key]
        # Sent in the statistics dtype (exact for values stored in bf16 / fp16): every
        # rank knows it, where a storage dtype is the owner's own business.
        buffer = (
            value.detach().to(device=communicator.device, dtype=block.dtype, copy=True)
            if owner == rank and value is not None
            else torch.empty(shape, dtype=block.dtype, device=communicator.device)
        )
        states[block.name][key] = communicator.broadcast(buffer, src=owner).wait().to(block.device)
    return states


def drop_unowned(blocks: Sequence[CurvatureBlock], owner_of: Mapping[str, int], rank: int) -> None:
    """Forget the state of the blocks another rank owns (after loading a full state)."""
    for block in blocks:
        if owner_of[block.name] not in (EVERYONE, rank):
            block.restore(dict.fromkeys(block.state_shapes()))
