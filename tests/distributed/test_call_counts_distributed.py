"""A layer called a varying number of times per pass (a data-dependent loop, a cell
unrolled over longer sequences later), differing by rank and by step, under every
exchange that hands factors over from hooks: every rank ends with single-process K-FAC
on the concatenated batch (issue 39, item 2)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from distributed_helper import run_distributed
from spdkfac import KFACPreconditioner

STRATEGIES = ("d-kfac", "spd-kfac", "osawa")
#: The second call of the cell runs in a non-reentrant checkpointed region on some steps
#: (recomputed in backward, never counted twice). DDP itself refuses reentrant regions
#: around a parameter used several times ("mark a variable ready only once").
CHECKPOINTED = (None, "non-reentrant", "non-reentrant", None)
SHARE = 3
#: Calls of the looped layer per pass, by step then rank: the first factor step is the
#: smallest, later ones grow and differ by rank (and shrink again at the last step).
CALLS = ((1, 1, 1), (2, 3, 1), (4, 2, 3), (1, 2, 1))


class _Loop(nn.Module):
    """A stem, one Linear applied ``loops`` times (an unrolled cell), and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 5)
        self.cell = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor, loops: int, checkpointed: str | None = None) -> Tensor:
        h = torch.tanh(self.stem(x))
        for index in range(loops):
            if index == 1 and checkpointed is not None:  # a later call in a region
                h = checkpoint(self._cell, h, use_reentrant=checkpointed == "reentrant")
            else:
                h = self._cell(h)
        return self.head(h)

    def _cell(self, h: Tensor) -> Tensor:
        return torch.tanh(self.cell(h))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Loop().double()


def _data(world_size: int, step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    inputs = torch.randn(world_size * SHARE, 4, generator=generator, dtype=torch.float64)
    return inputs, torch.randint(0, 3, (world_size * SHARE,), generator=generator)


def _options(strategy: str) -> dict[str, object]:
    return {"strategy": strategy, "damping": 0.05, "kl_clip": None, "factor_decay": 0.7}


def _state(precond: KFACPreconditioner, model: nn.Module) -> dict[str, Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    for name in precond.layers:
        for label, factor in zip("AG", precond.factors(name), strict=True):
            if factor is not None:  # with owners, another rank's factor is None here
                out[f"{name}.{label}"] = factor.clone()
    return out


def _average_gradients(model: nn.Module) -> None:
    """What DDP would do, for a model without it (DDP refuses reentrant regions here)."""
    world_size = dist.get_world_size()
    for parameter in model.parameters():
        assert parameter.grad is not None
        dist.all_reduce(parameter.grad)
        parameter.grad.div_(world_size)


def _worker(rank: int, world_size: int, reentrant: bool) -> dict[str, list[dict[str, Tensor]]]:
    out: dict[str, list[dict[str, Tensor]]] = {}
    for strategy in STRATEGIES:
        plain = _model()
        model = plain if reentrant else DistributedDataParallel(plain)
        precond = KFACPreconditioner(model, **_options(strategy))  # type: ignore[arg-type]
        states = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the counts are valid: no warning either
            for step, calls in enumerate(CALLS):
                inputs, targets = _data(world_size, step)
                local = slice(rank * SHARE, (rank + 1) * SHARE)
                model.zero_grad()
                region = CHECKPOINTED[step] and ("reentrant" if reentrant else CHECKPOINTED[step])
                output = model(inputs[local], calls[rank], region)
                F.cross_entropy(output, targets[local]).backward()
                if reentrant:
                    _average_gradients(plain)
                assert precond.step()
                states.append(_state(precond, plain))
        out[strategy] = states
    return out


def _reference(world_size: int) -> list[dict[str, Tensor]]:
    """Single process, float64: each rank's share as one accumulation pass of the step."""
    model = _model()
    precond = KFACPreconditioner(model, **_options("d-kfac"), accumulation_steps=world_size)  # type: ignore[arg-type]
    states = []
    for step, calls in enumerate(CALLS):
        inputs, targets = _data(world_size, step)
        model.zero_grad()
        for rank in range(world_size):
            local = slice(rank * SHARE, (rank + 1) * SHARE)
            loss = F.cross_entropy(model(inputs[local], calls[rank]), targets[local])
            (loss / world_size).backward()
        assert precond.step()
        states.append(_state(precond, model))
    return states


@pytest.mark.parametrize(
    ("world_size", "reentrant"), [(2, False), (3, False), (2, True)], ids=["2", "3", "2-reentrant"]
)
def test_growing_rank_dependent_call_counts_match_single_process(
    world_size: int, reentrant: bool
) -> None:
    """Under DDP with non-reentrant regions; without DDP (gradients averaged by hand)
    with reentrant ones, whose calls are captured in the backward pass."""
    results = run_distributed(_worker, world_size, reentrant, timeout=240)
    reference = _reference(world_size)
    for rank, out in enumerate(results):
        for strategy in STRATEGIES:
            for step, (got, expected) in enumerate(zip(out[strategy], reference, strict=True)):
                for key, value in got.items():
                    torch.testing.assert_close(
                        value,
                        expected[key],
                        rtol=1e-9,
                        atol=1e-12,
                        msg=f"{strategy} rank {rank} step {step} {key}",
                    )
                assert all(k in got for k in expected if not k.endswith((".A", ".G")))
