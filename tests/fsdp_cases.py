"""Pieces of the FSDP2 tests (tests/distributed/test_fsdp*.py): the models, how they are
sharded, the single-process float64 references, and full copies of sharded gradients and
parameters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from parallel_cases import batch, bounds
from spdkfac import KFACPreconditioner

STRATEGIES = ("d-kfac", "spd-kfac", "osawa")
#: Stale refreshes: factors every step, inverses every 2 (the KL clip active).
OPTIONS: dict[str, Any] = {
    "damping": 0.05,
    "kl_clip": 1e-2,
    "factor_update_steps": 1,
    "inv_update_steps": 2,
}

__all__ = [
    "ConvNet",
    "full_grads",
    "full_params",
    "gpt",
    "gpt_batch",
    "shard",
    "train",
    "units",
]


class ConvNet(nn.Module):
    """Conv2d and Linear layers whose output dims do not divide evenly by 2 (uneven shards)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 3, 3, stride=2, bias=False)
        self.fc1 = nn.Linear(3 * 2 * 2, 5)
        self.fc2 = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.conv2(torch.tanh(self.conv(x))))
        return self.fc2(torch.tanh(self.fc1(x.flatten(1))))


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    return ConvNet().double()


def gpt() -> nn.Module:
    """A tiny float64 GPT (embeddings, a tied head, LayerNorm, two blocks)."""
    from spdkfac.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=11, block_size=6, n_layer=2, n_head=2, d_model=8).double()


def gpt_batch(step: int) -> tuple[Tensor, Tensor]:
    """Step ``step``'s global batch of 4 sequences of 6 tokens and their next tokens."""
    tokens = torch.randint(0, 11, (4, 7), generator=torch.Generator().manual_seed(500 + step))
    return tokens[:, :-1], tokens[:, 1:]


def units(model: nn.Module) -> list[nn.Module]:
    """The submodules sharded as groups of their own: the GPT's blocks (its tied embedding
    and head stay in the root's group), every other model's children with parameters."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        return list(blocks)
    return [child for child in model.children() if any(True for _ in child.parameters())]


def shard(model: nn.Module, mesh: Any, *, reshard: bool = True, **policy: Any) -> nn.Module:
    """``fully_shard`` each of :func:`units`, then the root (``policy``: more arguments)."""
    from torch.distributed.fsdp import fully_shard

    for unit in units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, **policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **policy)
    return model


def _full(tensor: Tensor) -> Tensor:
    full = getattr(tensor, "full_tensor", None)
    value = full() if full is not None else tensor
    assert isinstance(value, Tensor)
    return value.detach().clone()


def full_grads(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter's whole gradient (gathered from the shards), by name."""
    return {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def full_params(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter whole (gathered from the shards), by name."""
    return {n: _full(p) for n, p in model.named_parameters()}


def _loss(model: nn.Module, kind: str, step: int, part: tuple[int, int]) -> Tensor:
    begin, end = part
    if kind == "gpt":
        inputs, targets = gpt_batch(step)
        logits = model(inputs[begin:end])
        return F.cross_entropy(logits.reshape(-1, 11), targets[begin:end].reshape(-1))
    images, labels = batch(step)
    dtype = next(model.parameters()).dtype  # float32 models (mixed precision) too
    return F.cross_entropy(model(images[begin:end].to(dtype)), labels[begin:end])


def train(
    model: nn.Module,
    kind: str,
    steps: int,
    make_optimizer: Callable[[Sequence[Tensor]], torch.optim.Optimizer],
    part: tuple[int, int],
    **options: Any,
) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, torch.dtype]]:
    """The preconditioned gradients of the first step, the parameters after ``steps``
    steps of ``part`` of each global batch, and the layers whose inverses this rank
    holds (with the inverses' dtype); ``options`` go to the preconditioner."""
    optimizer = make_optimizer(list(model.parameters()))
    precond = KFACPreconditioner(model, optimizer=optimizer, **options)
    first: dict[str, Tensor] = {}
    for step in range(steps):
        optimizer.zero_grad()
        _loss(model, kind, step, part).backward()
        assert precond.step()
        if step == 0:
            first = full_grads(model)
        optimizer.step()
    inverses = {name: precond.inverses(name)[0] for name in precond.layers}
    held = {name: value.dtype for name, value in inverses.items() if value is not None}
    return first, full_params(model), held


def global_part(kind: str, rank: int, world_size: int) -> tuple[int, int]:
    """The rows of each global batch ``rank`` trains on."""
    if kind == "gpt":
        per_rank = 4 // world_size
        return rank * per_rank, (rank + 1) * per_rank
    return bounds(rank, world_size)


def assert_matches(
    first: dict[str, Tensor],
    final: dict[str, Tensor],
    reference: tuple[dict[str, Tensor], dict[str, Tensor]],
    label: str,
) -> None:
    """A sharded run's first preconditioned gradients and final parameters equal the
    single-process reference's (float64 tolerances)."""
    grads, params = reference
    for name, expected in grads.items():
        torch.testing.assert_close(
            first[name], expected, rtol=1e-9, atol=1e-12, msg=f"{label} {name}"
        )
    for name, expected in params.items():
        torch.testing.assert_close(
            final[name], expected, rtol=1e-8, atol=1e-10, msg=f"{label} {name}"
        )
