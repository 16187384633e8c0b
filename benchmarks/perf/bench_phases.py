"""Time the phases of one single-process K-FAC step on a built-in model (default ResNet-32).

Prints a markdown report: forward+backward, factor computation (per layer and total, with
achieved GFLOP/s against ``torch.mm`` of the same shapes), inversion and preconditioning.

    python benchmarks/perf/bench_phases.py --model resnet32 --batch-size 32 --threads 1
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac.layers import lookup, precondition
from spdkfac.layers.conv2d import conv2d_geometry, conv2d_patches
from spdkfac.linalg import damped_inverse
from spdkfac.models import build_model


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def capture_layer_io(
    model: nn.Module, inputs: Tensor, targets: Tensor
) -> dict[str, tuple[Tensor, Tensor]]:
    """(layer input, output gradient) of every supported layer for one batch (also used by
    ``bench_factors.py``)."""
    captured: dict[str, list[Tensor]] = {}
    handles = []
    for name, module in model.named_modules():
        if lookup(module) is None:
            continue

        def pre(mod: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
            captured[name] = [args[0].detach()]

        def post(mod: nn.Module, args: tuple[Any, ...], out: Tensor, name: str = name) -> None:
            out.register_hook(lambda g, name=name: captured[name].append(g.detach()))

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    model.zero_grad()
    F.cross_entropy(model(inputs), targets).backward()
    for handle in handles:
        handle.remove()
    return {name: (pair[0], pair[1]) for name, pair in captured.items()}


def _factor_rows(module: nn.Module, inputs: Tensor) -> Tensor:
    """The [N, d] matrix whose XᵀX the A factor is (bias column excluded)."""
    if isinstance(module, nn.Conv2d):
        padded, geometry = conv2d_geometry(module, inputs, bias=False)
        return conv2d_patches(padded, geometry)
    return inputs.reshape(-1, inputs.shape[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet32")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--input-size", type=int, default=32)
    parser.add_argument("--in-channels", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--damping", type=float, default=0.003)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(
        args.model, num_classes=10, in_channels=args.in_channels, input_size=args.input_size
    )
    inputs = torch.randn(args.batch_size, args.in_channels, args.input_size, args.input_size)
    targets = torch.randint(0, 10, (args.batch_size,))

    def forward_backward() -> None:
        model.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()

    fwd_bwd = _median_seconds(forward_backward, args.repeats)
    captured = capture_layer_io(model, inputs, targets)
    modules = dict(model.named_modules())

    rows = []
    factors: dict[str, tuple[Tensor, Tensor]] = {}
    total_factor = total_mm = total_flops = 0.0
    for name, (layer_in, grad_out) in captured.items():
        module = modules[name]
        adapter = lookup(module)
        assert adapter is not None
        a_time = _median_seconds(lambda: adapter.a_factor(module, layer_in), args.repeats)
        g_time = _median_seconds(lambda: adapter.g_factor(module, grad_out), args.repeats)
        factors[name] = (
            adapter.a_factor(module, layer_in)[0],
            adapter.g_factor(module, grad_out)[0],
        )
        x = _factor_rows(module, layer_in).contiguous()
        g = grad_out.movedim(1, -1).reshape(-1, grad_out.shape[1]).contiguous()
        mm_time = _median_seconds(lambda: (x.T @ x, g.T @ g), args.repeats)
        flops = 2.0 * x.shape[0] * x.shape[1] ** 2 + 2.0 * g.shape[0] * g.shape[1] ** 2
        total_factor += a_time + g_time
        total_mm += mm_time
        total_flops += flops
        rows.append(
            (
                name,
                adapter.a_dim(module),
                adapter.g_dim(module),
                x.shape[0],
                a_time,
                g_time,
                mm_time,
                flops,
            )
        )

    def invert_all() -> None:
        for a_factor, g_factor in factors.values():
            damped_inverse(a_factor, args.damping)
            damped_inverse(g_factor, args.damping)

    inverse_time = _median_seconds(invert_all, args.repeats)
    inverses = {
        n: (damped_inverse(a, args.damping), damped_inverse(g, args.damping))
        for n, (a, g) in factors.items()
    }
    forward_backward()
    grads = {n: lookup(modules[n]).gradient(modules[n]) for n in factors}  # type: ignore[union-attr]

    def precondition_all() -> None:
        for n, (a_inv, g_inv) in inverses.items():
            precondition(grads[n], a_inv, g_inv)

    precondition_time = _median_seconds(precondition_all, args.repeats)

    print(
        f"# K-FAC phase timings: {args.model}, batch {args.batch_size}, {args.threads} thread(s)\n"
    )
    print(f"command: `python {' '.join(sys.argv)}`  ")
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"median of {args.repeats}\n"
    )
    print("| phase | ms | share of K-FAC step |")
    print("|---|---|---|")
    step_total = fwd_bwd + total_factor + inverse_time + precondition_time
    for label, seconds in (
        ("forward+backward", fwd_bwd),
        ("factor computation (A+G)", total_factor),
        ("inversion (all A, G)", inverse_time),
        ("preconditioning", precondition_time),
        ("total", step_total),
    ):
        print(f"| {label} | {1000 * seconds:.2f} | {100 * seconds / step_total:.1f}% |")
    print(
        f"\nfactor step: {total_flops / 1e9:.3f} GFLOP (XᵀX and gᵀg products) -> "
        f"{total_flops / total_factor / 1e9:.1f} GFLOP/s achieved; "
        f"torch.mm of the same shapes alone: {1000 * total_mm:.2f} ms = "
        f"{total_flops / total_mm / 1e9:.1f} GFLOP/s\n"
    )
    print("| layer | dim A | dim G | rows | A ms | G ms | mm ms | GFLOP/s (A+G) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, a_dim, g_dim, n_rows, a_time, g_time, mm_time, flops in rows:
        print(
            f"| {name} | {a_dim} | {g_dim} | {n_rows} | {1000 * a_time:.2f} | "
            f"{1000 * g_time:.2f} | {1000 * mm_time:.2f} | {flops / (a_time + g_time) / 1e9:.1f} |"
        )


if __name__ == "__main__":
    main()
