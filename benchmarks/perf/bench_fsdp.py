"""Per-step time and memory per rank of FSDP2 + K-FAC against FSDP2 + AdamW and DDP + K-FAC
on the built-in GPT (gloo ranks on this machine, one thread each).

Each variant trains ``--steps`` steps of AdamW on random token ids (batch ``--batch`` per
rank, context ``--seq-len``), K-FAC with factors every ``--factor-every`` and inverses every
``--inverse-every`` steps (the README's GPT recipe: 10 and 25). Times are per step (forward,
backward, ``precond.step()``, ``optimizer.step()``), after ``--warmup`` steps, the slowest
rank's; memory is the live local tensors: parameters and gradients (FSDP2: this rank's
shards), factors and inverses (``KFACPreconditioner.memory_bytes()``). Writes a markdown table.

    python benchmarks/perf/bench_fsdp.py --out benchmarks/reports/fsdp_gpt_2ranks.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from spdkfac import KFACPreconditioner
from spdkfac.models.gpt import GPT

#: (name, wrapper, K-FAC strategy or None)
VARIANTS = (
    ("FSDP2 + AdamW", "fsdp", None),
    ("FSDP2 + K-FAC (spd-kfac)", "fsdp", "spd-kfac"),
    ("FSDP2 + K-FAC (osawa)", "fsdp", "osawa"),
    ("DDP + AdamW", "ddp", None),
    ("DDP + K-FAC (spd-kfac)", "ddp", "spd-kfac"),
)


def local_bytes(tensors: list[torch.Tensor | None]) -> int:
    """Bytes of the tensors' local parts (a DTensor's shard on this rank)."""
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def _wrap(model: nn.Module, wrapper: str, world: int) -> nn.Module:
    if wrapper == "ddp":
        return DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    assert isinstance(model.blocks, nn.ModuleList)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _run(rank: int, world: int, variant: tuple[str, str, str | None], args: Any) -> dict[str, Any]:
    name, wrapper, strategy = variant
    torch.manual_seed(0)
    net = _wrap(GPT(block_size=args.seq_len), wrapper, world)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    precond = None
    if strategy is not None:
        precond = KFACPreconditioner(
            net,
            optimizer=optimizer,
            strategy=strategy,
            damping=0.025,
            factor_update_steps=args.factor_every,
            inv_update_steps=args.inverse_every,
        )
    tokens = [
        torch.randint(
            0, 256, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(seed)
        )
        for seed in (step * world + rank for step in range(args.steps))
    ]
    return measure(name, net, optimizer, precond, tokens, args.warmup)


def measure(
    name: str,
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    precond: KFACPreconditioner | None,
    batches: list[torch.Tensor],
    warmup: int,
) -> dict[str, Any]:
    """Train ``net`` on each of ``batches`` (token ids, next-token targets) and return the
    step times after ``warmup`` and this rank's memory."""
    times = []
    for tokens in batches:
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        logits = net(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
        if precond is None or precond.step():
            optimizer.step()
        times.append(time.perf_counter() - start)
    params = list(net.parameters())
    memory = precond.memory_bytes() if precond is not None else {"factors": 0, "inverses": 0}
    return {
        "name": name,
        "times": times[warmup:],
        "params": local_bytes(list(params)),
        "grads": local_bytes([p.grad for p in params]),
        "factors": memory["factors"],
        "inverses": memory["inverses"],
    }


def _worker(rank: int, world: int, init: str, args: Any, queue: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    queue.put((rank, [_run(rank, world, variant, args) for variant in VARIANTS]))
    dist.destroy_process_group()


def table(per_rank: dict[int, list[dict[str, Any]]], names: list[str]) -> str:
    """The markdown table of each variant (``names``, in run order): the slowest rank's
    median and mean step, each rank's memory in MiB."""
    mib = 1024 * 1024
    lines = [
        "| variant | median step (ms) | mean step (ms) | params | grads | factors | inverses |",
        "|---|---|---|---|---|---|---|",
    ]
    for index, name in enumerate(names):
        rows = [per_rank[rank][index] for rank in sorted(per_rank)]
        slowest = [max(values) for values in zip(*(row["times"] for row in rows), strict=True)]
        memory = [
            "/".join(f"{row[key] / mib:.2f}" for row in rows)
            for key in ("params", "grads", "factors", "inverses")
        ]
        lines.append(
            f"| {name} | {1000 * statistics.median(slowest):.1f} | "
            f"{1000 * statistics.mean(slowest):.1f} | " + " | ".join(memory) + " |"
        )
    return "\n".join(lines)


def run_ranks(worker: Any, world: int, args: Any) -> dict[int, list[dict[str, Any]]]:
    """Each rank's results of ``worker(rank, world, init, args, queue)`` on spawned ranks."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = str(Path(tmp) / "init")
        procs = [
            context.Process(target=worker, args=(r, world, init, args, queue)) for r in range(world)
        ]
        for proc in procs:
            proc.start()
        per_rank = dict(queue.get(timeout=1800) for _ in procs)
        for proc in procs:
            proc.join()
    return per_rank


def arguments(doc: str, batch_help: str, **defaults: int) -> argparse.ArgumentParser:
    """The flags both FSDP benchmarks take, with a script's defaults (``world_size``,
    ``steps``, ``warmup``, ``batch``, ``seq_len``, ``factor_every``, ``inverse_every``)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name, default in defaults.items():
        help_text = batch_help if name == "batch" else None
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                            help=help_text)  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    return parser


def publish(text: str, out: Path | None) -> None:
    """Print the report and write it to ``out`` when given."""
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


def main() -> None:
    args = arguments(
        __doc__, "sequences per rank", world_size=2, steps=60, warmup=10, batch=8,
        seq_len=128, factor_every=10, inverse_every=25,
    ).parse_args()  # fmt: skip
    per_rank = run_ranks(_worker, args.world_size, args)
    table_text = table(per_rank, [name for name, _, _ in VARIANTS])
    command = "python benchmarks/perf/bench_fsdp.py " + " ".join(sys.argv[1:])
    text = (
        f"# FSDP2 + K-FAC vs FSDP2 + AdamW vs DDP + K-FAC (GPT, {args.world_size} ranks)\n\n"
        f"`{command}`\n\nGPT (2 blocks, width 128, vocabulary 256), batch {args.batch} per "
        f"rank, context {args.seq_len}, {args.steps} steps ({args.warmup} warm-up left out), "
        f"factors every {args.factor_every}, inverses every {args.inverse_every}; step time "
        "of the slowest rank; memory in MiB per rank (rank 0/rank 1), live local tensors.\n\n"
        f"{table_text}\n"
    )
    publish(text, args.out)


if __name__ == "__main__":
    main()
