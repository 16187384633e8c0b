"""SGD vs D-KFAC vs MPD-KFAC vs SPD-KFAC, side by side, on 2 data-parallel ranks.

Every variant trains its own copy of the model (same initialisation) in the same
processes; variants take turns in short chunks so drift in machine speed hits all of them
alike. Reports median iteration time, spread, ratios, and the inverse phase (inversions
plus broadcasts, wall time on rank 0) per strategy, on loopback and, as root, in an
emulated cluster (one network namespace per rank, ``tc tbf`` at 1 Gbit/s).

    python benchmarks/perf/bench_strategies.py --links loopback,1gbit \\
        --out benchmarks/reports/strategies_resnet32.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from spdkfac.bench.launch import free_port
from spdkfac.bench.netns import available, emulated_cluster

STRATEGIES = ("d-kfac", "mpd-kfac", "spd-kfac")


# --------------------------------------------------------------------------- worker side
def _calibrate_broadcast(comm: Any) -> tuple[float, float]:
    """α (s) and β (s/byte) of a broadcast on this link, from 4 KB and 4 MB messages."""
    times = {}
    for elements in (1024, 1024 * 1024):
        samples = []
        for _ in range(7):
            buffer = torch.zeros(elements)
            start = time.perf_counter()
            comm.broadcast(buffer, src=0).wait()
            samples.append(time.perf_counter() - start)
        times[elements * 4] = statistics.median(samples[2:])
    (small, t_small), (large, t_large) = sorted(times.items())
    beta = max((t_large - t_small) / (large - small), 0.0)
    return max(t_small - beta * small, 0.0), beta


def _model_factor_dims(model: torch.nn.Module) -> list[int]:
    from spdkfac.curvature import discover_layers

    layers = discover_layers(model, ())
    return sorted({d for state in layers.values() for d in (state.a_dim, state.g_dim)})


def _worker(args: argparse.Namespace) -> None:
    from spdkfac import KFACPreconditioner
    from spdkfac.calibrate import measure_inverses
    from spdkfac.comm import destroy_distributed, init_distributed
    from spdkfac.costmodel import AlphaBetaModel, CostModel, PolynomialInverseModel
    from spdkfac.models import build_model

    torch.set_num_threads(1)
    comm = init_distributed("gloo")
    alpha, beta = _calibrate_broadcast(comm)
    # Inverse costs fitted on this model's own factor sizes, measured on both ranks at once
    # as in training (rank 0's model is the one every rank plans with).
    dims = _model_factor_dims(build_model(args.model, num_classes=10, in_channels=3, input_size=32))
    inverse = PolynomialInverseModel.fit(measure_inverses(dims, repeats=5, damping=3e-3))
    cost_model = CostModel(
        inverse=inverse,
        broadcast=AlphaBetaModel(alpha, beta),
        allreduce=AlphaBetaModel(alpha, beta),
    )
    intervals = [tuple(int(x) for x in item.split("/")) for item in args.intervals.split(",")]
    variants: list[dict[str, Any]] = []
    for name, interval in [("sgd", (1, 1))] + [(s, i) for i in intervals for s in STRATEGIES]:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            build_model(args.model, num_classes=10, in_channels=3, input_size=32)
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        precond = None
        inverse_seconds: list[float] = []
        if name != "sgd":
            precond = KFACPreconditioner(
                model,
                strategy=name,
                factor_update_steps=interval[0],
                inv_update_steps=interval[1],
                lr=0.01,
                cost_model=cost_model,
            )
            phase = precond._stages.inverses  # a named strategy keeps its stages
            original = phase.run

            def timed(
                blocks: Any, damping: float, original: Any = original, log: Any = inverse_seconds
            ) -> None:
                start = time.perf_counter()
                original(blocks, damping)
                log.append(time.perf_counter() - start)

            phase.run = timed  # type: ignore[method-assign]
        label = name if name == "sgd" else f"{name} {interval[0]}/{interval[1]}"
        iterations = args.iters if interval == (1, 1) else args.iters_stale
        variants.append(
            {"label": label, "model": model, "optimizer": optimizer, "precond": precond,
             "inverse": inverse_seconds, "times": [], "iterations": iterations,
             "plan": precond.plan.describe() if precond else ""}
        )  # fmt: skip
    generator = torch.Generator().manual_seed(comm.rank)
    inputs = torch.randn(args.batch_size, 3, 32, 32, generator=generator)
    targets = torch.randint(0, 10, (args.batch_size,), generator=generator)
    chunk = args.chunk
    while any(len(v["times"]) < v["iterations"] for v in variants):
        for variant in variants:
            for _ in range(min(chunk, variant["iterations"] - len(variant["times"]))):
                start = time.perf_counter()
                variant["optimizer"].zero_grad(set_to_none=True)
                F.cross_entropy(variant["model"](inputs), targets).backward()
                if variant["precond"] is None or variant["precond"].step():
                    variant["optimizer"].step()
                variant["times"].append(time.perf_counter() - start)
    if comm.rank == 0:
        out = {
            "broadcast_alpha": alpha,
            "broadcast_beta": beta,
            "inverse_model": [inverse.c0, inverse.c2, inverse.c3],
            "variants": [
                {k: v[k] for k in ("label", "times", "inverse", "plan")} for v in variants
            ],
        }
        Path(args.result).write_text(json.dumps(out))
    destroy_distributed()


# --------------------------------------------------------------------------- launcher side
def _launch(args: argparse.Namespace, link: str) -> dict[str, Any]:
    result = Path(tempfile.mkdtemp()) / "result.json"
    worker_argv = [
        sys.executable, __file__, "--worker", "--result", str(result), "--model", args.model,
        "--batch-size", str(args.batch_size), "--iters", str(args.iters),
        "--iters-stale", str(args.iters_stale), "--intervals", args.intervals,
        "--chunk", str(args.chunk),
    ]  # fmt: skip
    base_env = {"OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "PYTHONPATH": os.pathsep.join(sys.path)}
    if link == "loopback":
        port = free_port()
        env = {**os.environ, **base_env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs = [subprocess.Popen(worker_argv, env={**env, "RANK": str(r)}) for r in range(2)]
        _wait(procs, args.timeout)
    else:
        with emulated_cluster(2, rate=link) as cluster:
            env = {**base_env, "MASTER_ADDR": cluster.addresses[0], "MASTER_PORT": "29577"}
            procs = [
                subprocess.Popen(
                    cluster.command(
                        r, worker_argv,
                        {**env, "RANK": str(r), "GLOO_SOCKET_IFNAME": cluster.interfaces[r]},
                    )
                )
                for r in range(2)
            ]  # fmt: skip
            _wait(procs, args.timeout)
    return dict(json.loads(result.read_text()))


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"a benchmark rank exited with code {code}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _report(link: str, data: dict[str, Any], warmup: int) -> list[str]:
    lines = [
        f"### link: {link}",
        "",
        f"broadcast measured at start-up: α = {1e3 * data['broadcast_alpha']:.3f} ms, "
        f"β = {1e9 * data['broadcast_beta']:.3f} ns/byte "
        f"({1e-9 / max(data['broadcast_beta'], 1e-15):.3f} GB/s); inverse model fitted on "
        f"the model's factor dims: c0 = {data['inverse_model'][0]:.3g} s, "
        f"c2 = {data['inverse_model'][1]:.3g} s, c3 = {data['inverse_model'][2]:.3g} s",
        "",
        "| variant | median ms/iter | IQR ms | ratio to SGD | ratio to D-KFAC "
        "| inverse phase ms (median, n) |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    medians = {}
    for variant in data["variants"]:
        times = variant["times"][warmup:]
        medians[variant["label"]] = statistics.median(times)
    sgd = medians["sgd"]
    for variant in data["variants"]:
        label = variant["label"]
        times = variant["times"][warmup:]
        interval = label.split(" ")[1] if " " in label else ""
        d_kfac = medians.get(f"d-kfac {interval}") if interval else None
        inverse = variant["inverse"]
        inverse_text = (
            f"{1e3 * statistics.median(inverse):.1f} ({len(inverse)})" if inverse else "—"
        )
        lines.append(
            f"| {label} | {1e3 * medians[label]:.1f} | "
            f"{1e3 * _quantile(times, 0.25):.1f}–{1e3 * _quantile(times, 0.75):.1f} | "
            f"{medians[label] / sgd:.2f} | "
            f"{'' if d_kfac is None else f'{medians[label] / d_kfac:.3f}'} | {inverse_text} |"
        )
    lines += ["", "Plans (rank-0 view):", ""]
    lines += [f"- {v['label']}: {v['plan']}" for v in data["variants"] if v["plan"]]
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--links", default="loopback,1gbit", help="loopback and/or tc rates")
    parser.add_argument("--model", default="resnet32")
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--iters", type=int, default=30, help="iterations per 1/1 variant")
    parser.add_argument("--iters-stale", type=int, default=120, help="per stale variant")
    parser.add_argument("--intervals", default="1/1,10/100", help="factor/inverse intervals")
    parser.add_argument("--chunk", type=int, default=5, help="iterations per turn")
    parser.add_argument("--warmup", type=int, default=2, help="iterations not counted")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=Path, default=None, help="write the report here too")
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    report = [
        f"# Strategies side by side: {args.model}, 2 ranks x batch {args.batch_size}, "
        "1 thread per rank",
        "",
        f"command: `python {' '.join(sys.argv)}`  ",
        f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores; "
        f"warm-up {args.warmup} iterations per variant excluded; variants alternate in chunks "
        f"of {args.chunk} iterations",
        "",
    ]
    for link in args.links.split(","):
        if link != "loopback" and not available():
            report += [f"### link: {link}", "", "skipped: needs root for namespaces", ""]
            continue
        report += _report(link, _launch(args, link), args.warmup)
        print("\n".join(report), flush=True)
    text = "\n".join(report)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
