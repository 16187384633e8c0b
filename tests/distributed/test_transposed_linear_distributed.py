"""GPT-2's ``Conv1D`` (weight stored ``[in, out]``), one with a frozen bias, and a grouped
convolution with a frozen bias, under every strategy at world size 2 (gloo, DDP): the same
preconditioned gradients as single-process K-FAC on the concatenated batch."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from distributed_helper import run_distributed
from models.test_transformers_models import Conv1D
from spdkfac import KFACPreconditioner

STRATEGIES = ("d-kfac", "mpd-kfac", "spd-kfac", "osawa")
OPTIONS = {"damping": 0.05, "kl_clip": None, "lr": 0.1}


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Conv1D(8, 4)
        self.proj = Conv1D(6, 8)
        self.proj.bias.requires_grad_(False)
        self.grouped = nn.Conv1d(6, 4, 3, groups=2)
        self.grouped.bias.requires_grad_(False)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.proj(torch.tanh(self.attn(x))))  # [B, T, 6]
        h = torch.tanh(self.grouped(h.transpose(1, 2)))  # [B, 4, T - 2]
        return self.head(h.transpose(1, 2))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net().double()


def _data() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(2)
    inputs = torch.randn(6, 5, 4, generator=generator, dtype=torch.float64)
    return inputs, torch.randint(0, 3, (6, 3), generator=generator)


def _train(
    model: nn.Module, wrapped: nn.Module, rows: slice, **options: object
) -> dict[str, Tensor | None]:
    inputs, targets = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        precond = KFACPreconditioner(wrapped, **OPTIONS, **options)  # type: ignore[arg-type]
    assert {"attn", "proj"} <= set(precond.layers)
    for _ in range(2):
        model.zero_grad()
        loss = F.cross_entropy(wrapped(inputs[rows]).reshape(-1, 3), targets[rows].reshape(-1))
        loss.backward()
        assert precond.step()
    a_factor, _ = precond.factors("proj")
    assert a_factor is None or a_factor.shape == (8, 8)  # no column for the frozen bias
    precond.remove()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank: int, world_size: int) -> dict[str, dict[str, Tensor | None]]:
    out = {}
    for strategy in STRATEGIES:
        model = _model()
        out[strategy] = _train(
            model, DistributedDataParallel(model), slice(rank * 3, rank * 3 + 3), strategy=strategy
        )
    return out


def test_conv1d_and_frozen_biases_match_single_process_under_every_strategy() -> None:
    results = run_distributed(_worker, 2, timeout=180)
    model = _model()
    reference = _train(model, model, slice(0, 6))
    assert reference["proj.bias"] is None and reference["grouped.bias"] is None
    for rank, out in enumerate(results):
        for strategy in STRATEGIES:
            assert set(out[strategy]) == set(reference)
            for name, expected in reference.items():
                got = out[strategy][name]
                if expected is None:
                    assert got is None, f"{strategy} rank {rank} {name}"
                    continue
                torch.testing.assert_close(
                    got, expected, rtol=1e-9, atol=1e-12, msg=f"{strategy} rank {rank} {name}"
                )
