"""``spdkfac demo``: a small CNN on Fashion-MNIST with SGD, then with K-FAC, side by side.

Runs on one process, or data parallel under ``torchrun`` (``make demo`` uses two workers).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from spdkfac.cli.arguments import positive_float, positive_int
from spdkfac.cli.demo_outputs import (
    EpochResult,
    check_out_dir,
    format_table,
    write_demo_outputs,
)
from spdkfac.comm import Communicator, destroy_distributed, init_distributed
from spdkfac.config import KFACConfig
from spdkfac.data import DEFAULT_FASHION_MNIST_DIR, load_fashion_mnist
from spdkfac.models import MODEL_NAMES, build_model
from spdkfac.preconditioner import KFACPreconditioner
from spdkfac.strategies import STRATEGY_NAMES
from spdkfac.training.loop import cross_entropy_pass, train_step
from spdkfac.training.progress import ProgressBar

__all__ = ["EpochResult", "add_parser", "format_table", "run"]

#: Where the demo leaves its table, numbers and plot (``--out-dir``).
DEFAULT_OUT_DIR = Path("demo-out")

#: The library's K-FAC defaults (the strategy the demo runs).
_KFAC = KFACConfig()
#: The demo's recipe for its small CNN (measured in docs/results.md): it has no BatchNorm,
#: so with the factor conventions of docs/guide.md its G factors are small and momentum
#: SGD + K-FAC needs more damping than the library default; stale factors and inverses
#: keep the demo short. Flags, like any user's options, not defaults of the options.
_RECIPE = {"damping": 0.3, "kl_clip": 1e-3, "factor_update_steps": 10, "inv_update_steps": 10}


def add_parser(verbs: Any) -> None:
    """Register the ``demo`` verb on an ``argparse`` sub-parser collection."""
    parser: argparse.ArgumentParser = verbs.add_parser(
        "demo",
        help="train a small CNN on Fashion-MNIST with SGD and with K-FAC and compare",
        description=(
            "Train the same model from the same initialisation with SGD (momentum 0.9) and "
            "with SGD preconditioned by K-FAC, and print a per-epoch table. Under torchrun "
            "the workers train data parallel (DistributedDataParallel + distributed K-FAC)."
        ),
    )
    parser.add_argument(
        "--data",
        type=Path,
        default=DEFAULT_FASHION_MNIST_DIR,
        help="directory with the Fashion-MNIST IDX files (default: %(default)s)",
    )
    parser.add_argument("--model", choices=MODEL_NAMES, default="cnn", help="built-in model")
    parser.add_argument("--epochs", type=positive_int, default=2, help="epochs per optimizer")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="batch size per worker")
    parser.add_argument(
        "--strategy", choices=STRATEGY_NAMES, default=_KFAC.strategy, help="distributed K-FAC"
    )
    parser.add_argument("--sgd-lr", type=positive_float, default=0.05, help="SGD learning rate")
    parser.add_argument(
        "--kfac-lr", type=positive_float, default=0.05, help="learning rate with K-FAC"
    )
    kfac_flags = {
        "--damping": ("K-FAC damping", positive_float, _RECIPE["damping"]),
        "--kl-clip": ("K-FAC KL clip", positive_float, _RECIPE["kl_clip"]),
        "--factor-update-steps": (
            "K-FAC factor interval",
            positive_int,
            _RECIPE["factor_update_steps"],
        ),
        "--inv-update-steps": ("K-FAC inverse interval", positive_int, _RECIPE["inv_update_steps"]),
    }
    for flag, (text, kind, default) in kfac_flags.items():
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")
    parser.add_argument(
        "--train-limit",
        type=positive_int,
        default=None,
        help="use only the first N training images (default: all 60,000)",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=DEFAULT_OUT_DIR,
        help="where the table (table.md), its numbers (results.csv) and a plot of accuracy "
        "and loss per epoch (accuracy.png, with matplotlib) go (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    parser.set_defaults(run=run)


def _evaluate(model: nn.Module, dataset: TensorDataset, comm: Communicator) -> float:
    """Test accuracy over the whole set, each rank scoring its own shard.

    The same numbers as :func:`spdkfac.training.loop.evaluate_accuracy`, but through a
    ``DataLoader``, which draws its base seed from the global generator: kept so the demo
    uses the random number generator exactly as it always has.
    """
    model.eval()
    shard = Subset(dataset, range(comm.rank, len(dataset), comm.world_size))
    counts = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for images, labels in DataLoader(shard, batch_size=1000):
            counts[0] += int((model(images).argmax(1) == labels).sum())
            counts[1] += len(labels)
    model.train()
    comm.all_reduce_sum(counts).wait()
    return float(counts[0] / counts[1])


def _kfac_config(args: argparse.Namespace) -> KFACConfig:
    """The K-FAC options the flags give (the others: the library's defaults)."""
    return KFACConfig(
        strategy=args.strategy,
        damping=args.damping,
        kl_clip=args.kl_clip,
        factor_update_steps=args.factor_update_steps,
        inv_update_steps=args.inv_update_steps,
    )


def _train(
    optimizer_name: str,
    args: argparse.Namespace,
    train_set: TensorDataset,
    test_set: TensorDataset,
    comm: Communicator,
) -> list[EpochResult]:
    torch.manual_seed(args.seed)
    model: nn.Module = build_model(args.model, num_classes=10, in_channels=1, input_size=28)
    if comm.world_size > 1:
        model = nn.parallel.DistributedDataParallel(model)
    use_kfac = optimizer_name != "sgd"
    lr = args.kfac_lr if use_kfac else args.sgd_lr
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    precond = (
        KFACPreconditioner(
            model,
            config=_kfac_config(args),
            optimizer=optimizer,  # the KL clip reads the optimizer's (constant) lr
        )
        if use_kfac
        else None
    )
    sampler: DistributedSampler[Any] = DistributedSampler(
        train_set, num_replicas=comm.world_size, rank=comm.rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    results = []
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        label = f"{optimizer_name:>8} epoch {epoch}"
        bar = ProgressBar(len(loader), label, enabled=comm.rank == 0)
        start = time.perf_counter()
        total_loss, batches = 0.0, 0
        for images, labels in loader:
            outcome = train_step(
                model, optimizer, precond, [cross_entropy_pass(model, images, labels)]
            )
            total_loss += outcome.mean_loss
            batches += 1
            bar.update(batches, f"loss {total_loss / batches:.4f}")
        seconds = time.perf_counter() - start
        mean_loss = comm.all_reduce_average(torch.tensor([total_loss / batches])).wait()
        accuracy = _evaluate(model, test_set, comm)
        bar.close(f"loss {float(mean_loss):.4f} test acc {accuracy:.4f}")
        results.append(
            EpochResult(
                optimizer=optimizer_name,
                epoch=epoch,
                train_loss=float(mean_loss),
                test_accuracy=accuracy,
                seconds=seconds,
                iteration_ms=1000 * seconds / batches,
            )
        )
    return results


def run(args: argparse.Namespace) -> int:
    """Run the demo on this process's rank; returns the process exit code."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # Every rank loads (and fails on a missing path) before joining the group.
    check_out_dir(args.out_dir)
    train_set = load_fashion_mnist(args.data, train=True, limit=args.train_limit)
    test_set = load_fashion_mnist(args.data, train=False)
    comm = init_distributed()
    try:
        heading = (
            f"Fashion-MNIST from {args.data}: {len(train_set)} train / {len(test_set)} "
            f"test images; model {args.model}; {comm.world_size} worker(s) x batch "
            f"{args.batch_size}; {args.epochs} epoch(s) per optimizer"
        )
        if comm.rank == 0:
            print(heading, flush=True)
        results: list[EpochResult] = []
        for name in ("sgd", args.strategy):
            results.extend(_train(name, args, train_set, test_set, comm))
        if comm.rank == 0:
            print(format_table(results))
            written = write_demo_outputs(args.out_dir, results, heading)
            print(f"wrote {', '.join(str(path) for path in written)}")
    finally:
        destroy_distributed()
    return 0
