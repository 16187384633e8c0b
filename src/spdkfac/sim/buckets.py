"""The buckets an iteration's collectives carry, planned as the real run plans them.

DDP's gradient buckets follow the order gradients become final, with its 1 MiB first
bucket (:func:`grad_buckets`). The factor buckets are the row's fusion policy's plan
(:mod:`spdkfac.planning.fusion`, :func:`factor_fusion`); a measured policy (the
``optimal`` dynamic tensor fusion of SPD-KFAC, Shi, Zhang, Li 2021, "Accelerating
Distributed K-FAC with Smart Parallelism of Computing and Communication Tasks", Eq. 15)
plans from the hand-over times of the compute-only timeline (:func:`hand_over_times`), as
the real one plans from rank 0's measurements.
"""

from __future__ import annotations

from dataclasses import replace

from spdkfac.linalg import packed_size
from spdkfac.planning.fusion import FusionInputs, FusionPlan, FusionPolicy
from spdkfac.sim.costs import WorkloadCosts
from spdkfac.sim.workload import FactorHook, GradReady, Op

__all__ = ["factor_fusion", "grad_buckets", "hand_over_times", "hand_overs_by_key"]


def grad_buckets(costs: WorkloadCosts) -> tuple[tuple[str, ...], ...]:
    """DDP's gradient buckets (parameter names) in launch order: gradients in the order
    they become final, the first bucket capped at ``first_grad_bucket_bytes``."""
    hardware = costs.hardware
    ready = [item for item in costs.workload.backward if isinstance(item, GradReady)]
    buckets: list[list[str]] = []
    size = 0
    for item in ready:
        cap = hardware.first_grad_bucket_bytes if len(buckets) <= 1 else hardware.grad_bucket_bytes
        nbytes = item.numel * 4
        if not buckets or (size and size + nbytes > cap):
            buckets.append([])
            size = 0
        buckets[-1].append(item.parameter)
        size += nbytes
    return tuple(tuple(bucket) for bucket in buckets)


def hand_over_times(costs: WorkloadCosts) -> tuple[list[float], list[float]]:
    """When each A (forward order) and G (hook order) is handed to the exchange, on a
    compute-only timeline (what the ``optimal`` policy measures during warm-up)."""
    now = 0.0
    a_ready: list[float] = []
    g_ready: list[float] = []
    workload = costs.workload
    for items, ready in ((workload.forward, a_ready), (workload.backward, g_ready)):
        for item in items:
            if isinstance(item, Op):
                now += costs.op(item)
            elif isinstance(item, FactorHook):
                now += costs.factor(workload.layer(item.layer), item.kind)
                ready.append(now)
    return a_ready, g_ready


def factor_fusion(
    costs: WorkloadCosts,
    policy: FusionPolicy,
    busy: tuple[tuple[float, float], ...] = (),
    chunk_elements: int | None = None,
) -> FusionPlan:
    """The factor buckets ``policy`` plans for the workload (``busy`` and
    ``chunk_elements``: the priority scheduler's gradient chunks it plans around)."""
    workload = costs.workload
    a_order = tuple(f"{layer.name}/A" for layer in workload.layers)
    g_order = tuple(f"{name}/G" for name in workload.g_order)
    sizes = {
        f"{layer.name}/{kind}": packed_size(dim)
        for layer in workload.layers
        for kind, dim in (("A", layer.a_dim), ("G", layer.g_dim))
    }
    inputs = FusionInputs(
        a_order=a_order,
        g_order=g_order,
        sizes=sizes,
        bucket_cap_elements=max(1, costs.hardware.factor_bucket_bytes // 4),
        allreduce=costs.hardware.cost_model(costs.world_size).allreduce,
        bytes_per_element=4,
    )
    if not policy.measured:
        return policy.plan(inputs)
    # Measured policies plan from the hand-over times of the compute-only timeline, as
    # the real one plans from rank 0's measurements: from the step's first hand-over,
    # the clock of ``busy`` (which counts from the forward pass's start) too.
    a_times, g_times = hand_overs_by_key(costs)
    a_keys = tuple(sorted(a_order, key=lambda key: a_times[key]))
    g_keys = tuple(sorted(g_order, key=lambda key: g_times[key]))
    origin = min((*a_times.values(), *g_times.values()), default=0.0)
    return policy.plan(
        replace(
            inputs,
            a_order=a_keys,
            g_order=g_keys,
            a_ready=tuple(a_times[key] - origin for key in a_keys),
            g_ready=tuple(g_times[key] - origin for key in g_keys),
            busy=tuple((start - origin, end - origin) for start, end in busy),
            chunk_elements=chunk_elements,
        )
    )


def hand_overs_by_key(costs: WorkloadCosts) -> tuple[dict[str, float], dict[str, float]]:
    """When each A and G factor is complete on the compute-only timeline, by slot key."""
    a_ready, g_ready = hand_over_times(costs)
    workload = costs.workload
    a_hooks = [i.layer for i in workload.forward if isinstance(i, FactorHook)]
    g_hooks = [i.layer for i in workload.backward if isinstance(i, FactorHook)]
    # A layer called several times hands its factor over after its last call.
    a_times = {f"{name}/A": when for name, when in zip(a_hooks, a_ready, strict=True)}
    g_times = {f"{name}/G": when for name, when in zip(g_hooks, g_ready, strict=True)}
    for layer in workload.layers:
        a_times.setdefault(f"{layer.name}/A", max(a_ready, default=0.0))
        g_times.setdefault(f"{layer.name}/G", max(g_ready, default=0.0))
    return a_times, g_times
