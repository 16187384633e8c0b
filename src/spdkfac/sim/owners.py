"""The owner stage: Osawa et al. 2019's owner-computes step as per-rank engine programs,
and ``layer-paths``' composition of it with SPD-KFAC's replicated path.

Osawa et al. 2019 ("Large-scale distributed second-order optimization using
Kronecker-factored approximate curvature", Sec. 3, Fig. 1) send every layer to one owner,
placed by :func:`~spdkfac.planning.placement.plan_layer_owners`. ``layer-paths`` sends only
the ``owner_layers`` of :func:`~spdkfac.planning.paths.plan_gradient_paths` that way; its
other layers take the replicated path of SPD-KFAC (Shi, Zhang, Li 2021, "Accelerating
Distributed K-FAC with Smart Parallelism of Computing and Communication Tasks", Sec. 4).
With those owner-path layers
(:attr:`~spdkfac.sim.strategies.StrategySetup.layer_owners`), a row with
``owner_computes`` (``osawa``, ``osawa-pipelined``, ``layer-paths``) on P > 1 ranks runs:

1. forward and backward as every strategy, A and G computed locally on every rank;
2. the factor buckets of the fusion plan are *reduce-scattered* (each owner receives its
   layers' factors) and, when a bucket holds replicated-path factors, those are
   all-reduced after, as the real exchange lays a bucket out (owners' chunks first, the
   ``EVERY_RANK`` slots last); then the small weights all-reduce as today;
3. DDP's gradient buckets, in the same order, are reduce-scattered too (a communication
   hook): per bucket the reduce-scatter of the owner-path layers' gradients and one
   all-reduce of the rest (replicated-path layers, and parameters of layers nobody owns,
   such as norm layers) when it has any;
4. each rank unpacks and averages only the factors it holds (its own owner-path layers'
   and every replicated-path layer's), after one 4-byte all-reduce agrees that they are
   all finite (``kfac/factor_comm/finite``); on inverse steps the inverse phase of
   :mod:`spdkfac.sim.inverses`: the replicated-path layers' communicated inverses are
   inverted by their placed owner and broadcast in the row's groups, while every rank
   inverts the non-communicated ones and its own owner-path layers' factors (an owner's
   results are never broadcast); the failure flags of every factor are agreed by one
   all-reduce;
5. each rank preconditions the layers it holds and computes its part of the KL clip,
   ``⟨V, ∇⟩`` over them (``kfac/precondition/kl_clip``); one all-reduce of
   ``2 + layers`` float64 carries the owners' clip sum, the skip flag and which layers have
   a gradient (``kfac/flag_comm/kl_clip``; it replaces the skip-flag all-reduce of other
   steps); then the owners' preconditioned gradients are gathered, as the real code does
   it, by one broadcast per owner in rank order (its owner-path layers' ``g·a``
   elements; ranks owning nothing send nothing), waited for as
   ``kfac/grad_comm/all_gather``, and every rank scales every layer's result by ν into
   ``.grad`` (``kfac/precondition/write``);
6. the optimizer step.

A ``layer-paths`` plan with no owner-path layer still runs this stage, as the real run
builds the owner stage for the row whatever its plan: no reduce and no gather, but the
finite flag and the KL all-reduce where the replicated rows have a skip flag on steps
without factors. With every layer on the owner path it is ``osawa``'s step.

Each reduce-scatter (ReduceScatterV: a buffer split by layer owner into uneven chunks) is
what the real ``TorchDistributedCommunicator.reduce_scatter`` issues: one *reduce* per
owner with a non-empty chunk, to that owner, of that chunk only, in rank order, all on
the bucket's channel (so they run one after another, each paying its own start-up).
Collectives are costed with :meth:`Hardware.collective` like every other; a reduce of
``n`` bytes costs what a broadcast of ``n`` bytes does on the same network (a broadcast
run backwards, :data:`~spdkfac.sim.collectives.MIRRORS`; the reduction arithmetic is not
costed separately), so each chunk's bytes cross each link about once, whatever the other
chunks' sizes. The gather is the same pattern forwards: one broadcast per owner.
"""

from __future__ import annotations

from spdkfac.linalg import packed_size
from spdkfac.profiling import Phase, span_name
from spdkfac.sim.builder import IterationBuilder, issue
from spdkfac.sim.collectives import CollectiveOp
from spdkfac.sim.inverses import inverse_collectives, inverse_phase
from spdkfac.sim.program import Compute, Instruction, Wait
from spdkfac.sim.strategies import StrategySetup

__all__ = [
    "OwnerCollectives",
    "factor_bucket_collectives",
    "gather_sizes",
    "grad_bucket_collectives",
    "owner_step",
    "scatter_chunks",
]


def _factor_dims(setup: StrategySetup) -> dict[str, int]:
    return {
        f"{layer.name}/{kind}": dim
        for layer in setup.costs.workload.layers
        for kind, dim in (("A", layer.a_dim), ("G", layer.g_dim))
    }


def scatter_chunks(setup: StrategySetup) -> dict[str, list[dict[int, float]]]:
    """Per reduce-scattered bucket, the bytes each owner receives, in rank order and
    without empty chunks: ``"factors"``, the fusion plan's buckets (packed triangles), and
    ``"gradients"``, DDP's buckets (owner-path layers' parameters only; the rest are
    all-reduced). Empty without the owner stage."""
    workload = setup.costs.workload
    if not setup.owner_computes or setup.fusion is None:
        return {"factors": [], "gradients": []}
    dims = _factor_dims(setup)
    numel = dict(workload.parameters)
    owners = setup.layer_owners
    pieces: dict[str, list[list[tuple[int | None, int]]]] = {
        "factors": [
            [(owners.get(key.rpartition("/")[0]), packed_size(dims[key])) for key in bucket]
            for bucket in setup.fusion.buckets
        ],
        "gradients": [
            [(setup.parameter_owner(name), numel[name]) for name in bucket]
            for bucket in setup.grad_buckets
        ],
    }
    chunks: dict[str, list[dict[int, float]]] = {}
    for exchange, buckets in pieces.items():
        chunks[exchange] = []
        for bucket in buckets:
            sizes: dict[int, float] = {}
            for owner, elements in bucket:
                if owner is not None and elements:
                    sizes[owner] = sizes.get(owner, 0.0) + 4.0 * elements
            chunks[exchange].append(dict(sorted(sizes.items())))
    return chunks


def _reduces(
    builder: IterationBuilder, label: str, channel: str, chunks: dict[int, float], total: float
) -> tuple[int, ...]:
    """One reduce per owner of ``chunks`` (rank order), as ``reduce_scatter`` issues them,
    then one all-reduce of the rest of the ``total`` bytes, when there is a rest."""
    ids = [
        builder.collective(f"{label} to {owner}", channel, CollectiveOp.REDUCE, nbytes)
        for owner, nbytes in chunks.items()
    ]
    rest = total - sum(chunks.values())
    if rest:
        op = CollectiveOp.ALL_REDUCE
        ids.append(builder.collective(f"{label} (no owner)", channel, op, rest))
    return tuple(ids)


def factor_bucket_collectives(builder: IterationBuilder, channel: str) -> list[tuple[int, ...]]:
    """Per factor bucket of the fusion plan its collectives on ``channel``: the reduces to
    the owners and then, when the bucket holds replicated-path factors, their all-reduce."""
    setup = builder.setup
    assert setup.fusion is not None
    dims = _factor_dims(setup)
    owned = scatter_chunks(setup)["factors"]
    return [
        _reduces(
            builder,
            f"factor bucket {index}",
            channel,
            chunks,
            4.0 * sum(packed_size(dims[key]) for key in bucket),
        )
        for index, (bucket, chunks) in enumerate(zip(setup.fusion.buckets, owned, strict=True))
    ]


def grad_bucket_collectives(builder: IterationBuilder) -> list[tuple[int, ...]]:
    """Per DDP bucket its collectives: the reduces of owner-path layers' gradients to
    their owners and then, when the bucket holds other parameters, their all-reduce."""
    setup = builder.setup
    numel = dict(setup.costs.workload.parameters)
    owned = scatter_chunks(setup)["gradients"]
    return [
        _reduces(
            builder, f"grad bucket {index}", "default", chunks, 4.0 * sum(numel[n] for n in bucket)
        )
        for index, (bucket, chunks) in enumerate(zip(setup.grad_buckets, owned, strict=True))
    ]


def gather_sizes(setup: StrategySetup) -> list[tuple[int, float]]:
    """(owner, bytes) of each broadcast of the preconditioned gradients, in rank order:
    each owner's owner-path layers' ``g·a`` float32 elements."""
    sizes: dict[int, float] = {}
    for layer in setup.costs.workload.layers:
        owner = setup.layer_owners.get(layer.name)
        if owner is not None:
            sizes[owner] = sizes.get(owner, 0.0) + 4.0 * layer.g_dim * layer.a_dim
    return sorted(sizes.items())


class OwnerCollectives:
    """The step's collectives after the factor exchange, shared by every rank's program."""

    def __init__(self, builder: IterationBuilder, *, factor_step: bool, inverse_step: bool) -> None:
        layers = builder.costs.workload.layers
        self.finite: int | None = None
        if factor_step:
            # Each rank saw its own factors only: one flag agrees they are all finite.
            self.finite = builder.collective(
                "factor finite flag", "default", CollectiveOp.ALL_REDUCE, 4.0
            )
        #: The replicated-path layers' inverse broadcasts, then the failure flags (none
        #: without an inverse step).
        self.inverses = inverse_collectives(builder) if inverse_step else []
        # ⟨V, ∇⟩ of each owner, the skip flag and which layers have a gradient, in float64.
        self.kl_sum = builder.collective(
            "kl clip sum", "default", CollectiveOp.ALL_REDUCE, 8.0 * (2 + len(layers))
        )
        self.gather = [
            builder.collective(f"gather from {owner}", "default", CollectiveOp.BROADCAST, nbytes)
            for owner, nbytes in gather_sizes(builder.setup)
        ]


def owner_step(
    builder: IterationBuilder, collectives: OwnerCollectives, rank: int
) -> list[Instruction]:
    """Rank ``rank``'s part of the step after the factor wait, up to the optimizer."""
    setup, costs = builder.setup, builder.costs
    held = frozenset(setup.held_layers(rank))
    out: list[Instruction] = []
    if collectives.finite is not None:
        out.append(Compute(costs.unpack_factors(held), span_name(Phase.FACTOR_COMM, "unpack")))
        issue(builder, collectives.finite, out)
        out.append(Wait((collectives.finite,), span_name(Phase.FACTOR_COMM, "finite")))
        name = span_name(Phase.FACTOR_COMPUTE, "running_average")
        out.append(Compute(costs.running_average(held), name))
    if collectives.inverses:
        inverse_phase(builder, rank, out, collectives.inverses)
    for layer in costs.workload.layers:
        if layer.name in held:
            name = span_name(Phase.PRECONDITION, layer.name)
            out.append(Compute(costs.precondition(layer), name))
    out.append(Compute(costs.kl_terms(held), span_name(Phase.PRECONDITION, "kl_clip")))
    issue(builder, collectives.kl_sum, out)
    out.append(Wait((collectives.kl_sum,), span_name(Phase.FLAG_COMM, "kl_clip")))
    for collective in collectives.gather:
        issue(builder, collective, out)
    out.append(Wait(tuple(collectives.gather), span_name(Phase.GRAD_COMM, "all_gather")))
    out.append(Compute(costs.write_gradients(), span_name(Phase.PRECONDITION, "write")))
    return out
