"""Pieces of the tensor-parallel tests (tests/distributed/test_tensor_parallel*.py): a tiny
attention + MLP block, its tensor-parallel plans (heads split across the ranks, with and
without sequence parallelism), the global batches, and a training loop that returns the
first step's whole preconditioned gradients and the final whole parameters."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_reference import kronecker_precondition, outer_mean, with_one
from spdkfac import KFACPreconditioner

__all__ = [
    "CLASSES",
    "LINEAR",
    "OPTIONS",
    "STRATEGIES",
    "Block",
    "assert_explicit",
    "assert_matches",
    "block",
    "explicit_first_step",
    "freeze_and_tie",
    "llama",
    "parallelize",
    "tp_batch",
    "train",
]

STRATEGIES = ("d-kfac", "spd-kfac", "osawa", "layer-paths")
OPTIONS: dict[str, Any] = {
    "damping": 0.05,
    "kl_clip": 1e-2,
    "factor_update_steps": 1,
    "inv_update_steps": 2,
    "normalization": "unit-wise",
}
INPUTS, WIDTH, HEADS, CLASSES, TOKENS = 3, 8, 2, 5, 6


class Block(nn.Module):
    """An input projection, a pre-norm causal attention (``heads`` heads, as many as the
    query projection's local rows allow: split across tensor-parallel ranks) and a pre-norm
    MLP of ``hidden`` units, a final norm and a per-token classifier head."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Linear(INPUTS, WIDTH)
        self.norm1 = nn.LayerNorm(WIDTH)
        self.q = nn.Linear(WIDTH, WIDTH)
        self.k = nn.Linear(WIDTH, WIDTH)
        self.v = nn.Linear(WIDTH, WIDTH, bias=False)
        self.o = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, hidden)
        self.down = nn.Linear(hidden, WIDTH)
        self.norm3 = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def _heads(self, x: Tensor) -> Tensor:
        batch, tokens, _ = x.shape
        return x.view(batch, tokens, -1, WIDTH // HEADS).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)
        h = self.norm1(x)
        q, k, v = self._heads(self.q(h)), self._heads(self.k(h)), self._heads(self.v(h))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        batch, _, tokens, _ = attended.shape
        x = x + self.o(attended.transpose(1, 2).reshape(batch, tokens, -1))
        x = x + self.down(torch.tanh(self.up(self.norm2(x))))
        logits: Tensor = self.head(self.norm3(x))
        return logits


def block(hidden: int = 12) -> Block:
    torch.manual_seed(0)
    return Block(hidden).double()


def parallelize(model: nn.Module, mesh: Any, *, sequence: bool) -> nn.Module:
    """Megatron's plan on ``mesh`` (1-D): q, k, v and up column-wise, o and down row-wise;
    with ``sequence``, torchtitan's: the residual stream sharded by tokens, the norms
    ``SequenceParallel``, the input projection row-wise into it and the head column-wise
    out of it; without, those stay replicated plain modules."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if not sequence:
        # up's output stays a DTensor into down: RowwiseParallel reads a local input as
        # even shards, so an uneven MLP width runs only this way.
        plan: dict[str, Any] = {name: ColwiseParallel() for name in ("q", "k", "v")}
        plan.update(
            up=ColwiseParallel(use_local_output=False), o=RowwiseParallel(), down=RowwiseParallel()
        )
        return parallelize_module(model, mesh, plan)
    tokens = Shard(1)
    plan = {name: ColwiseParallel(input_layouts=tokens) for name in ("q", "k", "v", "up")}
    plan.update(
        embed=RowwiseParallel(input_layouts=Replicate(), output_layouts=tokens),
        o=RowwiseParallel(output_layouts=tokens),
        down=RowwiseParallel(output_layouts=tokens),
        head=ColwiseParallel(input_layouts=tokens, output_layouts=Replicate()),
        norm1=SequenceParallel(),
        norm2=SequenceParallel(),
        norm3=SequenceParallel(),
    )
    return parallelize_module(model, mesh, plan)


def tp_batch(step: int) -> tuple[Tensor, Tensor]:
    """Step ``step``'s global batch: 4 sequences of 6 tokens and their per-token classes."""
    generator = torch.Generator().manual_seed(700 + step)
    inputs = torch.randn(4, TOKENS, INPUTS, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, CLASSES, (4, TOKENS), generator=generator)
    return inputs, targets


def llama() -> nn.Module:
    """A float64 :class:`~spdkfac.models.llama.Llama` over a vocabulary of ``CLASSES``
    tokens (2 blocks, width 8, 2 heads, SwiGLU 12)."""
    from spdkfac.models.llama import Llama

    torch.manual_seed(0)
    return Llama(CLASSES, WIDTH, 2, HEADS, 12).double()


def token_batch(step: int) -> tuple[Tensor, Tensor]:
    """Step ``step``'s global batch of 4 sequences of 6 token ids and their next tokens."""
    tokens = torch.randint(
        0, CLASSES, (4, TOKENS + 1), generator=torch.Generator().manual_seed(step)
    )
    return tokens[:, :-1], tokens[:, 1:]


def _full(tensor: Tensor) -> Tensor:
    full = getattr(tensor, "full_tensor", None)
    value = full() if full is not None else tensor
    assert isinstance(value, Tensor)
    return value.detach().clone()


def train(
    model: nn.Module, steps: int, part: tuple[int, int], **options: Any
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The whole preconditioned gradients of the first step and the whole parameters
    after ``steps`` SGD steps on rows ``part`` of each global batch (the block's, or a
    LLaMA's token batches); with ``accumulation_steps`` the rows are split into that many
    passes, each loss divided by their number."""
    batches = token_batch if isinstance(model, _llama_type()) else tp_batch
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    precond = KFACPreconditioner(model, optimizer=optimizer, **{**OPTIONS, **options})
    passes = options.get("accumulation_steps", 1)
    first: dict[str, Tensor] = {}
    for step in range(steps):
        optimizer.zero_grad()
        inputs, targets = batches(step)
        for begin, end in _passes(part, passes):
            logits = model(inputs[begin:end])
            loss = F.cross_entropy(logits.reshape(-1, CLASSES), targets[begin:end].reshape(-1))
            (loss / passes).backward()
        assert precond.step()
        if step == 0:
            first = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
    return first, {n: _full(p) for n, p in model.named_parameters()}


def _passes(part: tuple[int, int], passes: int) -> list[tuple[int, int]]:
    """Rows ``part`` cut into ``passes`` equal consecutive slices."""
    begin, end = part
    size = (end - begin) // passes
    assert size * passes == end - begin, (part, passes)
    return [(begin + i * size, begin + (i + 1) * size) for i in range(passes)]


def _llama_type() -> type[nn.Module]:
    from spdkfac.models.llama import Llama

    return Llama


def assert_matches(
    result: tuple[dict[str, Tensor], dict[str, Tensor]],
    reference: tuple[dict[str, Tensor], dict[str, Tensor]],
    label: str,
) -> None:
    """A tensor-parallel run's first preconditioned gradients and final parameters equal
    the single-process reference's (float64 tolerances)."""
    for got, expected in zip(result, reference, strict=True):
        assert set(got) == set(expected), label
        for name, value in expected.items():
            torch.testing.assert_close(
                got[name], value, rtol=1e-9, atol=1e-11, msg=f"{label} {name}"
            )


#: The Linear layers of :class:`Block`.
LINEAR = ("embed", "q", "k", "v", "o", "up", "down", "head")


def explicit_first_step(hidden: int) -> dict[str, Tensor]:
    """Independent float64 K-FAC of every Linear layer of the unsharded block on the first
    global batch, without the KL clip: explicit per-row outer products (A over the B·T
    rows with the constant 1 of a bias, G = (1/N) Σ δδᵀ with δ = N·g) and an explicit
    Kronecker solve. Returns each layer's ``[∇W, ∇b]`` preconditioned, by layer name."""
    model = block(hidden)
    record: dict[str, tuple[Tensor, Tensor]] = {}

    def keep(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
            output.retain_grad()
            record[name] = (args[0].detach(), output)

        return hook

    for name in LINEAR:
        getattr(model, name).register_forward_hook(keep(name))
    inputs, targets = tp_batch(0)
    F.cross_entropy(model(inputs).reshape(-1, CLASSES), targets.reshape(-1)).backward()
    out: dict[str, Tensor] = {}
    for name in LINEAR:
        layer = getattr(model, name)
        x, y = record[name]
        assert y.grad is not None
        rows = x.reshape(-1, x.shape[-1])
        grads = y.grad.reshape(-1, y.shape[-1])
        count = rows.shape[0]
        biased = layer.bias is not None
        a_factor = outer_mean([with_one(r) if biased else r for r in rows])
        g_factor = outer_mean([count * g for g in grads])
        matrix = layer.weight.grad
        if biased:
            matrix = torch.cat([matrix, layer.bias.grad[:, None]], dim=1)
        damping = OPTIONS["damping"]
        out[name] = kronecker_precondition(matrix, a_factor, g_factor, damping)
    return out


def assert_explicit(first: dict[str, Tensor], explicit: dict[str, Tensor], label: str) -> None:
    """A run's first preconditioned Linear gradients equal :func:`explicit_first_step`'s."""
    for name, expected in explicit.items():
        got = first[f"{name}.weight"]
        if f"{name}.bias" in first:
            got = torch.cat([got, first[f"{name}.bias"][:, None]], dim=1)
        torch.testing.assert_close(got, expected, rtol=1e-8, atol=1e-11, msg=f"{label} {name}")


def freeze_and_tie(model: nn.Module) -> nn.Module:
    """Freeze q's bias and the first norm, and tie k's weight to q's (after any
    ``parallelize_module``, which gives each parameter a DTensor of its own)."""
    model.q.bias.requires_grad_(False)
    model.norm1.requires_grad_(False)
    model.k.weight = model.q.weight
    return model
