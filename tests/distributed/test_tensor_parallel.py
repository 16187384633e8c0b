"""K-FAC under tensor parallelism (DTensor ``parallelize_module``, gloo): each rank ends
with its shard of what single-process float64 K-FAC computes on the global batch with the
unsharded model, for an attention + MLP block with its heads split across 2 ranks
(torchtitan's sequence-parallel plan under d-kfac, spd-kfac, osawa and layer-paths,
Megatron's under spd-kfac and osawa; uneven shards; the priority scheduler; gradient
accumulation; frozen and tied parameters), every Linear layer's first step also against
an explicit Kronecker solve; then under FSDP2 × TP
on a 2 × 2 mesh, with the eigen-basis and one-sided forms too, and a tiny LLaMA
parallelized by torchtitan's plan; under HSDP × TP on a 2 × 2 × 2 mesh; and the forms
spdkfac does not support refused before any collective."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from distributed_helper import run_distributed
from spdkfac import KFACPreconditioner
from spdkfac.comm.tensor_parallel_plan import parallelize_llama
from tp_cases import (
    CLASSES,
    STRATEGIES,
    assert_explicit,
    assert_matches,
    block,
    explicit_first_step,
    freeze_and_tie,
    llama,
    parallelize,
    tp_batch,
    train,
)

STEPS = 3
#: (sequence parallelism, MLP width). Uneven shards: the MLP's 9 units without sequence
#: parallelism (up's 5 + 4 rows, down's 5 + 4 columns); with it, the column-wise head's 5
#: classes.
VARIANTS = {"megatron": (False, 9), "sequence": (True, 12)}
#: The strategies each variant trains with: every one under sequence parallelism, one
#: replicated and one owner-computes under Megatron's plan (they differ only in where
#: the work happens; the plans in what is sharded).
VARIANT_STRATEGIES = {"megatron": ("spd-kfac", "osawa"), "sequence": STRATEGIES}
#: Options beyond the strategy, under sequence parallelism with spd-kfac: the priority
#: scheduler's traffic order, and gradient accumulation (2 passes per step, factors
#: exchanged once, each rank forming its share of the blocks over both passes).
SCHEDULES = {
    "priority": {"comm_scheduler": "priority"},
    "accumulated": {"accumulation_steps": 2},
}
#: Frozen and tied parameters: one replicated and one owner-computes strategy.
FROZEN = ("spd-kfac", "osawa")
#: Forms under FSDP2 × TP: (strategy, inverse_method). Eigen-Adam is left out: on this
#: block it departs from single-process K-FAC under FSDP2 alone too (its elementwise
#: moments in the eigen-bases amplify rounding), nothing tensor parallelism adds.
FORMS = (("spd-kfac", "eigen-basis"), ("osawa", "one-sided"))
#: Strategies under HSDP × TP (2 replicas × 2 shards × TP 2): one replicated, one
#: owner-computes.
HSDP_TP = ("spd-kfac", "osawa")
#: The LLaMA with torchtitan's plan (row-wise embedding, ``PrepareModuleInput``, RMSNorm)
#: under FSDP2 × TP.
LLAMA = ("spd-kfac", "osawa")


def _tp_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    out: dict[str, Any] = {}
    for variant, (sequence, hidden) in VARIANTS.items():
        for strategy in VARIANT_STRATEGIES[variant]:
            model = parallelize(block(hidden), mesh, sequence=sequence)
            out[f"{variant}/{strategy}"] = train(model, STEPS, (0, 4), strategy=strategy)
        # One step without the KL clip, for the explicit reference.
        model = parallelize(block(hidden), mesh, sequence=sequence)
        out[f"{variant}/explicit"] = train(model, 1, (0, 4), strategy="osawa", kl_clip=None)
    for label, options in SCHEDULES.items():
        model = parallelize(block(), mesh, sequence=True)
        out[label] = train(model, STEPS, (0, 4), strategy="spd-kfac", **options)
    for strategy in FROZEN:
        model = freeze_and_tie(parallelize(block(), mesh, sequence=True))
        out[f"frozen/{strategy}"] = train(model, STEPS, (0, 4), strategy=strategy)
    out["parallelized after"] = _parallelized_after(mesh)
    return out


def _parallelized_after(mesh: Any) -> str:
    """The error of a step whose model was parallelized after the preconditioner was built."""
    model = block()
    precond = KFACPreconditioner(model)
    parallelize(model, mesh, sequence=False)
    inputs, targets = tp_batch(0)
    F.cross_entropy(model(inputs).reshape(-1, CLASSES), targets.reshape(-1)).backward()
    return _refused(precond.step)


def test_tensor_parallel_matches_single_process_kfac() -> None:
    results = run_distributed(_tp_worker, 2, timeout=240)
    for variant, (_, hidden) in VARIANTS.items():
        reference = train(block(hidden), STEPS, (0, 4))
        explicit = explicit_first_step(hidden)
        for rank, out in enumerate(results):
            assert_explicit(out[f"{variant}/explicit"][0], explicit, f"{variant} rank {rank}")
            for strategy in VARIANT_STRATEGIES[variant]:
                label = f"{variant}/{strategy}"
                assert_matches(out[label], reference, f"{label} rank {rank}")
    for label, options in SCHEDULES.items():
        reference = train(block(), STEPS, (0, 4), **options)
        for rank, out in enumerate(results):
            assert_matches(out[label], reference, f"{label} rank {rank}")
    reference = train(freeze_and_tie(block()), STEPS, (0, 4))
    for rank, out in enumerate(results):
        for strategy in FROZEN:
            assert_matches(out[f"frozen/{strategy}"], reference, f"frozen/{strategy} rank {rank}")
        assert "replaced after KFACPreconditioner(model)" in out["parallelized after"], out
        assert "parallelize_module" in out["parallelized after"]


def _fsdp_tp_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    out: dict[str, Any] = {}
    cases = [(strategy, {}) for strategy in STRATEGIES] + [
        (f"{strategy}/{method}", {"inverse_method": method, "kl_clip": None})
        for strategy, method in FORMS
    ]
    for label, options in cases:
        model = fully_shard(parallelize(block(), mesh["tp"], sequence=True), mesh=mesh["dp"])
        strategy = label.split("/")[0]
        out[label] = train(model, STEPS, (2 * dp, 2 * dp + 2), strategy=strategy, **options)
    for strategy in LLAMA:
        model = fully_shard(parallelize_llama(llama(), mesh["tp"]), mesh=mesh["dp"])
        out[f"llama/{strategy}"] = train(model, STEPS, (2 * dp, 2 * dp + 2), strategy=strategy)
    return out


def test_fsdp2_times_tensor_parallel_matches_single_process_kfac() -> None:
    results = run_distributed(_fsdp_tp_worker, 4, timeout=240)
    reference = train(block(), STEPS, (0, 4))
    forms = {
        method: train(block(), STEPS, (0, 4), inverse_method=method, kl_clip=None)
        for _, method in FORMS
    }
    for rank, out in enumerate(results):
        for strategy in STRATEGIES:
            assert_matches(out[strategy], reference, f"fsdp x tp/{strategy} rank {rank}")
        for strategy, method in FORMS:
            label = f"{strategy}/{method}"
            assert_matches(out[label], forms[method], f"fsdp x tp/{label} rank {rank}")
    reference = train(llama(), STEPS, (0, 4))
    for rank, out in enumerate(results):
        for strategy in LLAMA:
            assert_matches(out[f"llama/{strategy}"], reference, f"llama/{strategy} rank {rank}")


def _hsdp_tp_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    shape = (2, 2, world_size // 4)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
    dp = mesh["replicate", "shard"]
    row = dp.get_local_rank(0) * shape[1] + dp.get_local_rank(1)  # one row of 4 each
    out: dict[str, Any] = {}
    for strategy in HSDP_TP:
        model = fully_shard(parallelize(block(), mesh["tp"], sequence=True), mesh=dp)
        out[strategy] = train(model, STEPS, (row, row + 1), strategy=strategy)
    return out


def test_hsdp_times_tensor_parallel_matches_single_process_kfac() -> None:
    results = run_distributed(_hsdp_tp_worker, 8, timeout=300)
    reference = train(block(), STEPS, (0, 4))
    for rank, out in enumerate(results):
        for strategy in HSDP_TP:
            assert_matches(out[strategy], reference, f"hsdp x tp/{strategy} rank {rank}")


def _refused(build: Callable[[], Any]) -> str:
    try:
        build()
    except ValueError as error:
        return str(error)
    return "accepted"


def _refusal_worker(rank: int, world_size: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    # Tensor parallelism over half the world, the other half's batches out of sight.
    model = parallelize(block(), mesh["tp"], sequence=False)
    out["tp without fsdp"] = _refused(lambda: KFACPreconditioner(model))
    # A weight on a 3-D mesh that is not HSDP × TP's (no FSDP2).
    cube = init_device_mesh("cpu", (1, 2, world_size // 2), mesh_dim_names=("r", "s", "tp"))
    odd = block()
    odd.q.weight = nn.Parameter(distribute_tensor(odd.q.weight.detach(), cube, [Shard(0)] * 3))
    out["3-d mesh"] = _refused(lambda: KFACPreconditioner(odd))
    return out


def test_unsupported_tensor_parallel_forms_are_refused_before_any_collective() -> None:
    for out in run_distributed(_refusal_worker, 4, timeout=120):
        assert "over 2 of 4 ranks without FSDP2" in out["tp without fsdp"], out
        assert "3-D mesh (1, 2, 2) as (Shard(dim=0), Shard(dim=0), Shard(dim=0))" in out["3-d mesh"]
        for message in out.values():
            assert "supported: tensor parallelism" in message, message
