"""What counting every call costs (issue 39, item 2): step time at 2 gloo ranks with
constant call counts (the common case: no slot grows, only the wider weights tensor and
the per-step bookkeeping) and with a call count that grows at every measured step (each
such step re-exchanges the grown slots: one more bucket and weights all-reduce).

Run from the repository root with the package to measure first on PYTHONPATH, e.g.
``PYTHONPATH=src python benchmarks/perf/measure_call_count_revision.py``; compare two trees by
running it with each ``src`` (the script prints medians in milliseconds per step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from spdkfac import KFACPreconditioner


class _Net(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.cell = nn.Linear(width, width)
        self.head = nn.Linear(width, 10)

    def forward(self, x: Tensor, loops: int) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        for _ in range(loops):
            x = torch.tanh(self.cell(x))
        return self.head(x)


def _timed_revisions() -> list[float]:
    """Seconds each re-exchange took (wraps ``FactorPipeline.revise`` where it exists)."""
    spent: list[float] = []
    try:
        from spdkfac.comm.pipeline import FactorPipeline
    except ImportError:
        return spent
    original = getattr(FactorPipeline, "revise", None)
    if original is None:  # a tree without the fix
        return spent

    def revise(self: FactorPipeline, contributions: object) -> object:
        start = time.perf_counter()
        result = original(self, contributions)
        spent.append(time.perf_counter() - start)
        return result

    FactorPipeline.revise = revise  # type: ignore[method-assign,assignment]
    return spent


def _rank(rank: int, world: int, init: str, args: argparse.Namespace, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    revisions = _timed_revisions()
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DistributedDataParallel(_Net(args.width, args.depth))
    precond = KFACPreconditioner(model, strategy=args.strategy, lr=0.1)
    x, y = torch.randn(32, args.width), torch.randint(0, 10, (32,))
    times: list[tuple[float, float]] = []
    for step in range(args.warmup + args.steps):
        # "grow": one more call at every step than at any before (always a revision).
        loops = 1 + step if args.mode == "grow" else 1
        start = time.perf_counter()
        model.zero_grad()
        F.cross_entropy(model(x, loops), y).backward()
        middle = time.perf_counter()
        precond.step()
        if step >= args.warmup:
            times.append((time.perf_counter() - start, time.perf_counter() - middle))
    if rank == 0:
        medians = [statistics.median(t[i] for t in times) * 1e3 for i in (0, 1)]
        revision = statistics.median(revisions) * 1e3 if revisions else 0.0
        queue.put([*medians, revision, len(revisions)])
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--strategy", default="spd-kfac")
    parser.add_argument("--mode", choices=["constant", "grow"], default="constant")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory() as folder:
        init = os.path.join(folder, "init")
        mp.start_processes(
            _rank, args=(2, init, args, queue), nprocs=2, join=True, start_method="spawn"
        )
    whole, step, revision, count = queue.get()
    print(
        f"{args.strategy} {args.mode}: step {whole:.2f} ms, of which step() {step:.2f} ms; "
        f"{count} re-exchanges of {revision:.3f} ms (medians, rank 0)"
    )


if __name__ == "__main__":
    sys.exit(main())
