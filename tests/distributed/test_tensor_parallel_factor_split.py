"""The factor split under tensor parallelism (gloo): each rank of a tensor-parallel group
forms the statistics of its own blocks only (its ``kfac/factor_compute/<layer>/…`` spans),
the group's ranks together every block exactly once as the planner splits them by
``d_in² + d_out²``, and after the exchange every rank holds the factors single-process
float64 K-FAC computes on the global batch — at TP 2 (torchtitan's sequence-parallel plan,
pipelined and owner-computes exchanges) and under FSDP2 × TP on a 2 × 2 mesh; given the
data-parallel group as its process group, a preconditioner forms every block on every
rank (the group's other ranks are not in its exchange)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_helper import run_distributed
from spdkfac import KFACPreconditioner
from spdkfac.planning.factor_split import plan_factor_split
from tp_cases import CLASSES, OPTIONS, block, parallelize, tp_batch

#: The registered blocks of ``block(12)`` and the Gram cost of their statistics, written
#: out: ``d_in² + d_out²`` (a bias adds one to ``d_in``), a unit-wise norm's ``8 × 3``.
COSTS = (
    ("embed", 4**2 + 8**2),
    ("norm1", 24),
    ("q", 9**2 + 8**2),
    ("k", 9**2 + 8**2),
    ("v", 8**2 + 8**2),
    ("o", 9**2 + 8**2),
    ("norm2", 24),
    ("up", 9**2 + 12**2),
    ("down", 13**2 + 8**2),
    ("norm3", 24),
    ("head", 9**2 + 5**2),
)
NORMS = ("norm1", "norm2", "norm3")
STRATEGIES = ("spd-kfac", "osawa")


def _first_step(
    model: nn.Module, part: tuple[int, int], strategy: str, group: Any = None
) -> dict[str, Any]:
    """One factor step on rows ``part`` of the first global batch: the blocks whose
    statistics this rank formed (from its profiler's spans) and every factor after it."""
    precond = KFACPreconditioner(
        model, profile=True, strategy=strategy, process_group=group, **OPTIONS
    )
    inputs, targets = tp_batch(0)
    begin, end = part
    logits = model(inputs[begin:end])
    F.cross_entropy(logits.reshape(-1, CLASSES), targets[begin:end].reshape(-1)).backward()
    assert precond.step()
    prefix = "kfac/factor_compute/"
    labels = {e.name[len(prefix) :] for e in precond.profiler.events() if e.name.startswith(prefix)}
    formed = sorted({key.rsplit("/", 1)[0] for label in labels - {"running_average"}
                     for key in label.split("+")})  # fmt: skip
    return {"formed": formed, "factors": _factors(precond)}


def _factors(precond: KFACPreconditioner) -> dict[str, Tensor]:
    """Every factor this rank holds (``osawa``'s owners only hold their layers')."""
    out: dict[str, Tensor] = {}
    for name in precond.layers:
        for kind, factor in zip("AG", precond.factors(name), strict=True):
            if factor is not None:
                out[f"{name}/{kind}"] = factor.clone()
    norms = precond.state_dict()["batchnorm"]["layers"]
    out.update({f"{name}/BN": norms[name]["fisher"].clone() for name in precond.batchnorm_layers})
    return out


def _tp_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    return {
        strategy: _first_step(parallelize(block(), mesh, sequence=True), (0, 4), strategy)
        for strategy in STRATEGIES
    }


def _fsdp_tp_worker(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    part = (2 * dp, 2 * dp + 2)
    out = {}
    for group in (None, mesh.get_group("dp")):
        model = fully_shard(parallelize(block(), mesh["tp"], sequence=True), mesh=mesh["dp"])
        out["world" if group is None else "dp"] = _first_step(model, part, "spd-kfac", group)
    return out


def _check(results: list[dict[str, Any]], tp: int) -> None:
    """Rank ``r`` formed exactly the blocks the split gives rank ``r % tp`` of its group
    (every block with the ``dp`` group); its factors are the single-process reference's."""
    split = plan_factor_split(COSTS, tp)
    reference = _first_step(block(), (0, 4), "spd-kfac")
    assert reference["formed"] == sorted(name for name, _ in COSTS)
    held: dict[str, set[str]] = {}
    for rank, out in enumerate(results):
        for case, got in out.items():
            label = f"rank {rank} {case}"
            everything = [name for name, _ in COSTS]
            expected = everything if case == "dp" else split.blocks_of(rank % tp)
            assert got["formed"] == sorted(expected), label
            held.setdefault(case, set()).update(got["factors"])
            for key, value in got["factors"].items():
                expected = reference["factors"][key]
                torch.testing.assert_close(
                    value, expected, rtol=1e-10, atol=1e-12, msg=f"{label} {key}"
                )
    for case, keys in held.items():
        assert keys == set(reference["factors"]), case


def test_each_tensor_parallel_rank_forms_its_share_of_the_factors() -> None:
    split = plan_factor_split(COSTS, 2)
    assert all(split.blocks_of(rank) for rank in range(2))  # both ranks have work here
    _check(run_distributed(_tp_worker, 2, timeout=180), 2)


def test_fsdp2_times_tensor_parallel_splits_the_factors_within_each_group() -> None:
    _check(run_distributed(_fsdp_tp_worker, 4, timeout=180), 2)
