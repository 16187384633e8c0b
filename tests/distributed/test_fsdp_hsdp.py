"""HSDP (``fully_shard`` on a 2-D replicate × shard mesh, 4 gloo ranks as 2 × 2): every
strategy equals single-process float64 K-FAC; and FSDP2's ``MixedPrecisionPolicy`` (bf16
parameters and gradient reductions, float32 factors and inverses) runs and stays close
to float32 K-FAC."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_helper import run_distributed
from fsdp_cases import assert_matches, conv_net, full_grads, global_part, shard, train
from parallel_cases import batch

STRATEGIES = ("d-kfac", "spd-kfac", "osawa")
OPTIONS: dict[str, Any] = {"damping": 0.05, "kl_clip": 1e-2, "inv_update_steps": 2}
STEPS = 3


def _sgd(params: Sequence[Tensor]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _hsdp_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    out: dict[str, Any] = {}
    part = global_part("conv", rank, world_size)
    for strategy in STRATEGIES:
        model = shard(conv_net(), mesh)
        out[strategy] = train(model, "conv", STEPS, _sgd, part, strategy=strategy, **OPTIONS)
    return out


def test_hsdp_matches_single_process_kfac() -> None:
    results = run_distributed(_hsdp_worker, 4, timeout=240)
    grads, params, everything = train(conv_net(), "conv", STEPS, _sgd, (0, 12), **OPTIONS)
    held = [set(out["osawa"][2]) for out in results]
    assert set().union(*held) == set(everything) and sum(map(len, held)) == len(everything)
    for rank, out in enumerate(results):
        for strategy in STRATEGIES:
            first, final, _ = out[strategy]
            assert_matches(first, final, (grads, params), f"{strategy} rank {rank}")


def _float_net() -> nn.Module:
    return conv_net().float()


#: Damping large enough that the preconditioner does not amplify the bf16 rounding of
#: the gradient itself (which is large here: up to 100 % on the first conv's bias, FSDP2's
#: own, with or without K-FAC).
MIXED: dict[str, Any] = {"damping": 1.0, "kl_clip": None, "inv_update_steps": 2}


def _raw(model: nn.Module, rank: int, world_size: int) -> dict[str, Tensor]:
    """The plain averaged gradient of the first batch (no K-FAC)."""
    begin, end = global_part("conv", rank, world_size)
    images, labels = batch(0)
    F.cross_entropy(model(images[begin:end].float()), labels[begin:end]).backward()
    grads = full_grads(model)
    model.zero_grad()
    return grads


def _mixed_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    model = shard(_float_net(), mesh, mp_policy=policy)
    raw = _raw(model, rank, world_size)
    part = global_part("conv", rank, world_size)
    first, final, held = train(model, "conv", STEPS, _sgd, part, strategy="spd-kfac", **MIXED)
    return {"raw": raw, "first": first, "final": final, "dtypes": set(held.values())}


def _relative(value: Tensor, expected: Tensor) -> float:
    return float((value - expected).norm() / expected.norm().clamp_min(1e-12))


def test_mixed_precision_runs_and_stays_close_to_float32() -> None:
    results = run_distributed(_mixed_worker, 2, timeout=180)
    raw = _raw(_float_net(), 0, 1)
    grads, params, _ = train(_float_net(), "conv", STEPS, _sgd, (0, 12), **MIXED)
    for out in results:
        assert out["dtypes"] == {torch.float32}  # factors and inverses in float32
        for name in params:
            value = out["final"][name]
            assert value.dtype == torch.float32 and torch.isfinite(value).all(), name
        for name, expected in grads.items():
            # K-FAC adds little to the error bf16 gives the gradient itself.
            rounding = _relative(out["raw"][name], raw[name])
            error = _relative(out["first"][name], expected)
            assert error <= 3 * rounding + 0.01, (name, error, rounding)
