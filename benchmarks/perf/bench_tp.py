"""Per-step time and memory per rank of FSDP2 × TP K-FAC against FSDP2 × TP AdamW (and
FSDP2 alone) on a tiny LLaMA-style model, gloo ranks on this machine, one thread each.

The model is :class:`spdkfac.models.llama.Llama`, tensor-parallel by torchtitan's plan
(:func:`spdkfac.comm.tensor_parallel_plan.parallelize_llama`); ``fully_shard`` then
shards each block and the root over the data-parallel mesh dimension. Times are per step
(forward, backward, ``precond.step()``, ``optimizer.step()``) after ``--warmup`` steps,
the slowest rank's; memory is the live local tensors: parameters and gradients (this
rank's shards), factors and inverses (``KFACPreconditioner.memory_bytes()``). Writes a
markdown table.

    python benchmarks/perf/bench_tp.py --out benchmarks/reports/fsdp_tp_llama_4ranks.md
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

# benchmarks/perf/ is the script's directory
from bench_fsdp import arguments, measure, publish, run_ranks, table
from spdkfac import KFACPreconditioner
from spdkfac.comm.tensor_parallel_plan import parallelize_llama
from spdkfac.models.llama import Llama

#: (name, tensor-parallel size, K-FAC strategy or None)
VARIANTS = (
    ("FSDP2 x TP + AdamW", 2, None),
    ("FSDP2 x TP + K-FAC (spd-kfac)", 2, "spd-kfac"),
    ("FSDP2 x TP + K-FAC (osawa)", 2, "osawa"),
    ("FSDP2 + AdamW", 1, None),
    ("FSDP2 + K-FAC (spd-kfac)", 1, "spd-kfac"),
)


def build(tp: int, world: int, args: Any, dtype: torch.dtype = torch.float32) -> Llama:
    """The model, tensor-parallel over ``tp`` ranks (when more than 1), then FSDP2 over
    the rest of the world."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Llama(args.vocab, args.dim, args.layers, args.heads, args.hidden).to(dtype)
    if tp > 1:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_llama(model, mesh["tp"])
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
    parser = arguments(
        __doc__, "sequences per step, global", world_size=4, steps=30, warmup=5, batch=8,
        seq_len=64, factor_every=10, inverse_every=10,
    )  # fmt: skip
    for flag, default in (("--vocab", 256), ("--dim", 128), ("--layers", 2), ("--heads", 4),
                          ("--hidden", 256)):  # fmt: skip
        parser.add_argument(flag, type=int, default=default)
    args = parser.parse_args()
    per_rank = run_ranks(_worker, args.world_size, args)
    command = "python benchmarks/perf/bench_tp.py " + " ".join(sys.argv[1:])
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
    publish(text, args.out)


if __name__ == "__main__":
    main()
