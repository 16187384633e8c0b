"""Osawa et al. 2019's owner-computes step as per-rank engine programs.

A row with ``owner_computes`` (``osawa``, ``osawa-pipelined``) on P > 1 ranks runs, with
the layer owners of the real planner (:func:`~spdkfac.planning.placement.plan_layer_owners`, via
:attr:`~spdkfac.sim.strategies.StrategySetup.layer_owners`):

1. forward and backward as every strategy, A and G computed locally on every rank;
2. the factor buckets of the fusion plan are *reduce-scattered* (each owner receives its
   layers' factors), then the small weights all-reduce as today;
3. DDP's gradient buckets, in the same order, are reduce-scattered too (a communication
   hook): per bucket the reduce-scatter of the owned layers' gradients and one all-reduce
   of the rest (parameters of layers nobody owns, such as norm layers) when it has any;
4. each owner unpacks and averages only its factors, after one 4-byte all-reduce agrees
   that every owner's factors are finite (``kfac/factor_comm/finite``); on inverse steps
   it inverts only its layers' factors (no inverse is broadcast; the failure flags of
   every factor are still agreed by one all-reduce);
5. each owner preconditions its layers and computes its part of the KL clip,
   ``⟨V, ∇⟩`` over its layers (``kfac/precondition/kl_clip``); one all-reduce of
   ``2 + layers`` float64 carries the clip's sum, the skip flag and which layers have a
   gradient (``kfac/flag_comm/kl_clip``; it replaces the skip-flag all-reduce of other
   steps); then the preconditioned gradients are gathered, as the real code does it, by
   one broadcast per owner in rank order (an owner's layers' ``g·a`` elements; ranks
   owning nothing send nothing), waited for as ``kfac/grad_comm/all_gather``, and every
   rank scales them by ν into ``.grad`` (``kfac/precondition/write``);
6. the optimizer step.

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


def scatter_chunks(setup: StrategySetup) -> dict[str, list[dict[int, float]]]:
    """Per reduce-scattered bucket, the bytes each owner receives, in rank order and
    without empty chunks: ``"factors"``, the fusion plan's buckets (packed triangles), and
    ``"gradients"``, DDP's buckets (owned parameters only; the rest are all-reduced).
    Empty without owners."""
    workload = setup.costs.workload
    if not setup.layer_owners or setup.fusion is None:
        return {"factors": [], "gradients": []}
    dims = {
        f"{layer.name}/{kind}": dim
        for layer in workload.layers
        for kind, dim in (("A", layer.a_dim), ("G", layer.g_dim))
    }
    numel = dict(workload.parameters)
    pieces: dict[str, list[list[tuple[int | None, int]]]] = {
        "factors": [
            [(setup.layer_owners[key.rpartition("/")[0]], packed_size(dims[key])) for key in bucket]
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
    builder: IterationBuilder, label: str, channel: str, chunks: dict[int, float]
) -> list[int]:
    """One reduce per owner of ``chunks`` (rank order), as ``reduce_scatter`` issues them."""
    return [
        builder.collective(f"{label} to {owner}", channel, CollectiveOp.REDUCE, nbytes)
        for owner, nbytes in chunks.items()
    ]


def factor_bucket_collectives(builder: IterationBuilder, channel: str) -> list[tuple[int, ...]]:
    """Per factor bucket of the fusion plan, its reduces to the owners on ``channel``."""
    return [
        tuple(_reduces(builder, f"factor bucket {index}", channel, chunks))
        for index, chunks in enumerate(scatter_chunks(builder.setup)["factors"])
    ]


def grad_bucket_collectives(builder: IterationBuilder) -> list[tuple[int, ...]]:
    """Per DDP bucket its collectives: the reduces of owned parameters' gradients to their
    owners and then, when the bucket holds parameters without an owner, their all-reduce."""
    setup = builder.setup
    numel = dict(setup.costs.workload.parameters)
    owned = scatter_chunks(setup)["gradients"]
    ids: list[tuple[int, ...]] = []
    for index, (bucket, chunks) in enumerate(zip(setup.grad_buckets, owned, strict=True)):
        label = f"grad bucket {index}"
        collectives = _reduces(builder, label, "default", chunks)
        rest = 4.0 * sum(numel[name] for name in bucket) - sum(chunks.values())
        if rest:
            op = CollectiveOp.ALL_REDUCE
            collectives.append(builder.collective(f"{label} (no owner)", "default", op, rest))
        ids.append(tuple(collectives))
    return ids


def gather_sizes(setup: StrategySetup) -> list[tuple[int, float]]:
    """(owner, bytes) of each broadcast of the preconditioned gradients, in rank order."""
    sizes: dict[int, float] = {}
    for layer in setup.costs.workload.layers:
        owner = setup.layer_owners[layer.name]
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
        self.failures: int | None = None
        if inverse_step:
            self.failures = builder.collective(
                "failure flags", "default", CollectiveOp.ALL_REDUCE, 4.0 * 2 * len(layers)
            )
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
    owned = frozenset(setup.owned_layers(rank))
    out: list[Instruction] = []
    if collectives.finite is not None:
        out.append(Compute(costs.unpack_factors(owned), span_name(Phase.FACTOR_COMM, "unpack")))
        issue(builder, collectives.finite, out)
        out.append(Wait((collectives.finite,), span_name(Phase.FACTOR_COMM, "finite")))
        name = span_name(Phase.FACTOR_COMPUTE, "running_average")
        out.append(Compute(costs.running_average(owned), name))
    if collectives.failures is not None:
        plan = setup.plan
        assert plan is not None
        for spec in plan.factors:
            if spec.layer in owned:
                name = span_name(Phase.INVERSE_COMPUTE, spec.key)
                out.append(Compute(costs.inverse(spec.dim, spec.key), name))
        issue(builder, collectives.failures, out)
        out.append(Wait((collectives.failures,), span_name(Phase.INVERSE_COMM, "failures")))
    for layer in costs.workload.layers:
        if layer.name in owned:
            name = span_name(Phase.PRECONDITION, layer.name)
            out.append(Compute(costs.precondition(layer), name))
    out.append(Compute(costs.kl_terms(owned), span_name(Phase.PRECONDITION, "kl_clip")))
    issue(builder, collectives.kl_sum, out)
    out.append(Wait((collectives.kl_sum,), span_name(Phase.FLAG_COMM, "kl_clip")))
    for collective in collectives.gather:
        issue(builder, collective, out)
    out.append(Wait(tuple(collectives.gather), span_name(Phase.GRAD_COMM, "all_gather")))
    out.append(Compute(costs.write_gradients(), span_name(Phase.PRECONDITION, "write")))
    return out
