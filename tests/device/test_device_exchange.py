"""The pipelined factor exchange on a world-size-1 process group of each device's backend
(gloo on the CPU, NCCL on a GPU), driven directly, and a preconditioner on such a group.

The package has no CUDA streams of its own: the exchange's collectives run asynchronously
on the backend's communication stream (``async_op=True`` futures), and its "streams"
(:mod:`spdkfac.comm.streams`) are the priority scheduler's orderings of calls. A
preconditioner in a group of one takes :class:`~spdkfac.comm.pipeline.LocalFactorExchange`
(nothing travels), so the pipeline itself is reached here by building it on the group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from distributed_helper import run_distributed
from spdkfac import KFACPreconditioner
from spdkfac.comm import TorchDistributedCommunicator
from spdkfac.comm.pipeline import ExchangeSettings, FactorPipeline, FactorRoute
from spdkfac.comm.scheduler import CommScheduler
from spdkfac.costmodel import AlphaBetaModel
from spdkfac.linalg import unpack_triu
from spdkfac.planning.fusion import FUSION_POLICIES
from spdkfac.planning.schedule import FACTORS

LINK = AlphaBetaModel(alpha=1e-5, beta=1e-9)
DIMS = {"a0": 5, "a1": 3, "g1": 4, "g0": 2}
#: (fusion policy, priority scheduler, wire dtype) of each exchange tried.
VARIANTS = [(name, False, None) for name in FUSION_POLICIES]
VARIANTS += [("optimal", True, None), ("threshold", False, torch.bfloat16)]


def _group(device_type: str) -> TorchDistributedCommunicator:
    """The world's gloo group, or a new NCCL group of the world's one rank."""
    if device_type == "cpu":
        return TorchDistributedCommunicator()
    torch.cuda.set_device(0)
    return TorchDistributedCommunicator(dist.new_group(backend="nccl"))


def _factor(dim: int, seed: int, device: torch.device) -> Tensor:
    rows = torch.randn(2 * dim, dim, generator=torch.Generator().manual_seed(seed))
    return (rows.T @ rows).to(device)


def _exchange(group: TorchDistributedCommunicator, variant: tuple[Any, ...]) -> list[bool]:
    """Three factor steps; per step, whether every reduced factor is the handed-over one."""
    name, scheduled, wire = variant
    scheduler = CommScheduler(group.duplicate(), LINK) if scheduled else None
    route_group = group if scheduler is None else scheduler.stream(FACTORS, group)
    pipeline = FactorPipeline(
        FactorRoute(FUSION_POLICIES[name], route_group, LINK, scheduler=scheduler),
        [("a0", 5), ("a1", 3)],
        [("g1", 4), ("g0", 2)],
        settings=ExchangeSettings(warmup_steps=2, comm_dtype=wire),
    )
    tolerance = 1e-6 if wire is None else 1e-2
    agreed = []
    for step in range(3):
        factors = {key: _factor(dim, 10 * step + i, group.device)
                   for i, (key, dim) in enumerate(DIMS.items())}  # fmt: skip
        for key, factor in factors.items():
            assert pipeline.hand_over(key, factor, 2.0)
        result = pipeline.finish(local_ok=True)
        assert result.finite and result.flagged_ranks == 0
        agreed.append(all(
            torch.allclose(unpack_triu(result.factors[key], DIMS[key]), factor,  # type: ignore[arg-type]
                           rtol=tolerance, atol=tolerance)
            and result.factors[key].device == group.device  # type: ignore[union-attr]
            for key, factor in factors.items()
        ))  # fmt: skip
    return agreed


def _preconditioner_steps(group: TorchDistributedCommunicator) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(group.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precond = KFACPreconditioner(model, process_group=group, optimizer=optimizer)
    losses = []
    for step in range(3):
        generator = torch.Generator().manual_seed(step)
        inputs, targets = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,))
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs.to(group.device)), targets.to(group.device))
        loss.backward()
        assert precond.step()
        optimizer.step()
        losses.append(float(loss))
    return losses


def _on_rank(rank: int, world_size: int, device_type: str) -> dict[str, Any]:
    group = _group(device_type)
    assert group.world_size == 1 and group.device.type == device_type
    exchanges = {f"{v[0]}-{v[1]}-{v[2]}": _exchange(group, v) for v in VARIANTS}
    return {"exchanges": exchanges, "losses": _preconditioner_steps(group)}


def test_pipelined_exchange_on_a_group_of_one(device: torch.device) -> None:
    (result,) = run_distributed(_on_rank, 1, device.type, timeout=120.0)
    assert set(result["exchanges"]) == {f"{v[0]}-{v[1]}-{v[2]}" for v in VARIANTS}
    for variant, agreed in result["exchanges"].items():
        assert agreed == [True, True, True], variant
    losses = result["losses"]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
