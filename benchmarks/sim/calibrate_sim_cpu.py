"""Measure the ``cpu`` simulator preset: op roofline, bookkeeping primitives, host overheads.

Times every ATen op of small synthetic conv/linear networks (not the validation models:
widths 16-256 at 4x4-32x32, batch 32) and fits the roofline of
:class:`spdkfac.sim.DeviceModel`; times each elementwise bookkeeping primitive of
``spdkfac.sim.costs`` (scale, pack, unpack, finiteness checks, running average, SGD, the
preconditioning GEMMs) over factor sizes 8-1536; then times the preconditioner's Python
overheads on a stack of tiny Linear layers, where the products themselves cost nothing.
With ``--concurrent 2`` a second process runs the same measurements at the same time, as
the second rank of a 2-rank job does: both ranks then share the two cores' caches and
memory bandwidth, and so should the constants of a 2-rank simulation.

    python benchmarks/sim/calibrate_sim_cpu.py --concurrent 2 \\
        --out benchmarks/reports/sim_cpu_preset.md
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
import warnings
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spdkfac.calibrate.factors import measure_factors
from spdkfac.costmodel import nonnegative_relative_fit
from spdkfac.linalg import is_finite, pack_triu, unpack_triu
from spdkfac.preconditioner import KFACPreconditioner
from spdkfac.sim import Hardware, cpu_preset, trace_workload
from spdkfac.sim.calibration import fit_device_model
from spdkfac.sim.costs import WorkloadCosts
from spdkfac.sim.workload import Op

# (channels, spatial size): from narrow-and-large to wide-and-small feature maps.
SHAPES = ((16, 32), (32, 32), (48, 16), (64, 16), (96, 16), (128, 8), (192, 8), (256, 4), (256, 8))
TINY_LAYERS = 24
PRIMITIVE_DIMS = (8, 32, 96, 192, 384, 768, 1536)
SGD_TENSORS = 8


def probe_net(channels: int) -> nn.Module:
    """A small conv net whose ops span the roofline (also ``gpu_check_measure``'s)."""
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
        nn.ReLU(inplace=True),
        nn.Conv2d(channels, 2 * channels, 1, stride=2, bias=False),
        nn.BatchNorm2d(2 * channels),
        nn.ReLU(inplace=True),
        nn.Conv2d(2 * channels, 2 * channels, 3, padding=1, bias=False),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * channels, 10),
    )


def _ops(repeats: int) -> list[Op]:
    ops: list[Op] = []
    for channels, size in SHAPES:
        torch.manual_seed(0)
        workload = trace_workload(
            probe_net(channels),
            (channels, size, size),
            batch_size=32,
            device="cpu",
            repeats=repeats,
        )
        ops += workload.ops()
    return ops


def _scales(scale: Any) -> str:
    return "{" + ", ".join(f'"{k}": {v:.3g}' for k, v in sorted(scale.items())) + "}"


def _median(fn: Any, count: int) -> float:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _primitive_calls(dim: int) -> dict[str, tuple[int, Any]]:
    """Each bookkeeping primitive of spdkfac.sim.costs on a dim x dim factor."""
    full = torch.rand(dim, dim) + 1.0
    other = torch.rand(dim, dim)
    packed = pack_triu(full)
    target = torch.empty_like(packed)
    params = [torch.nn.Parameter(torch.rand(dim * dim)) for _ in range(SGD_TENSORS)]
    for param in params:
        param.grad = torch.rand(dim * dim)
    sgd = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    sgd.step()
    small = min(dim, 768)
    square = torch.rand(small, small)
    return {
        "matmul": (4 * small**3, lambda: square @ square @ square),
        "scale": (dim * dim, lambda: full.div(32.0)),
        "copy": (packed.numel(), lambda: target.copy_(packed)),
        "pack": (packed.numel(), lambda: pack_triu(full)),
        "unpack": (dim * dim, lambda: unpack_triu(packed, dim)),
        "finite_all": (dim * dim, lambda: bool(torch.isfinite(full).all())),
        "finite_sum": (dim * dim, lambda: is_finite(full)),
        "average": (dim * dim, lambda: full.mul_(0.95).add_(other, alpha=0.05)),
        "dot": (dim * dim, lambda: float((full * other).sum())),
        "sgd": (dim * dim, sgd.step),
    }


def _primitives(count: int) -> dict[str, list[tuple[int, float]]]:
    samples: dict[str, list[tuple[int, float]]] = {}
    for dim in PRIMITIVE_DIMS:
        for name, (elements, call) in _primitive_calls(dim).items():
            seconds = _median(call, count)
            if name == "sgd":
                seconds /= SGD_TENSORS
            samples.setdefault(name, []).append((elements, seconds))
    return samples


def _overheads(count: int) -> dict[str, float]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(TINY_LAYERS):
        layers += [nn.Linear(8, 8), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(8, 4))
    inputs, targets = torch.randn(4, 8), torch.randint(0, 4, (4,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def passes() -> None:
        F.cross_entropy(model(inputs), targets).backward()

    plain = _median(passes, count)
    products = sum(s.seconds for s in measure_factors(model, inputs, targets, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        precond = KFACPreconditioner(
            model, factor_update_steps=10**6, inv_update_steps=10**6, profile=True
        )
    passes()
    precond.step()  # step 0 captures and inverts; later steps only precondition
    precond.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        capturing = KFACPreconditioner(model, profile=True)
    with_hooks = _median(passes, count)
    capturing.remove()

    def optimizer_step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    passes()
    return {
        "hooks_seconds": with_hooks - plain - products,
        "hooks": float(2 * (TINY_LAYERS + 1)),
        "step_seconds": _median(precond.step, count),
        "optimizer_seconds": _median(optimizer_step, count),
    }


Measured = tuple[list[Op], dict[str, list[tuple[int, float]]], dict[str, float]]


def _worker(arguments: tuple[int, int]) -> Measured:
    repeats, count = arguments
    torch.set_num_threads(1)
    return _ops(repeats), _primitives(count), _overheads(count)


def _tiny_model_costs(hardware: Hardware) -> tuple[float, float]:
    """Modelled per-layer step work and optimizer work of the tiny Linear(8, 8) stack."""
    workload = trace_workload(
        lambda: nn.Sequential(*[nn.Linear(8, 8) for _ in range(TINY_LAYERS)], nn.Linear(8, 4)),
        (8,),
        batch_size=4,
    )
    costs = WorkloadCosts(workload, hardware, 1)
    step = costs.step_prologue(False) + costs.kl_clip()
    step += sum(costs.precondition(layer) for layer in workload.layers)
    return step / len(workload.layers), costs.optimizer()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrent", type=int, default=2, help="processes measuring at once")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per network")
    parser.add_argument("--count", type=int, default=30, help="repeats of small timings")
    parser.add_argument("--out", default=None, help="markdown report to write")
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    with context.Pool(args.concurrent) as pool:
        results = pool.map(_worker, [(args.repeats, args.count)] * args.concurrent)
    ops, samples, overheads = results[0]
    device, errors = fit_device_model(ops)
    bookkeeping = {}
    for name, pairs in samples.items():
        overhead, per_element = nonnegative_relative_fit(
            [[1.0] * len(pairs), [float(n) for n, _ in pairs]], [t for _, t in pairs]
        )
        bookkeeping[name] = (overhead, per_element)
    base = replace(cpu_preset(), device=device, bookkeeping=bookkeeping)
    base = replace(base, hook_overhead_seconds=0.0, layer_step_overhead_seconds=0.0)
    base = replace(base, iteration_overhead_seconds=0.0)
    per_layer, optimizer = _tiny_model_costs(base)
    tiny_layers = TINY_LAYERS + 1
    # What the model already counts is subtracted; the host overheads are the rest.
    scale = base.bookkeeping["scale"][0] + base.bookkeeping["scale"][1] * 81
    hook = overheads["hooks_seconds"] / overheads["hooks"] - scale
    step = overheads["step_seconds"] / tiny_layers - per_layer
    iteration = overheads["optimizer_seconds"] - optimizer
    primitives = ", ".join(
        f'"{name}": ({overhead:.3g}, {per_element:.3g})'
        for name, (overhead, per_element) in sorted(bookkeeping.items())
    )
    lines = [
        "# `cpu` simulator preset: measured constants",
        "",
        f"command: `python {' '.join(sys.argv)}`  ",
        f"torch {torch.__version__}, {args.concurrent} process(es) measuring at once, "
        "1 thread each; numbers from process 0",
        "",
        "| constant | value | how |",
        "|---|---|---|",
        f"| CPU_GEMM_FLOPS | {device.gemm_flops_per_second:.4g} | peak of the GEMM curve, "
        f"{len([o for o in ops if o.flops > 0])} timed conv/linear ops (median error "
        f"{100 * errors['gemm']:.1f} %) |",
        f"| CPU_GEMM_HALF_SIDE | {device.gemm_half_side:g} | smallest side at half rate |",
        f"| CPU_MEMORY_BYTES | {device.memory_bytes_per_second:.4g} | "
        f"{len([o for o in ops if o.flops == 0])} timed memory-bound ops (median error "
        f"{100 * errors['memory']:.1f} %) |",
        f"| CPU_OP_OVERHEAD | {device.op_overhead_seconds:.4g} | intercept of the same fit |",
        f"| CPU_OP_SCALE | {_scales(device.op_scale)} | median measured/roofline per op kind |",
        f"| CPU_BOOKKEEPING | {{{primitives}}} | (s per call, s per element) of each "
        f"primitive, dims {PRIMITIVE_DIMS} |",
        f"| CPU_HOOK_OVERHEAD | {max(hook, 0.0):.4g} | K-FAC hooks (profiled) on "
        f"{tiny_layers} Linear(8, 8), minus products and modelled scaling, per hook |",
        f"| CPU_LAYER_STEP_OVERHEAD | {max(step, 0.0):.4g} | `step()` without refresh per "
        "layer, minus the modelled checks, GEMMs and KL clip |",
        f"| CPU_ITERATION_OVERHEAD | {max(iteration, 0.0):.4g} | optimizer step + zero_grad "
        "of the tiny model minus the modelled SGD |",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
