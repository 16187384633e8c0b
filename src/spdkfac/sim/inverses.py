"""The inverse phase as :func:`~spdkfac.engine.inversion.invert_factors` runs it.

On an inverse step every rank, in order: for each broadcast group of the plan (the row's
broadcast policy, :attr:`~spdkfac.sim.strategies.StrategySetup.groups`) the owner inverts
its members (``inverse_compute/<key>``), packs them and issues the broadcast in the
inverse form's wire format, the others issue it at once; then every rank inverts the
non-communicated factors and, with the owner stage, the factors of the owner-path layers
it owns (kept, never broadcast), in plan order, overlapping the broadcasts; then
``inverse_comm/wait`` per group (receivers unpack) and ``inverse_comm/failures``, the
all-reduce of the failure flags.

The communicated/non-communicated split is SPD-KFAC's placement (Shi, Zhang, Li 2021,
"Accelerating Distributed K-FAC with Smart Parallelism of Computing and Communication
Tasks", Sec. 4.2); owners keeping their results is Osawa et al. 2019's ("Large-scale
distributed second-order optimization using Kronecker-factored approximate curvature",
Sec. 3). ``layer-paths`` has both in one phase; ``osawa`` has no group.
"""

from __future__ import annotations

from spdkfac.planning.placement import EVERY_RANK
from spdkfac.profiling import Phase, span_name
from spdkfac.sim.builder import IterationBuilder, issue
from spdkfac.sim.collectives import CollectiveOp
from spdkfac.sim.program import Compute, Instruction, Wait

__all__ = ["inverse_collectives", "inverse_phase"]


def inverse_collectives(builder: IterationBuilder) -> list[int]:
    """The inverse phase's broadcasts, one per group in the form's wire format, and the
    failure flags' all-reduce (last)."""
    setup = builder.setup
    ids = [
        builder.collective(
            f"broadcast {index} from {group.owner}",
            "default",
            CollectiveOp.BROADCAST,
            4.0 * group.elements,
        )
        for index, group in enumerate(setup.groups)
    ]
    flags = 4.0 * 2 * len(builder.costs.workload.layers)
    ids.append(builder.collective("failure flags", "default", CollectiveOp.ALL_REDUCE, flags))
    return ids


def inverse_phase(
    builder: IterationBuilder, rank: int, out: list[Instruction], ids: list[int]
) -> None:
    """Rank ``rank``'s inverse phase (module docstring) with the collectives ``ids`` of
    :func:`inverse_collectives` (none on one rank)."""
    setup, costs = builder.setup, builder.costs
    plan = setup.plan
    assert plan is not None
    dims = {spec.key: spec.dim for spec in plan.factors}
    if builder.world_size == 1:
        for spec in plan.factors:
            name = span_name(Phase.INVERSE_COMPUTE, spec.key)
            out.append(Compute(costs.inverse(spec.dim, spec.key), name))
        return
    for group, collective in zip(setup.groups, ids[:-1], strict=True):
        if group.owner == rank:
            for key in group.keys:
                name = span_name(Phase.INVERSE_COMPUTE, key)
                out.append(Compute(costs.inverse(dims[key], key), name))
            pack = sum(costs.pack_inverse(dim) for dim in group.dims)
            out.append(Compute(pack, span_name(Phase.INVERSE_COMPUTE, "pack")))
        issue(builder, collective, out)
    owners = setup.layer_owners
    for spec, owner in zip(plan.factors, plan.owners, strict=True):
        if owner == EVERY_RANK or owners.get(spec.layer) == rank:
            name = span_name(Phase.INVERSE_COMPUTE, spec.key)
            out.append(Compute(costs.inverse(spec.dim, spec.key), name))
    for group, collective in zip(setup.groups, ids[:-1], strict=True):
        out.append(Wait((collective,), span_name(Phase.INVERSE_COMM, "wait")))
        if group.owner != rank:
            out.append(Compute(sum(costs.unpack_inverse(dim) for dim in group.dims)))
    issue(builder, ids[-1], out)
    out.append(Wait((ids[-1],), span_name(Phase.INVERSE_COMM, "failures")))
