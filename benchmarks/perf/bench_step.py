"""Time the K-FAC step of one process end to end, and the pieces of it that packed running
factors and batched inversions change, on a built-in model (default ResNet-32).

Sections (any combination):

* ``--steps N``: whole training steps side by side: plain SGD, K-FAC refreshing factors
  and inverses every step (1/1) and every 10/100 steps, each on its own copy of the model
  with the same batch, interleaved in rounds so a shared machine's load drifts over all
  alike. The mean over N steps includes the amortized refresh steps (the median would
  hide them); ``--uniform-steps`` shortens the variants whose steps are all alike.
* ``--exchange``: the host work of a factor exchange's ``wait()`` over the model's factors.
* ``--packing``: what keeping a group of one's running factors packed would cost and save.
* ``--inversion``: inverting every factor one call each against batched by size, and
  against another checkout's ``damped_inverse`` (``--baseline-linalg``).
* ``--finite``: ``is_finite`` of every factor, and another checkout's (same option).
* ``--profile N``: where N steps of K-FAC 1/1 (or the first ``--kfac``) spend their time.
* ``--kfac LABEL=key:value,...`` (repeatable): K-FAC variants instead of 1/1 and 10/100,
  e.g. ``--kfac 'fe32=factor_update_steps:5,factor_examples:32'``.

Sections other than ``--inversion`` also run against older checkouts (``PYTHONPATH``).

    python benchmarks/perf/bench_step.py --threads 1 --steps 100 --uniform-steps 40
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench_phases import capture_layer_io  # benchmarks/ is the script's directory
from spdkfac import KFACPreconditioner
from spdkfac.comm import LocalCommunicator
from spdkfac.comm.exchange import FactorExchange
from spdkfac.curvature import running_average
from spdkfac.layers import FactorOptions, lookup
from spdkfac.linalg import damped_inverse, is_finite, pack_triu, unpack_triu
from spdkfac.models import build_model
from spdkfac.planning.fusion import FusionPlan

#: Label -> ``KFACPreconditioner`` keyword arguments, unless ``--kfac`` names others.
_KFAC_VARIANTS: dict[str, dict[str, Any]] = {
    "K-FAC 1/1": {"factor_update_steps": 1, "inv_update_steps": 1},
    "K-FAC 10/100": {"factor_update_steps": 10, "inv_update_steps": 100},
}


_FACTOR_OPTIONS = ("examples", "compute_dtype", "method")  # as factor_<name>


def parse_kfac(text: str) -> tuple[str, dict[str, Any]]:
    """``LABEL=key:value,...`` (``KFACPreconditioner`` keywords, and ``factor_<name>`` for
    the ``FactorOptions`` of ``_FACTOR_OPTIONS``) as (label, keyword arguments)."""
    label, _, pairs = text.partition("=")
    kwargs: dict[str, Any] = {}
    for pair in filter(None, pairs.split(",")):
        key, _, value = pair.partition(":")
        try:
            kwargs[key.strip()] = json.loads(value)  # numbers
        except ValueError:
            kwargs[key.strip()] = value
    options = {k: kwargs.pop("factor_" + k) for k in _FACTOR_OPTIONS if "factor_" + k in kwargs}
    if "compute_dtype" in options:
        options["compute_dtype"] = getattr(torch, options["compute_dtype"])
    if options:
        kwargs["factor_options"] = FactorOptions(**options)
    if not label or not kwargs:
        raise argparse.ArgumentTypeError(f"--kfac needs LABEL=key:value,..., got {text!r}")
    return label, kwargs


def _uniform(kwargs: dict[str, Any]) -> bool:  # every step alike (refreshes every step)
    return all(kwargs.get(k, 1) == 1 for k in ("factor_update_steps", "inv_update_steps"))


def compare_steps(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    steps: int,
    round_steps: int,
    uniform_steps: int,
    variants: dict[str, dict[str, Any]],
) -> None:
    """Time training steps of SGD and each K-FAC variant (one copy of the model each, same
    batch), interleaved ``round_steps`` at a time, and print a table: ``steps`` of the
    amortized variants (whole refresh cycles), ``uniform_steps`` of the variants whose every
    step is alike (SGD, 1/1)."""
    runs: list[tuple[str, Callable[[], None]]] = []
    wanted: dict[str, int] = {}
    for label, kwargs in {"SGD": None, **variants}.items():
        replica = copy.deepcopy(model).train()
        optimizer = torch.optim.SGD(replica.parameters(), lr=0.01, momentum=0.9)
        precond = (
            None if kwargs is None else KFACPreconditioner(replica, optimizer=optimizer, **kwargs)
        )
        wanted[label] = uniform_steps if kwargs is None or _uniform(kwargs) else steps

        def train_step(
            replica: nn.Module = replica,
            optimizer: torch.optim.Optimizer = optimizer,
            precond: KFACPreconditioner | None = precond,
        ) -> None:
            optimizer.zero_grad()
            F.cross_entropy(replica(inputs), targets).backward()
            if precond is None or precond.step():
                optimizer.step()

        runs.append((label, train_step))
    for _, train_step in runs:  # warm-up (the first step of K-FAC builds its state)
        for _ in range(3):
            train_step()
    times: dict[str, list[float]] = {label: [] for label, _ in runs}
    index = 0
    while any(len(times[label]) < wanted[label] for label in times):
        shift = index % len(runs)  # rotate the order: no variant always runs first
        index += 1
        for label, train_step in runs[shift:] + runs[:shift]:
            for _ in range(min(round_steps, wanted[label] - len(times[label]))):
                start = time.perf_counter()
                train_step()
                times[label].append(time.perf_counter() - start)
    sgd = statistics.fmean(times["SGD"])
    print(f"\n## Training steps side by side (rounds of {round_steps})\n")
    print("| variant | steps | mean ms | median ms | p90 ms | mean / SGD mean |")
    print("|---|---|---|---|---|---|")
    for label, values in times.items():
        mean = statistics.fmean(values)
        p90 = statistics.quantiles(values, n=10)[-1]
        print(
            f"| {label} | {len(values)} | {1000 * mean:.1f} | "
            f"{1000 * statistics.median(values):.1f} | "
            f"{1000 * p90:.1f} | {mean / sgd:.2f}x |"
        )


def model_factors(model: nn.Module, inputs: Tensor, targets: Tensor) -> dict[str, Tensor]:
    """Every supported layer's A and G factor for one batch, by ``"<layer>/<A|G>"``."""
    modules = dict(model.named_modules())
    factors: dict[str, Tensor] = {}
    for name, (layer_in, grad_out) in capture_layer_io(model, inputs, targets).items():
        adapter = lookup(modules[name])
        assert adapter is not None
        factors[f"{name}/A"] = adapter.a_factor(modules[name], layer_in)[0]
        factors[f"{name}/G"] = adapter.g_factor(modules[name], grad_out)[0]
    return factors


def time_exchange(model: nn.Module, inputs: Tensor, targets: Tensor, repeats: int) -> None:
    """Time the host work of a factor exchange's ``wait()`` over every factor of the model
    (one bucket, a group of one: the reduced sums are ready at once, so this is what every
    rank of an all-reduce strategy does inside the wait after the transfers)."""
    factors = model_factors(model, inputs, targets)
    slots = [(key, factor.shape[0]) for key, factor in factors.items()]
    plan = FusionPlan("bench", (tuple(factors),), eager=False)
    exchange = FactorExchange(LocalCommunicator(), slots, plan)
    times = []
    for _ in range(repeats + 1):
        for key, factor in factors.items():
            exchange.add(key, factor, float(inputs.shape[0]))
        pending = exchange.finish()
        start = time.perf_counter()
        pending.wait()
        times.append(time.perf_counter() - start)
    elements = sum(dim * dim for _, dim in slots)
    print(
        f"\n## Factor exchange: host work in wait() ({len(slots)} factors, "
        f"{elements / 1e6:.2f} M elements as full matrices)\n"
    )
    print(f"median of {repeats}: {1000 * statistics.median(times[1:]):.2f} ms")


def time_packing(model: nn.Module, inputs: Tensor, targets: Tensor, repeats: int) -> None:
    """Time a group of one keeping its running factors full against packing them: the
    running average of every factor, and building every factor's batch for inversion."""
    factors = list(model_factors(model, inputs, targets).values())
    full = [factor.clone() for factor in factors]
    packed = [pack_triu(factor) for factor in factors]
    scratch = [torch.empty_like(factor) for factor in factors]

    def average_full() -> None:
        for current, new in zip(full, factors, strict=True):
            running_average(current, new, 0.95)

    def average_packed() -> None:  # the new statistic arrives full: pack it first
        for current, new in zip(packed, factors, strict=True):
            running_average(current, pack_triu(new), 0.95)

    def build_full() -> None:
        for out, factor in zip(scratch, full, strict=True):
            out.copy_(factor)

    def build_packed() -> None:
        for out, factor in zip(scratch, packed, strict=True):
            unpack_triu(factor, out.shape[0], out=out)

    pieces = {
        "running average, full": average_full,
        "pack + running average, packed": average_packed,
        "inversion input, copy of full": build_full,
        "inversion input, unpacked": build_packed,
    }
    times: dict[str, list[float]] = {label: [] for label in pieces}
    for _ in range(repeats + 1):  # alternated, so drifting load hits all alike
        for label, piece in pieces.items():
            start = time.perf_counter()
            piece()
            times[label].append(time.perf_counter() - start)
    print(f"\n## Running factors of a group of one: full or packed ({len(factors)} factors)\n")
    print("| piece | median ms |")
    print("|---|---|")
    for label, values in times.items():
        print(f"| {label} | {1000 * statistics.median(values[1:]):.2f} |")


def _load_linalg(path: str) -> Any:
    """Another checkout's ``linalg.py`` as a module (it imports nothing of spdkfac)."""
    spec = importlib.util.spec_from_file_location("baseline_linalg", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_finite(
    model: nn.Module, inputs: Tensor, targets: Tensor, repeats: int, baseline: str | None
) -> None:
    """Time ``is_finite`` of every factor (what a factor step checks before its exchange),
    and that of another ``linalg.py`` (``baseline``) when given (alternated)."""
    factors = list(model_factors(model, inputs, targets).values())
    checks = {"is_finite": is_finite}
    if baseline is not None:
        checks[f"is_finite ({baseline})"] = _load_linalg(baseline).is_finite
    times: dict[str, list[float]] = {label: [] for label in checks}
    for _ in range(repeats + 1):
        for label, check in checks.items():
            start = time.perf_counter()
            for factor in factors:
                check(factor)
            times[label].append(time.perf_counter() - start)
    print(f"\n## Finiteness of {len(factors)} factors\n")
    print("| check | median ms |")
    print("|---|---|")
    for label, values in times.items():
        print(f"| {label} | {1000 * statistics.median(values[1:]):.2f} |")


def time_inversion(
    model: nn.Module, inputs: Tensor, targets: Tensor, repeats: int, baseline: str | None
) -> None:
    """Time inverting every factor one call each against batched by size (alternated),
    and against ``damped_inverse`` of another ``linalg.py`` (``baseline``) when given."""
    # Imported here: the other sections also run against checkouts from before batching.
    from spdkfac.forms import DampedInverse

    damped_inverses = DampedInverse("cholesky").compute_all

    by_dim: dict[int, list[Tensor]] = {}
    for factor in model_factors(model, inputs, targets).values():
        by_dim.setdefault(factor.shape[0], []).append(factor)
    stacks = [torch.stack(group) for group in by_dim.values()]

    def one_call_each() -> None:
        for group in by_dim.values():
            for factor in group:
                damped_inverse(factor, 0.003)

    def batched() -> None:
        for stack in stacks:
            damped_inverses(stack, 0.003)

    pieces = {"one call per factor": one_call_each, "batched by size": batched}
    if baseline is not None:
        module = _load_linalg(baseline)

        def baseline_each() -> None:
            for group in by_dim.values():
                for factor in group:
                    module.damped_inverse(factor, 0.003)

        pieces[f"one call per factor ({baseline})"] = baseline_each
    times: dict[str, list[float]] = {label: [] for label in pieces}
    for _ in range(repeats + 1):
        for label, piece in pieces.items():
            start = time.perf_counter()
            piece()
            times[label].append(time.perf_counter() - start)
    count = sum(len(group) for group in by_dim.values())
    print(f"\n## Inverting {count} factors ({len(by_dim)} sizes)\n")
    print("| how | median ms |")
    print("|---|---|")
    for label, values in times.items():
        print(f"| {label} | {1000 * statistics.median(values[1:]):.2f} |")


def profile_step(
    model: nn.Module, inputs: Tensor, targets: Tensor, steps: int, variant: str, kwargs: Any
) -> None:
    """Mean milliseconds per step of each profiled piece of K-FAC (``profile=True``
    spans, per-layer ones summed by phase) over ``steps`` steps after two warm-up steps."""
    replica = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(replica.parameters(), lr=0.01, momentum=0.9)
    precond = KFACPreconditioner(replica, optimizer=optimizer, profile=True, **kwargs)
    start = 0.0
    for step in range(steps + 2):
        if step == 2:
            precond.profiler.clear()
            start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(replica(inputs), targets).backward()
        if precond.step():
            optimizer.step()
    elapsed = (time.perf_counter() - start) / steps
    totals: dict[str, float] = {}
    for event in precond.profiler.events():
        _, phase, piece = event.name.split("/", 2)
        named = piece in ("all", "running_average", "pack", "unpack", "local", "kl_clip")
        label = f"{phase}/{piece if named else '<each>'}"
        totals[label] = totals.get(label, 0.0) + event.duration
    print(f"\n## Profile of {variant} ({steps} steps)\n")
    print(f"iteration: {1000 * elapsed:.1f} ms (forward, backward, step, optimizer)\n")
    print("| span | ms per step |")
    print("|---|---|")
    for label, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        print(f"| {label} | {1000 * seconds / steps:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet32")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--input-size", type=int, default=32)
    parser.add_argument("--in-channels", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10, help="of --exchange etc.")
    parser.add_argument("--steps", type=int, default=0, help="steps of the step comparison")
    parser.add_argument("--round-steps", type=int, default=10)
    parser.add_argument(
        "--uniform-steps", type=int, default=None, help="steps of SGD and 1/1 (default --steps)"
    )
    parser.add_argument("--exchange", action="store_true", help="time the exchange's wait()")
    parser.add_argument("--packing", action="store_true", help="time full vs packed factors")
    parser.add_argument("--inversion", action="store_true", help="time batched inversion")
    parser.add_argument(
        "--baseline-linalg", default=None, help="a linalg.py whose damped_inverse --inversion adds"
    )
    parser.add_argument("--finite", action="store_true", help="time the finiteness checks")
    parser.add_argument(
        "--profile", type=int, default=0, help="steps to profile of the first K-FAC variant"
    )
    parser.add_argument(
        "--kfac",
        type=parse_kfac,
        action="append",
        default=[],
        metavar="LABEL=KEY:VALUE,...",
        help="a K-FAC variant of --steps and --profile (repeatable; replaces 1/1 and 10/100), "
        "e.g. 'reduce 5/10=factor_update_steps:5,inv_update_steps:10,weight_sharing:reduce'",
    )
    args = parser.parse_args()
    variants = dict(args.kfac) or _KFAC_VARIANTS
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_model(
        args.model, num_classes=10, in_channels=args.in_channels, input_size=args.input_size
    )
    inputs = torch.randn(args.batch_size, args.in_channels, args.input_size, args.input_size)
    targets = torch.randint(0, 10, (args.batch_size,))
    print(f"# K-FAC step costs: {args.model}, batch {args.batch_size}, {args.threads} thread(s)\n")
    print(f"command: `python {' '.join(sys.argv)}`  ")
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}")
    if args.exchange:
        time_exchange(model, inputs, targets, args.repeats)
    if args.packing:
        time_packing(model, inputs, targets, args.repeats)
    if args.finite:
        time_finite(model, inputs, targets, args.repeats, args.baseline_linalg)
    if args.inversion:
        time_inversion(model, inputs, targets, args.repeats, args.baseline_linalg)
    if args.profile > 0:
        label, kwargs = next(iter(variants.items()))
        profile_step(model, inputs, targets, args.profile, label, kwargs)
    if args.steps > 0:
        uniform = args.steps if args.uniform_steps is None else args.uniform_steps
        compare_steps(model, inputs, targets, args.steps, args.round_steps, uniform, variants)


if __name__ == "__main__":
    main()
