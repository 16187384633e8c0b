"""K-FAC on the built-in GPT model, single process: factor cost of K-FAC-expand vs
K-FAC-reduce per layer at several sequence lengths, and the cost of a K-FAC step as a
multiple of an AdamW step (factors and inverses every step, and amortized 10/100).

Prints a markdown report (timings: median of repeats for the per-layer kernels; the
*mean* over all steps, refresh steps included, for the step costs).

    python benchmarks/perf/bench_gpt_kfac.py --threads 1 > benchmarks/reports/gpt_kfac_cpu.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac import KFACPreconditioner
from spdkfac.layers import FactorOptions, lookup
from spdkfac.models.gpt import GPT


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _lm_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _capture(model: nn.Module, tokens: Tensor) -> dict[str, tuple[nn.Module, Tensor, Tensor]]:
    """Input and output gradient of every Linear layer for one batch."""
    seen: dict[str, tuple[nn.Module, Tensor, Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):

            def hook(mod: nn.Module, args: tuple[Tensor], out: Tensor, name: str = name) -> None:
                out.register_hook(lambda g: seen.__setitem__(name, (mod, args[0].detach(), g)))

            handles.append(module.register_forward_hook(hook))
    _lm_loss(model(tokens), tokens).backward()
    for handle in handles:
        handle.remove()
    return seen


def factor_costs(lengths: list[int], batch: int, repeats: int, args: argparse.Namespace) -> None:
    print("## Factor cost per layer: K-FAC-expand vs K-FAC-reduce\n")
    print(
        f"GPT {args.layers} layers, d={args.dim}, batch {batch}; A and G of every Linear "
        f"layer of one block and the head, ms (median of {repeats}).\n"
    )
    print("| T | layer | shape | expand ms | reduce ms | expand / reduce |")
    print("|---:|---|---|---:|---:|---:|")
    totals = {}
    for length in lengths:
        torch.manual_seed(0)
        model = GPT(block_size=length, n_layer=args.layers, n_head=args.heads, d_model=args.dim)
        tokens = torch.randint(0, 256, (batch, length))
        captured = _capture(model, tokens)
        sums = {"expand": 0.0, "reduce": 0.0}
        for name, (module, inputs, grad) in captured.items():
            adapter = lookup(module)
            assert adapter is not None
            row = {}
            for sharing in ("expand", "reduce"):
                kind = adapter.with_options(FactorOptions(), weight_sharing=sharing)  # type: ignore[arg-type]
                ms = _median_ms(
                    lambda kind=kind, module=module, inputs=inputs, grad=grad: (
                        kind.a_factor(module, inputs),
                        kind.g_factor(module, grad),
                    ),
                    repeats,
                )
                row[sharing] = ms
                sums[sharing] += ms
            if name.startswith("blocks.0.") or name == "head":
                shape = f"{module.in_features}→{module.out_features}"  # type: ignore[union-attr]
                print(
                    f"| {length} | {name} | {shape} | {row['expand']:.2f} | {row['reduce']:.2f} "
                    f"| {row['expand'] / row['reduce']:.1f}x |"
                )
        totals[length] = sums
    print("\nAll Linear layers of the model:\n")
    print("| T | expand ms | reduce ms | expand / reduce |")
    print("|---:|---:|---:|---:|")
    for length, sums in totals.items():
        ratio = sums["expand"] / sums["reduce"]
        print(f"| {length} | {sums['expand']:.1f} | {sums['reduce']:.1f} | {ratio:.1f}x |")


def step_costs(args: argparse.Namespace) -> None:
    print("\n## A K-FAC step as a multiple of an AdamW step\n")
    print(
        f"GPT {args.layers} layers, d={args.dim}, T={args.length}, batch {args.batch}, "
        f"{args.steps} steps per variant after {args.warmup} warm-up steps; mean ms/step "
        "(forward, backward, K-FAC, optimizer), refresh steps included. Variants run "
        f"interleaved, {args.rounds} rounds; the table gives the median round.\n"
    )
    variants: dict[str, dict[str, object] | None] = {
        "AdamW": None,
        "AdamW + K-FAC 1/1": {"factor_update_steps": 1, "inv_update_steps": 1},
        "AdamW + K-FAC 10/100": {"factor_update_steps": 10, "inv_update_steps": 100},
        "AdamW + K-FAC 10/100 reduce": {
            "factor_update_steps": 10,
            "inv_update_steps": 100,
            "weight_sharing": "reduce",
        },
    }
    tokens = torch.randint(
        0, 256, (args.batch, args.length), generator=torch.Generator().manual_seed(1)
    )
    results: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, options in variants.items():
            torch.manual_seed(0)
            model = GPT(
                block_size=args.length, n_layer=args.layers, n_head=args.heads, d_model=args.dim
            )
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            precond = None
            if options is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    precond = KFACPreconditioner(
                        model,
                        damping=0.01,
                        lr=lambda _s: 1e-3,
                        normalization="unit-wise",
                        **options,  # type: ignore[arg-type]
                    )
            times = []
            for step in range(args.warmup + args.steps):
                start = time.perf_counter()
                optimizer.zero_grad()
                _lm_loss(model(tokens), tokens).backward()
                if precond is None or precond.step():
                    optimizer.step()
                if step >= args.warmup:
                    times.append(time.perf_counter() - start)
            results[name].append(1e3 * statistics.fmean(times))
    base = statistics.median(results["AdamW"])
    print("| variant | mean ms/step (median round) | rounds | x AdamW |")
    print("|---|---:|---|---:|")
    for name, values in results.items():
        value = statistics.median(values)
        listed = ", ".join(f"{v:.1f}" for v in values)
        print(f"| {name} | {value:.1f} | {listed} | {value / base:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--factor-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("# K-FAC on the built-in GPT model (single process, CPU)\n")
    print(f"Command: `python {' '.join(sys.argv)}`\n")
    print(
        f"Machine: {platform.machine()}, {torch.get_num_threads()} thread(s), "
        f"torch {torch.__version__}, Python {platform.python_version()}.\n"
    )
    factor_costs(args.lengths, args.factor_batch, args.repeats, args)
    step_costs(args)


if __name__ == "__main__":
    main()
