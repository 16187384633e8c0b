"""Factor + inverse bytes each rank holds, per strategy, measured from the live tensors.

Runs ``--world-size`` gloo ranks on this machine; each builds the model under DDP, takes
``--steps`` K-FAC steps (random inputs, batch 8 per rank) with every strategy in turn and
reports ``KFACPreconditioner.memory_bytes()``. Writes a markdown table.

    python benchmarks/perf/measure_strategy_memory.py --models resnet32,wrn16-4 \
        --out benchmarks/reports/strategy_memory.md
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from spdkfac import KFACPreconditioner
from spdkfac.models import build_model

STRATEGIES = ("d-kfac", "mpd-kfac", "spd-kfac", "osawa")


def _worker(rank: int, world: int, init: str, models: list[str], steps: int, queue: object) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    rows = []
    for name in models:
        for strategy in STRATEGIES:
            torch.manual_seed(0)
            model = DistributedDataParallel(
                build_model(name, num_classes=10, in_channels=3, input_size=32)
            )
            precond = KFACPreconditioner(model, strategy=strategy, lr=0.1)
            for step in range(steps):
                model.zero_grad()
                generator = torch.Generator().manual_seed(step * world + rank)
                inputs = torch.randn(8, 3, 32, 32, generator=generator)
                targets = torch.randint(0, 10, (8,), generator=generator)
                F.cross_entropy(model(inputs), targets).backward()
                precond.step()
            memory = precond.memory_bytes()
            rows.append((name, strategy, rank, memory["factors"], memory["inverses"]))
            precond.remove()
    queue.put(rows)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet32,wrn16-4")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as directory:
        init = os.path.join(directory, "init")
        processes = [
            context.Process(
                target=_worker, args=(r, args.world_size, init, models, args.steps, queue)
            )
            for r in range(args.world_size)
        ]
        for process in processes:
            process.start()
        rows = [row for _ in processes for row in queue.get(timeout=1800)]
        for process in processes:
            process.join(timeout=60)
    mib = 2**20
    lines = [
        "# Factor + inverse memory per rank, by strategy",
        "",
        f"command: `python {' '.join(sys.argv)}`",
        "",
        f"Measured from the live tensors (`KFACPreconditioner.memory_bytes()`) after "
        f"{args.steps} K-FAC steps under DDP on {args.world_size} gloo ranks (float32).",
        "",
        "| model | strategy | "
        + " | ".join(f"rank {r} MiB" for r in range(args.world_size))
        + " | max MiB | max / d-kfac |",
        "|---|---|" + "---|" * (args.world_size + 2),
    ]
    for name in models:
        per_rank = {
            (strategy, rank): factors + inverses
            for model, strategy, rank, factors, inverses in rows
            if model == name
        }
        baseline = max(per_rank[("d-kfac", r)] for r in range(args.world_size))
        for strategy in STRATEGIES:
            values = [per_rank[(strategy, r)] for r in range(args.world_size)]
            cells = " | ".join(f"{v / mib:.2f}" for v in values)
            lines.append(
                f"| {name} | {strategy} | {cells} | {max(values) / mib:.2f} | "
                f"{max(values) / baseline:.3f} |"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
