"""One iteration of a strategy as per-rank engine programs.

Per rank, in order (names are the profiler's ``kfac/<phase>/<layer>``):

1. ``iteration/all`` opens; ``forward_backward/all`` opens; DDP broadcasts the buffers.
2. Forward, op by op; at a K-FAC layer's pre-hook (before the layer runs) the A product
   (``factor_compute/<layer>/A``, with the Python hook and, with >1 rank, packing into its
   bucket). An eager fusion plan issues every bucket that is now complete, in plan order.
3. Backward, op by op; at a layer's output-gradient hook (before its own backward) the G
   product; when a parameter's gradient is final DDP issues its gradient buckets, in
   order, on the ``default`` channel.
4. ``grad_comm/wait`` until every gradient bucket is reduced; ``forward_backward`` closes.
5. ``step/all``: gradient gather and checks; on factor steps the rest of the factor
   buckets and the weights all-reduce, ``factor_comm/wait`` (unpacking included),
   ``factor_compute/running_average``; otherwise the one-element skip-flag all-reduce
   (``flag_comm/skip``).
6. On inverse steps, :func:`~spdkfac.engine.inversion.invert_factors` as it runs
   (:mod:`spdkfac.sim.inverses`): for each broadcast group in order the owner inverts its
   members (``inverse_compute/<key>``), packs and issues the broadcast, the others issue
   at once; then every rank inverts the NCT factors; then ``inverse_comm/wait`` per group
   (receivers unpack) and ``inverse_comm/failures``, the all-reduce of failure flags.
7. ``precondition/<layer>``, ``precondition/kl_clip``; ``step`` closes; the optimizer step;
   ``iteration`` closes.

A strategy whose owners compute (``StrategySetup.owner_computes``: Osawa et al. 2019's
``osawa``, and ``layer-paths``, which sends only the path planner's owner layers that
way) reduce-scatters its owner-path layers' factors and gradients instead (one reduce per
owner's chunk, then one all-reduce of the replicated-path layers' part,
:mod:`spdkfac.sim.owners`), and replaces steps 5-7 after the factor wait by
:func:`~spdkfac.sim.owners.owner_step`: each rank averages, inverts and preconditions its
own layers and the replicated-path ones (with step 6's broadcasts of their communicated
inverses), then the owners' preconditioned gradients are gathered.

With ``Hardware.rank_spread`` > 0 the ranks compute at different speeds (stragglers), so
faster ranks wait at every collective. Pipelined buckets use a ``factor`` channel of their
own (the real run gives them a second process group; ``Hardware.single_queue`` puts them
on the ``default`` one, as Horovod would); everything else shares the ``default`` channel.
Transfers on different channels share each rank's link (see :mod:`spdkfac.sim.engine`).

Every collective is costed at the real world size by ``Hardware.collective(op, P)``: the
cheapest algorithm for its message of the preset's network, for any
:class:`~spdkfac.sim.collectives.CollectiveOp` (all-reduce, broadcast, reduce,
reduce-scatter, all-gather), so a strategy that reduces factors to owners or gathers
results adds its phase here with ``IterationBuilder.collective(label, channel, op,
nbytes)``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace

from spdkfac.linalg import packed_size
from spdkfac.planning.schedule import FACTORS, GRADIENTS
from spdkfac.profiling import Phase, phase_of, span_name
from spdkfac.sim.builder import (
    BucketLauncher,
    IterationBuilder,
    Launcher,
    ScheduledWindow,
    factor_channel,
    issue,
)
from spdkfac.sim.collectives import CollectiveOp
from spdkfac.sim.inverses import inverse_collectives, inverse_phase
from spdkfac.sim.owners import (
    OwnerCollectives,
    factor_bucket_collectives,
    grad_bucket_collectives,
    owner_step,
)
from spdkfac.sim.program import Close, Collective, Compute, Instruction, Open, Wait
from spdkfac.sim.strategies import StrategySetup
from spdkfac.sim.workload import FactorHook, GradReady, Op

__all__ = ["build_iteration"]


def _launchers(
    builder: IterationBuilder, kfac: bool
) -> tuple[BucketLauncher, BucketLauncher | None]:
    """The gradient buckets' launcher and the factor buckets' (None: no exchange)."""
    setup, workload = builder.setup, builder.costs.workload
    multi = builder.world_size > 1
    fusion = setup.fusion
    if kfac and multi and fusion is not None and setup.window is not None:
        window = ScheduledWindow(
            builder, setup.window, {GRADIENTS: setup.grad_buckets, FACTORS: fusion.buckets}
        )
        return window.stream(GRADIENTS), window.stream(FACTORS)
    numel = dict(workload.parameters)
    if setup.owner_computes:
        grad_ids = grad_bucket_collectives(builder)
    else:
        grad_ids = [
            (
                builder.collective(
                    f"grad bucket {index}",
                    "default",
                    CollectiveOp.ALL_REDUCE,
                    4.0 * sum(numel[name] for name in bucket),
                ),
            )
            for index, bucket in enumerate(setup.grad_buckets)
        ]
    grads = Launcher(builder, setup.grad_buckets, grad_ids)
    if not kfac or not multi or fusion is None:
        return grads, None
    channel = factor_channel(builder)
    dims = {f"{layer.name}/A": layer.a_dim for layer in workload.layers}
    dims |= {f"{layer.name}/G": layer.g_dim for layer in workload.layers}
    if setup.owner_computes:  # owners receive only their layers' factors
        factor_ids = factor_bucket_collectives(builder, channel)
    else:
        factor_ids = [
            (
                builder.collective(
                    f"factor bucket {index}",
                    channel,
                    CollectiveOp.ALL_REDUCE,
                    4.0 * sum(packed_size(dims[key]) for key in bucket),
                ),
            )
            for index, bucket in enumerate(fusion.buckets)
        ]
    return grads, Launcher(builder, fusion.buckets, factor_ids)


def _passes(
    builder: IterationBuilder, factor_step: bool, out: list[Instruction]
) -> BucketLauncher | None:
    """Forward and backward; returns the factor buckets' launcher (None: no exchange)."""
    setup, costs = builder.setup, builder.costs
    workload = costs.workload
    multi = builder.world_size > 1
    kfac = factor_step and setup.strategy.uses_kfac
    fusion = setup.fusion
    grads, factors = _launchers(builder, kfac)
    pending = 0.0
    handed: set[str] = set()
    out.append(Open(span_name(Phase.FORWARD_BACKWARD)))
    if multi and workload.buffer_bytes and costs.hardware.broadcast_buffers:
        buffers = builder.collective(
            "buffers", "default", CollectiveOp.BROADCAST, workload.buffer_bytes
        )
        issue(builder, buffers, out)
        out.append(Wait((buffers,)))
    for item in (*workload.forward, *workload.backward):
        if isinstance(item, Op):
            pending += costs.op(item)
        elif isinstance(item, GradReady):
            if multi:
                out.append(Compute(pending))
                pending = 0.0
                grads.ready(item.parameter, out)
        elif kfac and isinstance(item, FactorHook):
            out.append(Compute(pending))
            pending = 0.0
            key = f"{item.layer}/{item.kind}"
            seconds = costs.factor(workload.layer(item.layer), item.kind)
            out.append(Compute(seconds, span_name(Phase.FACTOR_COMPUTE, key)))
            # The first call hands the factor over (accumulation_steps=1).
            if factors is not None and fusion is not None and key not in handed:
                handed.add(key)
                name = span_name(Phase.FACTOR_COMPUTE, key)  # launches happen inside the hook
                factors.ready(key, out, eager=fusion.eager, name=name)
    out.append(Compute(pending))
    if multi:
        grads.flush(out, force=True)
        out.append(Wait(grads.all_ids, span_name(Phase.GRAD_COMM, "wait")))
    out.append(Close(span_name(Phase.FORWARD_BACKWARD)))
    return factors


def _factor_wait(
    builder: IterationBuilder, factors: BucketLauncher, out: list[Instruction]
) -> None:
    """The rest of the factor buckets, the weights all-reduce and the wait for all."""
    layers = builder.costs.workload.layers
    channel = factor_channel(builder)
    factors.flush(out, force=True)  # finish(): the rest, in plan order
    weights = builder.collective(
        "factor weights", channel, CollectiveOp.ALL_REDUCE, 8.0 * (2 * len(layers) + 1)
    )
    issue(builder, weights, out)
    out.append(Wait((*factors.all_ids, weights), span_name(Phase.FACTOR_COMM, "wait")))


def _factor_phase(
    builder: IterationBuilder, factors: BucketLauncher | None, out: list[Instruction]
) -> None:
    costs = builder.costs
    if factors is not None:
        _factor_wait(builder, factors, out)
        out.append(Compute(costs.unpack_factors(), span_name(Phase.FACTOR_COMM, "unpack")))
    out.append(Compute(costs.running_average(), span_name(Phase.FACTOR_COMPUTE, "running_average")))


def _step_prologue(
    builder: IterationBuilder,
    factor_step: bool,
    factors: BucketLauncher | None,
    out: list[Instruction],
) -> None:
    """From the step's start to the inverse phase: gradient checks, then on factor steps
    the factor wait (and, unless owners compute, the running average), otherwise the
    skip-flag all-reduce (owners agree in the KL all-reduce instead)."""
    setup, costs = builder.setup, builder.costs
    owners = setup.owner_computes
    out.append(Compute(costs.step_prologue(factor_step)))
    if factor_step and owners:
        assert factors is not None
        _factor_wait(builder, factors, out)
    elif factor_step:
        _factor_phase(builder, factors, out)
    elif builder.world_size > 1 and not owners:
        flag = builder.collective("skip flag", "default", CollectiveOp.ALL_REDUCE, 4.0)
        issue(builder, flag, out)
        out.append(Wait((flag,), span_name(Phase.FLAG_COMM, "skip")))


def _suffix(builder: IterationBuilder) -> list[Instruction]:
    """After the inverse phase: preconditioning and the KL clip (unless owners compute:
    theirs is in their step), the step's end and the optimizer."""
    setup, costs = builder.setup, builder.costs
    suffix: list[Instruction] = []
    if setup.strategy.uses_kfac and not setup.owner_computes:
        for layer in costs.workload.layers:
            suffix.append(
                Compute(costs.precondition(layer), span_name(Phase.PRECONDITION, layer.name))
            )
        suffix.append(Compute(costs.kl_clip(), span_name(Phase.PRECONDITION, "kl_clip")))
    return [
        *suffix,
        Close(span_name(Phase.STEP)),
        Compute(costs.optimizer()),
        Close(span_name(Phase.ITERATION)),
    ]


def build_iteration(
    setup: StrategySetup,
    *,
    factor_step: bool,
    inverse_step: bool,
    jitter: Sequence[Mapping[str, float]] | None = None,
    ranks: Sequence[int] | None = None,
) -> tuple[list[list[Instruction]], list[Collective]]:
    """Programs of every rank and the collectives for one iteration of ``setup``.

    Args:
        setup: The strategy's plans (see :func:`~spdkfac.sim.strategies.prepare`).
        factor_step: Whether factors are computed and exchanged this iteration.
        inverse_step: Whether inverses are recomputed this iteration.
        jitter: Per rank, a further factor on its compute times this iteration, by phase
            (:data:`JITTER_PHASES`; a missing phase: 1).
        ranks: The ranks to build programs for, one each in this order (default: every
            rank). Collectives still cost what they cost on every rank, but their
            participants are the positions in ``ranks``: simulating one rank of each class
            of identical ranks (:func:`~spdkfac.sim.simulator.rank_classes`) then gives
            exactly the timelines of the whole world.
    """
    ranks = range(setup.costs.world_size) if ranks is None else ranks
    builder = IterationBuilder(setup, ranks)
    kfac, owners = setup.strategy.uses_kfac, setup.owner_computes
    # Collectives are numbered as they are made: passes, step prologue, inverse phase.
    prefix: list[Instruction] = [Open(span_name(Phase.ITERATION))]
    factors = _passes(builder, factor_step, prefix)
    prefix.append(Open(span_name(Phase.STEP)))
    if kfac:
        _step_prologue(builder, factor_step, factors, prefix)
    inverses = kfac and inverse_step
    inverse_ids = (
        inverse_collectives(builder) if inverses and builder.world_size > 1 and not owners else []
    )
    suffix = _suffix(builder)
    shared = None
    if owners:
        shared = OwnerCollectives(builder, factor_step=factor_step, inverse_step=inverse_step)
    programs: list[list[Instruction]] = []
    speeds = rank_speeds(builder.world_size, builder.costs.hardware.rank_spread)
    for rank in ranks:
        middle: list[Instruction] = []
        if shared is not None:
            middle = owner_step(builder, shared, rank)
        elif inverses:
            inverse_phase(builder, rank, middle, inverse_ids)
        program = prefix + middle + suffix
        by_phase = {} if jitter is None else jitter[rank]
        if speeds[rank] != 1.0 or by_phase:
            program = _scaled(program, speeds[rank], by_phase)
        programs.append(program)
    return programs, builder.collectives


#: Phases whose compute times vary independently from one iteration to the next.
JITTER_PHASES: tuple[Phase, ...] = (
    Phase.FORWARD_BACKWARD,
    Phase.FACTOR_COMPUTE,
    Phase.FACTOR_COMM,
    Phase.INVERSE_COMPUTE,
    Phase.PRECONDITION,
    Phase.STEP,
    Phase.ITERATION,
)


def _scaled(
    program: list[Instruction], speed: float, factors: Mapping[str, float]
) -> list[Instruction]:
    """``program`` with every computation scaled by ``speed`` and by the factor of its
    phase: its own span's, else the innermost open span's."""
    scaled: list[Instruction] = []
    open_phases: list[str] = []
    for step in program:
        if isinstance(step, Open):
            open_phases.append(phase_of(step.name))
        elif isinstance(step, Close):
            open_phases.pop()
        elif isinstance(step, Compute):
            phase = phase_of(step.name) if step.name else (open_phases or [Phase.ITERATION])[-1]
            step = replace(step, seconds=step.seconds * speed * factors.get(phase, 1.0))
        scaled.append(step)
    return scaled


def rank_speeds(world_size: int, spread: float) -> list[float]:
    """Time factor of each rank's computation: ``1 + spread·z`` with ``z`` the normal
    quantiles at (r + ½)/P, scaled to unit standard deviation (±1 for two ranks)."""
    if world_size < 2 or spread == 0:
        return [1.0] * world_size
    normal = statistics.NormalDist()
    quantiles = [normal.inv_cdf((rank + 0.5) / world_size) for rank in range(world_size)]
    scale = statistics.pstdev(quantiles)
    return [1.0 + spread * z / scale for z in quantiles]
