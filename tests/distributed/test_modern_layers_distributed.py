"""Every new block type under every strategy at world sizes 2 and 3 (gloo, DDP): the same
preconditioned gradients as single-process K-FAC on the concatenated batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from distributed_helper import run_distributed
from spdkfac import KFACPreconditioner

STRATEGIES = ("d-kfac", "mpd-kfac", "spd-kfac", "osawa")
SHARING = ("expand", "reduce")
GLOBAL_BATCH, LENGTH, VOCAB = 6, 5, 9


class _Everything(nn.Module):
    """Embedding, LayerNorm, a Linear over the sequence, RMSNorm, Conv1d, a depthwise
    Conv1d, GroupNorm and a grouped Conv2d."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.ln = nn.LayerNorm(8)
        self.mix = nn.Linear(8, 8)
        self.rms = nn.RMSNorm(8)
        self.conv = nn.Conv1d(8, 6, 3, padding=1)
        self.depthwise = nn.Conv1d(6, 6, 3, padding=1, groups=6)
        self.gn = nn.GroupNorm(2, 6)
        self.grouped = nn.Conv2d(6, 4, (1, 3), groups=2)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.rms(torch.tanh(self.mix(self.ln(self.embed(tokens)))))
        h = self.gn(self.depthwise(torch.tanh(self.conv(h.transpose(1, 2)))))
        h = torch.tanh(self.grouped(h[:, :, None]))  # [B, 4, 1, LENGTH - 2]
        return self.head(h.flatten(2).transpose(1, 2))  # [B, LENGTH - 2, 3]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Everything().double()


def _data() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, LENGTH), generator=generator)
    return tokens, torch.randint(0, 3, (GLOBAL_BATCH, LENGTH - 2), generator=generator)


def _loss(model: nn.Module, tokens: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(model(tokens).reshape(-1, 3), targets.reshape(-1))


def _options(sharing: str) -> dict[str, object]:
    return {
        "damping": 0.05,
        "kl_clip": None,
        "weight_sharing": sharing,
        "normalization": "unit-wise",
    }


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worker(rank: int, world_size: int) -> dict[str, dict[str, Tensor]]:
    tokens, targets = _data()
    share = GLOBAL_BATCH // world_size
    local = slice(rank * share, (rank + 1) * share)
    out = {}
    for strategy in STRATEGIES:
        for sharing in SHARING:
            model = DistributedDataParallel(_model())
            precond = KFACPreconditioner(model, strategy=strategy, **_options(sharing))  # type: ignore[arg-type]
            for _ in range(2):
                model.zero_grad()
                _loss(model, tokens[local], targets[local]).backward()
                assert precond.step()
            out[f"{strategy}/{sharing}"] = _grads(model.module)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_block_type_matches_single_process_kfac(world_size: int) -> None:
    results = run_distributed(_worker, world_size, timeout=240)
    tokens, targets = _data()
    for sharing in SHARING:
        model = _model()
        precond = KFACPreconditioner(model, **_options(sharing))  # type: ignore[arg-type]
        assert len(precond.layers) == 6 and len(precond.batchnorm_layers) == 3
        for _ in range(2):
            model.zero_grad()
            _loss(model, tokens, targets).backward()
            precond.step()
        reference = _grads(model)
        for rank, out in enumerate(results):
            for strategy in STRATEGIES:
                grads = out[f"{strategy}/{sharing}"]
                assert set(grads) == set(reference)
                for name, expected in reference.items():
                    torch.testing.assert_close(
                        grads[name],
                        expected,
                        rtol=1e-9,
                        atol=1e-12,
                        msg=f"{strategy} {sharing} {name} rank {rank}",
                    )


class _Twice(nn.Module):
    """One Linear layer applied twice per forward (weight sharing across calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.fc(torch.tanh(self.fc(x)))))


def _twice_data() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(8, 4, generator=generator, dtype=torch.float64)
    return inputs, torch.randint(0, 2, (8,), generator=generator)


def _twice_worker(rank: int, world_size: int) -> list[Tensor | None]:
    torch.manual_seed(0)
    model = DistributedDataParallel(_Twice().double())
    precond = KFACPreconditioner(model, kl_clip=None)
    inputs, targets = _twice_data()
    local = slice(rank * 4, rank * 4 + 4)
    for _ in range(2):  # the second step hands the layer over from its hook
        model.zero_grad()
        F.cross_entropy(model(inputs[local]), targets[local]).backward()
        precond.step()
    return [*precond.factors("fc"), model.module.fc.weight.grad]


def test_a_layer_called_twice_per_forward_matches_single_process() -> None:
    results = run_distributed(_twice_worker, 2, timeout=120)
    torch.manual_seed(0)
    model = _Twice().double()
    precond = KFACPreconditioner(model, kl_clip=None)
    inputs, targets = _twice_data()
    for _ in range(2):
        model.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        precond.step()
    expected = [*precond.factors("fc"), model.fc.weight.grad]
    for got in results:
        for value, reference in zip(got, expected, strict=True):
            torch.testing.assert_close(value, reference, rtol=1e-10, atol=1e-13)


def _exit_hook_worker(rank: int, world_size: int) -> bool:
    from spdkfac.comm import distributed

    KFACPreconditioner(nn.Linear(3, 2), lr=0.1)
    return bool(distributed._EXIT_HOOK)


def test_the_process_group_is_left_at_exit() -> None:
    """Scripts that end without destroy_process_group() aborted 2 times in 14 runs at exit
    (gloo, DDP + SPD-KFAC; 0 in 30 with the hook): a communicator registers the cleanup."""
    assert all(run_distributed(_exit_hook_worker, 2, timeout=60))
