"""Pipelined factor exchange: every fusion policy gives the same factors, with DDP and
gradient accumulation, and every rank issues identical collectives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from distributed_helper import RecordingCommunicator, run_distributed
from spdkfac import KFACPreconditioner
from spdkfac.comm import TorchDistributedCommunicator

POLICIES = ("after-backward", "layerwise", "threshold", "optimal")


class _TwoBranch(nn.Module):
    """Two parallel branches whose execution order can depend on the rank."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, padding=1)
        self.left = nn.Conv2d(4, 3, 3, padding=1)
        self.right = nn.Conv2d(4, 3, 1)
        self.head = nn.Linear(3 * 5 * 5, 3)
        self.right_first = False

    def forward(self, x: Tensor) -> Tensor:
        x = torch.tanh(self.stem(x))
        if self.right_first:
            r = self.right(x)
            left = self.left(x)
        else:
            left = self.left(x)
            r = self.right(x)
        return self.head(torch.tanh(left + r).flatten(1))


def _model() -> _TwoBranch:
    torch.manual_seed(0)
    return _TwoBranch().double()


def _batch(rank: int, step: int, size: int = 6) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(size, 2, 5, 5, generator=generator, dtype=torch.float64)
    return inputs, torch.randint(0, 3, (size,), generator=generator)


def _train(rank: int, policy: str, accumulation: int, steps: int = 4) -> dict[str, object]:
    model = _model()
    model.right_first = rank % 2 == 1  # hooks fire in a rank-dependent order
    ddp = DistributedDataParallel(model)
    log: list[tuple[str, int, str]] = []
    precond = KFACPreconditioner(
        ddp,
        factor_exchange=policy,
        accumulation_steps=accumulation,
        fusion_warmup_steps=2,
        kl_clip=None,
        damping=0.05,
        process_group=RecordingCommunicator(TorchDistributedCommunicator(), log),
    )
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(steps):
        optimizer.zero_grad()
        inputs, targets = _batch(rank, step)
        for index, part in enumerate(torch.chunk(torch.arange(len(targets)), accumulation)):
            last = index == accumulation - 1
            context = ddp.no_sync() if not last else torch.enable_grad()
            with context:
                loss = F.cross_entropy(ddp(inputs[part]), targets[part]) / accumulation
                loss.backward()
        assert precond.step()
        optimizer.step()
    return {
        "factors": {n: precond.factors(n) for n in precond.layers},
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "log": log,
        "plan": None if precond.fusion_plan is None else precond.fusion_plan.buckets,
    }


def _policies_worker(rank: int, world_size: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for policy in POLICIES:
        for accumulation in (1, 2):
            out[f"{policy}/{accumulation}"] = _train(rank, policy, accumulation)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_policy_gives_the_same_factors_and_parameters(world_size: int) -> None:
    results = run_distributed(_policies_worker, world_size, timeout=180)
    reference = results[0]["after-backward/1"]
    for rank, out in enumerate(results):
        for policy in POLICIES:
            for accumulation in (1, 2):
                run = out[f"{policy}/{accumulation}"]
                label = f"{policy} accumulation={accumulation} rank {rank}"
                for name, pair in run["factors"].items():
                    for ours, theirs in zip(pair, reference["factors"][name], strict=True):
                        # Two half batches with the loss halved equal one full batch.
                        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12, msg=label)
                for name, value in run["params"].items():
                    torch.testing.assert_close(
                        value, reference["params"][name], rtol=1e-9, atol=1e-12, msg=label
                    )
                # Every rank issued the same collectives, in the same order and sizes.
                assert run["log"] == results[0][f"{policy}/{accumulation}"]["log"], label
    optimal = results[0]["optimal/1"]
    assert optimal["plan"] is not None and sum(len(b) for b in optimal["plan"]) == 8
    layerwise_log = results[0]["layerwise/1"]["log"]
    # The pipelined policies use their own process group ("dup:").
    assert sum(1 for op, _, _ in layerwise_log if op == "dup:all_reduce_sum") == 4 * (8 + 1)
