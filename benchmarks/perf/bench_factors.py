"""Time K-FAC factor computation (A and G, every layer): the fast methods against the reference.

Two layer sets: the project's ResNet-32 at batch 32 (activations and output gradients
captured from one real forward/backward pass) and the 53 convolutions + fc of a
torchvision-style ResNet-50 at 224x224, batch 8 (synthetic post-ReLU activations and
random output gradients; the 23 distinct conv shapes are timed once each and weighted by
how many layers have them). In one run, alternating per layer so that drift and cache
state hit every variant alike: the reference (``F.unfold`` + ``aᵀa``), the default fast
path (method chosen per layer by the cost model), bf16 and fp16 compute, and ``torch.mm``
alone on the reference's matrices; medians, achieved GFLOP/s counted as the reference's
2·N·D², and errors of the factors and of their damped inverses against float64.

    python benchmarks/perf/bench_factors.py --threads 1 --out benchmarks/reports/factors_cpu.md
    python benchmarks/perf/bench_factors.py --device cuda --out benchmarks/reports/factors_cuda.md
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from bench_phases import capture_layer_io  # benchmarks/ is the script's directory
from spdkfac.layers import Conv2dLayer, FactorOptions, KFACLayer, LinearLayer, lookup
from spdkfac.layers.conv2d import conv2d_geometry, conv2d_patches
from spdkfac.layers.methods import select_conv2d_a_method
from spdkfac.models import build_model

# torchvision ResNet-50 (v1.5: stride on the 3x3) convolutions at 224x224:
# (in, out, kernel, stride, padding, input H=W, how many layers have this shape).
RESNET50_CONVS = [
    (3, 64, 7, 2, 3, 224, 1),
    (64, 64, 1, 1, 0, 56, 1),
    (64, 64, 3, 1, 1, 56, 3),
    (64, 256, 1, 1, 0, 56, 4),
    (256, 64, 1, 1, 0, 56, 2),
    (256, 128, 1, 1, 0, 56, 1),
    (128, 128, 3, 2, 1, 56, 1),
    (128, 512, 1, 1, 0, 28, 4),
    (256, 512, 1, 2, 0, 56, 1),
    (512, 128, 1, 1, 0, 28, 3),
    (128, 128, 3, 1, 1, 28, 3),
    (512, 256, 1, 1, 0, 28, 1),
    (256, 256, 3, 2, 1, 28, 1),
    (256, 1024, 1, 1, 0, 14, 6),
    (512, 1024, 1, 2, 0, 28, 1),
    (1024, 256, 1, 1, 0, 14, 5),
    (256, 256, 3, 1, 1, 14, 5),
    (1024, 512, 1, 1, 0, 14, 1),
    (512, 512, 3, 2, 1, 14, 1),
    (512, 2048, 1, 1, 0, 7, 3),
    (1024, 2048, 1, 2, 0, 14, 1),
    (2048, 512, 1, 1, 0, 7, 2),
    (512, 512, 3, 1, 1, 7, 2),
]


@dataclass
class Layer:
    """One timed layer: module, captured tensors, how many layers of the model it stands for."""

    name: str
    module: nn.Module
    inputs: Tensor
    grad_output: Tensor
    count: int = 1


@dataclass
class Row:
    """Timings (ms), nominal FLOPs and accuracy of one layer."""

    layer: Layer
    method: str
    method_bf16: str
    ms: dict[str, float]  # reference, new, bf16, fp16, mm
    flops: float
    errors: dict[str, float]  # e.g. "A bf16", "G fp32", "inv A bf16": relative to float64


VARIANTS: dict[str, FactorOptions] = {
    "reference": FactorOptions(method="reference"),
    "new": FactorOptions(),
    "bf16": FactorOptions(compute_dtype=torch.bfloat16),
    "fp16": FactorOptions(compute_dtype=torch.float16),
}
DAMPING = 0.003  # γ for the error of (F + γI)⁻¹ (the library default when it was measured)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _alternating(fns: list[Callable[[], Any]], repeats: int, device: torch.device) -> list[float]:
    """Median seconds of each function, run in turn ``repeats`` times (after a warm-up)."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for index, fn in enumerate(fns):
            times[index].append(_seconds(fn, device))
    return [statistics.median(t) for t in times]


def _resnet32_layers(batch: int, device: torch.device) -> Iterator[Layer]:
    model = build_model("resnet32", in_channels=3, input_size=32).to(device)
    inputs = torch.randn(batch, 3, 32, 32, device=device)
    targets = torch.randint(0, 10, (batch,), device=device)
    captured = capture_layer_io(model, inputs, targets)
    modules = dict(model.named_modules())
    for name, (layer_in, grad_out) in captured.items():
        yield Layer(name, modules[name], layer_in, grad_out)


def _resnet50_layers(batch: int, device: torch.device) -> Iterator[Layer]:
    generator = torch.Generator(device="cpu").manual_seed(0)
    for index, (cin, cout, kernel, stride, padding, size, count) in enumerate(RESNET50_CONVS):
        conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        x = torch.randn(batch, cin, size, size, generator=generator)
        x = x if index == 0 else x.relu()  # the stem sees images, the others post-ReLU maps
        out = (size + 2 * padding - kernel) // stride + 1
        grad = torch.randn(batch, cout, out, out, generator=generator) / (batch * out * out)
        name = f"conv{kernel}x{kernel}/s{stride} {cin}->{cout} @{size}"
        yield Layer(name, conv.to(device), x.to(device), grad.to(device), count)
    fc = nn.Linear(2048, 1000).to(device)
    x = torch.randn(batch, 2048, generator=generator).relu().to(device)
    grad = (torch.randn(batch, 1000, generator=generator) / batch).to(device)
    yield Layer("fc 2048->1000", fc, x, grad, 1)


def _adapter(module: nn.Module, options: FactorOptions) -> KFACLayer:
    base = lookup(module)
    assert isinstance(base, (Conv2dLayer, LinearLayer))
    return base.with_options(options)


def _matrices(module: nn.Module, layer: Layer) -> tuple[Tensor, Tensor]:
    """The contiguous [N, D] patch and [N, O] gradient matrices the reference multiplies."""
    if isinstance(module, nn.Conv2d):
        x, geometry = conv2d_geometry(module, layer.inputs, bias=False)
        rows = conv2d_patches(x, geometry)
        grads = layer.grad_output.movedim(1, -1).reshape(-1, layer.grad_output.shape[1])
    else:
        rows = layer.inputs.reshape(-1, layer.inputs.shape[-1])
        grads = layer.grad_output.reshape(-1, layer.grad_output.shape[-1])
    return rows.contiguous(), grads.contiguous()


def _relative_error(value: Tensor, exact: Tensor) -> float:
    return float((value.double() - exact).norm() / exact.norm().clamp_min(1e-300))


def _damped_inverse(factor: Tensor) -> Tensor:
    eye = torch.eye(factor.shape[0], dtype=torch.float64, device=factor.device)
    return torch.linalg.inv(factor.double() + DAMPING * eye)


def _definite(factor: Tensor) -> bool:
    """Whether ``F + γI`` is positive definite (Cholesky succeeds), as the inverse needs."""
    eye = torch.eye(factor.shape[0], dtype=torch.float64, device=factor.device)
    return int(torch.linalg.cholesky_ex(factor.double() + DAMPING * eye).info) == 0


def _method(module: nn.Module, layer: Layer, options: FactorOptions) -> str:
    if not isinstance(module, nn.Conv2d):
        return "gram"
    _, geometry = conv2d_geometry(
        module, layer.inputs, bias=module.bias is not None, compute_dtype=options.compute_dtype
    )
    return select_conv2d_a_method(geometry, policy=options.selection)


def _measure(layer: Layer, repeats: int, device: torch.device, accuracy: bool) -> Row:
    module = layer.module
    adapters = {name: _adapter(module, options) for name, options in VARIANTS.items()}
    rows, grads = _matrices(module, layer)

    def both(adapter: KFACLayer) -> Callable[[], Any]:
        return lambda: (
            adapter.a_factor(module, layer.inputs),
            adapter.g_factor(module, layer.grad_output),
        )

    timed = [both(adapter) for adapter in adapters.values()]
    seconds = _alternating([*timed, lambda: (rows.T @ rows, grads.T @ grads)], repeats, device)
    ms = {name: 1e3 * s for name, s in zip([*adapters, "mm"], seconds, strict=True)}
    reference = adapters["reference"]
    count = _rows(module, layer)
    flops = 2.0 * count * (reference.a_dim(module) ** 2 + reference.g_dim(module) ** 2)
    errors: dict[str, float] = {}
    if accuracy:
        # The adapters read only the geometry from the module, so float64 inputs suffice.
        exact = {
            "A": reference.a_factor(module, layer.inputs.double())[0],
            "G": reference.g_factor(module, layer.grad_output.double())[0],
        }
        inverses = {key: _damped_inverse(value) for key, value in exact.items()}
        for name in ("reference", "new", "bf16", "fp16"):
            adapter, label = adapters[name], {"reference": "ref32", "new": "fp32"}.get(name, name)
            values = {
                "A": adapter.a_factor(module, layer.inputs)[0],
                "G": adapter.g_factor(module, layer.grad_output)[0],
            }
            for key, value in values.items():
                errors[f"{key} {label}"] = _relative_error(value, exact[key])
                errors[f"inv {key} {label}"] = _relative_error(
                    _damped_inverse(value), inverses[key]
                )
                errors[f"indefinite {key} {label}"] = float(not _definite(value))
    return Row(
        layer,
        _method(module, layer, VARIANTS["new"]),
        _method(module, layer, VARIANTS["bf16"]),
        ms,
        flops,
        errors,
    )


def _rows(module: nn.Module, layer: Layer) -> int:
    """N: patch rows of a Conv2d (B·S, also the G rows) or folded rows of a Linear."""
    if isinstance(module, nn.Conv2d):
        return int(layer.grad_output[:, 0].numel())
    return int(layer.inputs.numel() // layer.inputs.shape[-1])


def _report(title: str, rows: list[Row], out: io.StringIO) -> None:
    totals = {
        name: sum(r.ms[name] * r.layer.count for r in rows)
        for name in ("reference", "new", "bf16", "fp16", "mm")
    }
    flops = sum(r.flops * r.layer.count for r in rows)
    layers = sum(r.layer.count for r in rows)
    print(f"\n### {title} ({layers} layers)\n", file=out)
    print("| A+G of every layer | ms | vs reference | GFLOP/s (nominal 2·N·D²) |", file=out)
    print("|---|---|---|---|", file=out)
    for name, label in (
        ("reference", "reference: `F.unfold` + `aᵀa` (+ `gᵀg`)"),
        ("new", "**new, fp32** (method chosen per layer)"),
        ("bf16", "new, `compute_dtype=torch.bfloat16`"),
        ("fp16", "new, `compute_dtype=torch.float16`"),
        ("mm", "`torch.mm` alone on the reference's contiguous [N,D] matrices"),
    ):
        total = totals[name]
        print(
            f"| {label} | {total:.1f} | {totals['reference'] / total:.2f}x | "
            f"{flops / total / 1e6:.1f} |",
            file=out,
        )
    if rows[0].errors:
        print("\nRelative Frobenius error against float64 (median / max over layers):\n", file=out)
        print("| quantity | fp32, reference | fp32, new | bf16, new | fp16, new |", file=out)
        print("|---|---|---|---|---|", file=out)
        for quantity in ("A", "G", "inv A", "inv G"):
            cells = []
            for label in ("ref32", "fp32", "bf16", "fp16"):
                values = [r.errors[f"{quantity} {label}"] for r in rows]
                cells.append(f"{statistics.median(values):.1e} / {max(values):.1e}")
            name = (
                quantity if not quantity.startswith("inv") else f"({quantity[4:]} + {DAMPING}·I)⁻¹"
            )
            print(f"| {name} | {' | '.join(cells)} |", file=out)
        for quantity in ("A", "G"):
            counts = [
                sum(int(r.errors[f"indefinite {quantity} {label}"]) for r in rows)
                for label in ("ref32", "fp32", "bf16", "fp16")
            ]
            print(
                f"| layers with {quantity} + {DAMPING}·I not positive definite | "
                f"{' | '.join(str(c) for c in counts)} |",
                file=out,
            )
    print(
        "\n| layer | × | method (fp32 / bf16) | dim A | dim G | ref ms | new ms | speed-up | "
        "bf16 ms | mm ms | GFLOP/s new | GFLOP/s mm |",
        file=out,
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        module = r.layer.module
        adapter = lookup(module)
        assert adapter is not None
        print(
            f"| {r.layer.name} | {r.layer.count} | {r.method} / {r.method_bf16} | "
            f"{adapter.a_dim(module)} | {adapter.g_dim(module)} | {r.ms['reference']:.2f} | "
            f"{r.ms['new']:.2f} | {r.ms['reference'] / r.ms['new']:.1f}x | {r.ms['bf16']:.2f} | "
            f"{r.ms['mm']:.2f} | {r.flops / r.ms['new'] / 1e6:.0f} | "
            f"{r.flops / r.ms['mm'] / 1e6:.0f} |",
            file=out,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default="resnet32,resnet50")
    parser.add_argument("--out", default=None, help="also write the report to this file")
    parser.add_argument("--no-accuracy", action="store_true", help="skip the float64 errors")
    parser.add_argument("--append", action="store_true", help="append to --out, not replace")
    parser.add_argument("--heading", default="K-FAC factor computation: fast methods vs unfold")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    out = io.StringIO()
    print(f"{'##' if args.append else '#'} {args.heading}\n", file=out)
    tunables = os.environ.get("GLIBC_TUNABLES")
    prefix = f"GLIBC_TUNABLES={tunables} " if tunables else ""
    print(f"command: `{prefix}python {shlex.join(sys.argv)}`  ", file=out)
    print(
        f"torch {torch.__version__}, {platform.machine()}, device {device}, "
        f"{args.threads} thread(s), median of {args.repeats} alternating repeats\n",
        file=out,
    )
    sets = {
        "resnet32": ("ResNet-32, batch 32", lambda: _resnet32_layers(32, device)),
        "resnet50": (
            "ResNet-50 layer shapes, 224x224, batch 8",
            lambda: _resnet50_layers(8, device),
        ),
    }
    for key in args.models.split(","):
        title, layers = sets[key]
        rows = [_measure(layer, args.repeats, device, not args.no_accuracy) for layer in layers()]
        _report(title, rows, out)
    text = out.getvalue()
    print(text)
    if args.out:
        with open(args.out, "a" if args.append else "w", encoding="utf-8") as handle:
            handle.write(("\n" if args.append else "") + text)


if __name__ == "__main__":
    main()
