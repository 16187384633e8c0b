"""FSDP2 × TP K-FAC priced by the simulator (``spdkfac.sim.tensor_parallel``): the plan's
volumes against the elements the tensor-parallel layout actually gathers in a world-2 run
of the tiny LLaMA under torchtitan's plan, and its factor split against the blocks each
rank of that run forms, the limit cases (one rank per group is FSDP2 alone), growth with
the group, the refusals and ``spdkfac simulate --tp-size``."""

from __future__ import annotations

from typing import Any

import pytest

from distributed_helper import run_distributed
from spdkfac.cli.main import main
from spdkfac.sim import resolve_hardware, simulate_strategy
from spdkfac.sim.tensor_parallel import (
    COLUMN,
    ROW,
    check_tensor_parallel,
    factor_split,
    tensor_parallel_plan,
    tensor_parallel_result,
)
from spdkfac.sim.workload import Workload, trace_workload
from spdkfac.sim.zoo import workload_for


def _gathered(rank: int, world_size: int) -> dict[str, Any]:
    """Elements of every DTensor ``full_tensor`` that moves data (a placement not
    ``Replicate``) while the capture runs (forward and backward) and in ``step()`` (the
    gradient reads), on a 2-rank tensor-parallel LLaMA's first step; and the layers whose
    factors the rank formed (its ``kfac/factor_compute/<layer>/A|G`` spans)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from spdkfac import KFACPreconditioner
    from spdkfac.comm.tensor_parallel_plan import parallelize_llama
    from tp_cases import llama, token_batch

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = parallelize_llama(llama(), mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, optimizer=optimizer, factor_update_steps=1, profile=True)
    counts, phase, original = {"capture": 0, "read": 0}, ["capture"], DTensor.full_tensor

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        if any(not isinstance(placement, Replicate) for placement in self.placements):
            counts[phase[0]] += self.numel()
        return original(self, *args, **kwargs)

    DTensor.full_tensor = counting  # type: ignore[method-assign]
    try:
        inputs, targets = token_batch(0)
        logits = model(inputs)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
        phase[0] = "read"
        precond.step()
    finally:
        DTensor.full_tensor = original  # type: ignore[method-assign]
    spans = [event.name.split("/") for event in precond.profiler.events()]
    formed = {parts[2] for parts in spans if parts[1] == "factor_compute" and len(parts) == 4}
    return {**counts, "formed": formed}


def _tiny_llama_workload(batch_per_rank: int) -> Workload:
    from tp_cases import CLASSES, TOKENS, llama

    return trace_workload(
        llama, (TOKENS,), batch_size=batch_per_rank, name="llama", device="meta",
        vocab_size=CLASSES,
    )  # fmt: skip


def test_priced_volumes_are_what_the_layout_gathers() -> None:
    """The capture's all-gathers and the gradient reads' over ``tp``, element for element:
    the world-2 run's global batch of 4 sequences is 2 per rank in the workload."""
    results = run_distributed(_gathered, 2, timeout=120, env={"OMP_NUM_THREADS": "1"})
    workload = _tiny_llama_workload(2)
    plan = tensor_parallel_plan(workload, 2)
    split = factor_split(workload, 2)
    for rank, counts in enumerate(results):
        formed = counts.pop("formed")
        assert counts == {"capture": plan.capture_elements, "read": plan.tp_read_elements}
        assert formed == split.blocks_of(rank) and formed, (rank, formed)
    splits = {layer.name.rsplit(".", 1)[-1]: layer.split for layer in plan.layers}
    assert splits["wo"] is splits["w2"] is ROW and splits["output"] is splits["wq"] is COLUMN


@pytest.fixture(scope="module")
def llama_workload() -> Workload:
    return workload_for("llama", batch_size=4)


def test_one_rank_per_group_is_fsdp2_alone(llama_workload: Workload) -> None:
    hardware = resolve_hardware("ib200", None)
    for strategy in ("sgd", "d-kfac", "spd-kfac"):
        ddp = simulate_strategy(llama_workload, hardware, 8, strategy)
        result = tensor_parallel_result(ddp, llama_workload, hardware, 1)
        assert result.capture_s == result.stream_s == result.factor_extra_s == 0.0
        assert result.iteration_s == pytest.approx(result.fsdp.iteration_s, rel=1e-9)
        assert result.bytes_per_rank == pytest.approx(result.fsdp.bytes_per_rank, rel=1e-9)


def test_the_exchange_grows_with_the_group(llama_workload: Workload) -> None:
    """The capture gathers the group's tokens (linear in tp); FSDP2's shards shrink; the
    factors are split across the group, each layer formed once, balanced by their Gram
    costs, and what the most loaded rank adds stays below the tp − 1 times a rank's own
    factor products that forming every layer on every rank adds; AdamW pays no K-FAC
    part."""
    plans = [tensor_parallel_plan(llama_workload, tp) for tp in (1, 2, 4, 8)]
    for plan in plans:
        assert plan.capture_elements == plan.tp * plans[0].capture_elements
        assert plan.gradient_elements == plans[0].gradient_elements
        streams = [layer.stream_elements for layer in plan.layers if layer.split.stream]
        assert streams == [plan.tp * 4 * 128 * 128] * 5  # embedding, wo and w2 of 2 blocks
    shards = [sum(n for _, n in plan.shard_elements) for plan in plans]
    assert shards == sorted(shards, reverse=True) and shards[-1] < shards[0] / 4
    hardware = resolve_hardware("ib200", None)
    products = sum(
        hardware.factor_seconds(llama_workload, layer, kind)
        for layer in llama_workload.layers
        for kind in ("A", "G")
    )
    for tp in (2, 4, 8):
        sgd = simulate_strategy(llama_workload, hardware, 64, "sgd")
        assert tensor_parallel_result(sgd, llama_workload, hardware, tp).capture_s == 0.0
        kfac = simulate_strategy(llama_workload, hardware, 64, "spd-kfac")
        result = tensor_parallel_result(kfac, llama_workload, hardware, tp)
        names = [layer.name for layer in llama_workload.layers]
        assert result.split.group_size == tp and result.split.blocks == tuple(names)
        assert sorted(n for r in range(tp) for n in result.split.blocks_of(r)) == sorted(names)
        loads = result.split.loads()
        assert max(loads) <= min(loads) + max(result.split.costs)
        assert 0.0 <= result.factor_extra_s < (tp - 1) * products


def test_refusals(llama_workload: Workload) -> None:
    with pytest.raises(ValueError, match="model 'mlp' has no tensor-parallel plan"):
        check_tensor_parallel(workload_for("mlp", batch_size=2), 8, 2)
    with pytest.raises(ValueError, match="tp_size 4 does not divide 6 workers"):
        check_tensor_parallel(llama_workload, 6, 4)
    with pytest.raises(ValueError, match="tp must be an int >= 1"):
        tensor_parallel_plan(llama_workload, 0)


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["simulate", "--model", "llama", "--workers", "8,1024", "--preset", "ib200",
             "--strategies", "sgd,spd-kfac", "--tp-size", "4"]  # fmt: skip
    assert main(flags) == 0
    out = capsys.readouterr().out
    for workers in (8, 1024):
        assert f"## FSDP2 x TP: llama, {workers} workers (4-rank TP groups)" in out
    assert "| spd-kfac |" in out and "FSDP2 x TP MB/rank" in out
    for model, workers, named in (("mlp", "8", "no tensor-parallel plan"),
                                  ("llama", "6", "does not divide 6 workers")):  # fmt: skip
        assert main(["simulate", "--model", model, "--workers", workers, "--tp-size", "4"]) == 2
        assert named in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_sized_llama_takes_the_llama_plan() -> None:
    workload = workload_for("llama-134m", batch_size=1)
    assert sum(n for _, n in workload.parameters) == 134_759_424
    plan = tensor_parallel_plan(workload, 8)
    assert plan.capture_elements > 0 and len(plan.layers) == len(workload.layers)
