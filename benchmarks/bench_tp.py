"""Per-step time and memory per rank of FSDP2 × TP K-FAC against FSDP2 × TP AdamW (and
FSDP2 alone) on a tiny LLaMA-style model, gloo ranks on this machine, one thread each.

The model: token embedding, blocks of RMSNorm → attention (separate q, k, v, o
projections, no bias, no rotary embedding) and RMSNorm → SwiGLU MLP, a final RMSNorm and
an output projection. Tensor parallelism follows torchtitan's plan for LLaMA: the
embedding row-wise into a sequence-sharded residual stream, ``SequenceParallel`` norms,
q/k/v and the MLP's gate and up projections column-wise (the heads split across the
ranks), o and the MLP's down projection row-wise back into the stream, the output
column-wise (replicated logits). ``fully_shard`` then shards each block and the root
over the data-parallel mesh dimension. Times are per step (forward, backward,
``precond.step()``, ``optimizer.step()``) after ``--warmup`` steps, the slowest rank's;
memory is the live local tensors: parameters and gradients (this rank's shards), factors
and inverses (``KFACPreconditioner.memory_bytes()``). Writes a markdown table.

    python benchmarks/bench_tp.py --out benchmarks/reports/fsdp_tp_llama_4ranks.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from bench_fsdp import measure, run_ranks, table  # benchmarks/ is the script's directory
from spdkfac import KFACPreconditioner

#: (name, tensor-parallel size, K-FAC strategy or None)
VARIANTS = (
    ("FSDP2 x TP + AdamW", 2, None),
    ("FSDP2 x TP + K-FAC (spd-kfac)", 2, "spd-kfac"),
    ("FSDP2 x TP + K-FAC (osawa)", 2, "osawa"),
    ("FSDP2 + AdamW", 1, None),
    ("FSDP2 + K-FAC (spd-kfac)", 1, "spd-kfac"),
)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def _heads(self, x: Tensor) -> Tensor:
        batch, tokens, _ = x.shape  # the local heads under tensor parallelism
        return x.view(batch, tokens, -1, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self._heads(self.wq(x)), self._heads(self.wk(x)), self._heads(self.wv(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        batch, _, tokens, _ = y.shape
        out: Tensor = self.wo(y.transpose(1, 2).reshape(batch, tokens, -1))
        return out


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        out: Tensor = x + self.feed_forward(self.ffn_norm(x))
        return out


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        out: Tensor = self.output(self.norm(x))
        return out


def parallelize(model: Llama, mesh: Any) -> Llama:
    """torchtitan's LLaMA plan on the 1-D tensor-parallel ``mesh`` (module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tokens = Shard(1)
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=tokens),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=tokens, output_layouts=Replicate()),
    }
    parallelize_module(model, mesh, root)
    gather = PrepareModuleInput(input_layouts=(tokens,), desired_input_layouts=(Replicate(),))
    for block in model.layers:
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": gather,
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=tokens),
            "ffn_norm": SequenceParallel(),
            "feed_forward": gather,
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=tokens),
        }
        parallelize_module(block, mesh, plan)
    return model


def build(tp: int, world: int, args: Any, dtype: torch.dtype = torch.float32) -> Llama:
    """The model, tensor-parallel over ``tp`` ranks (when more than 1), then FSDP2 over
    the rest of the world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Llama(args.vocab, args.dim, args.layers, args.heads, args.hidden).to(dtype)
    if tp > 1:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        parallelize(model, mesh["tp"])
        dp = mesh["dp"]
    else:
        dp = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def _run(rank: int, world: int, variant: tuple[str, int, str | None], args: Any) -> dict[str, Any]:
    name, tp, strategy = variant
    net = build(tp, world, args)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    precond = None
    if strategy is not None:
        precond = KFACPreconditioner(
            net,
            optimizer=optimizer,
            strategy=strategy,
            damping=0.025,
            normalization="unit-wise",
            factor_update_steps=args.factor_every,
            inv_update_steps=args.inverse_every,
        )
    data_rank, data_ranks = rank // tp, world // tp  # the tp ranks of a batch share it
    per_rank = args.batch // data_ranks
    tokens = [
        torch.randint(
            0,
            args.vocab,
            (per_rank, args.seq_len + 1),
            generator=torch.Generator().manual_seed(seed),
        )
        for seed in (step * data_ranks + data_rank for step in range(args.steps))
    ]
    return measure(name, net, optimizer, precond, tokens, args.warmup)


def _worker(rank: int, world: int, init: str, args: Any, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    queue.put((rank, [_run(rank, world, variant, args) for variant in VARIANTS]))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step, global")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--factor-every", type=int, default=10)
    parser.add_argument("--inverse-every", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    per_rank = run_ranks(_worker, args.world_size, args)
    command = "python benchmarks/bench_tp.py " + " ".join(sys.argv[1:])
    text = (
        f"# FSDP2 x TP K-FAC vs FSDP2 x TP AdamW (tiny LLaMA, {args.world_size} ranks)\n\n"
        f"`{command}`\n\nLLaMA-style model ({args.layers} blocks, width {args.dim}, "
        f"{args.heads} heads, SwiGLU {args.hidden}, vocabulary {args.vocab}); FSDP2 x TP: "
        f"{args.world_size // 2} x 2 mesh, torchtitan's plan; FSDP2: {args.world_size} ranks. "
        f"Global batch {args.batch} sequences, context {args.seq_len}, "
        f"{args.steps} steps ({args.warmup} warm-up left out), factors every "
        f"{args.factor_every}, inverses every {args.inverse_every}; step time of the slowest "
        "rank; memory in MiB per rank (rank 0/1/...), live local tensors.\n\n"
        f"{table(per_rank, [name for name, _, _ in VARIANTS])}\n"
    )
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
