"""Time to accuracy on Fashion-MNIST: SGD vs SPD-KFAC, 2 workers, several seeds.

Each run is a real ``spdkfac train`` under ``torchrun --nproc-per-node 2``; runs go one at a
time, alternating optimizers seed by seed. The report gives, per optimizer, the epochs and
training wall time (evaluation excluded) to the target accuracy and the final accuracy
(medians over seeds), the headline ``wall-time ratio: X`` (SPD-KFAC's median wall time to
the target divided by SGD's), and a PNG of test accuracy against wall time and epochs.

    python benchmarks/bench_time_to_accuracy.py --epochs 10 --seeds 0,1,2 \\
        --out benchmarks/reports/time_to_accuracy
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from spdkfac.optional import optional_import, skip_notice

COMMON = ["--dataset", "fashion-mnist", "--no-tensorboard", "--threads", "1"]
SGD_FLAGS = "--optimizer sgd --lr 0.1 --nesterov --lr-schedule cosine --warmup-epochs 1"
KFAC_FLAGS = (
    "--optimizer kfac --strategy spd-kfac --lr 0.1 --lr-schedule cosine --warmup-epochs 1 "
    "--damping 0.03 --factor-update-steps 10 --inv-update-steps 50"
)


def _run(
    name: str, flags: list[str], seed: int, epochs: int, out: Path, timeout: float
) -> dict[str, Any]:
    run_dir = out / "runs" / f"{name}-seed{seed}"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [
        torchrun, "--standalone", "--nproc-per-node", "2", "-m", "spdkfac", "train",
        *COMMON, *flags, "--epochs", str(epochs), "--seed", str(seed), "--out-dir", str(run_dir),
    ]  # fmt: skip
    print("$", shlex.join(command), flush=True)
    started = time.perf_counter()
    result = subprocess.run(
        command, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout, text=True,
        capture_output=True,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed:\n{result.stderr[-4000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["command"] = shlex.join(command)
    summary["total_seconds"] = time.perf_counter() - started
    print(result.stdout.strip().splitlines()[-1], flush=True)
    return summary


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    if len(present) < len(values):
        return None  # some seed never reached the target: no honest median
    return statistics.median(present)


def _plot(results: dict[str, list[dict[str, Any]]], target: float, path: Path) -> bool:
    matplotlib = optional_import("matplotlib")
    if matplotlib is None:
        print(skip_notice("matplotlib", path.name))
        return False
    matplotlib.use("Agg")
    plt = optional_import("matplotlib.pyplot")
    if plt is None:
        print(skip_notice("matplotlib.pyplot", path.name))
        return False
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"sgd": "tab:blue", "spd-kfac": "tab:red"}
    for name, runs in results.items():
        for index, run in enumerate(runs):
            rows = run["metrics"]
            label = name if index == 0 else None
            accuracy = [r["test_accuracy"] for r in rows]
            style = {"color": colours.get(name), "alpha": 0.8, "marker": "o", "ms": 3}
            left.plot([r["train_seconds"] for r in rows], accuracy, label=label, **style)
            right.plot([r["epoch"] for r in rows], accuracy, label=label, **style)
    for axis, xlabel in ((left, "training wall time (s)"), (right, "epoch")):
        axis.axhline(target, color="grey", linestyle="--", linewidth=1)
        axis.set_xlabel(xlabel)
        axis.set_ylabel("test accuracy")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle("Fashion-MNIST, 2 workers: SGD vs SPD-KFAC (one line per seed)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def _first_reaching(rows: list[dict[str, Any]], target: float) -> tuple[Any, Any]:
    for row in rows:
        if row["test_accuracy"] >= target:
            return row["epoch"], row["train_seconds"]
    return None, None


def _secondary(results: dict[str, list[dict[str, Any]]], target: float) -> list[str]:
    """Epochs and wall time to a second, lower target, from the same runs' epoch metrics."""
    lines = [
        f"Same runs, first epoch end at or above {target:.0%} test accuracy:",
        "",
        "| optimizer | epochs (per seed) | wall s (per seed) | median epochs | median wall s |",
        "|---|---|---|---|---|",
    ]
    medians: dict[str, float | None] = {}
    for name, runs in results.items():
        pairs = [_first_reaching(run["metrics"], target) for run in runs]
        epochs = [e for e, _ in pairs]
        medians[name] = _median([s for _, s in pairs])
        median_epochs = _median(epochs)
        lines.append(
            f"| {name} | {epochs} | {[None if s is None else round(s, 1) for _, s in pairs]} | "
            f"{'—' if median_epochs is None else median_epochs} | "
            f"{'—' if medians[name] is None else f'{medians[name]:.1f}'} |"
        )
    sgd, kfac = medians.get("sgd"), medians.get("spd-kfac")
    if sgd is not None and kfac is not None:
        lines += ["", f"wall-time ratio at {target:.0%}: {kfac / sgd:.2f}"]
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--target", type=float, default=0.92)
    parser.add_argument("--model", default="resnet20")
    parser.add_argument("--sgd", default=SGD_FLAGS, help="flags of the SGD runs")
    parser.add_argument("--kfac", default=KFAC_FLAGS, help="flags of the SPD-KFAC runs")
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--timeout", type=float, default=7200)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/reports/time_to_accuracy"))
    parser.add_argument(
        "--secondary-target", type=float, default=0.90, help="also report time to this accuracy"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite report.md from OUT/results.json"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shared = ["--model", args.model, "--batch-size", str(args.batch_size),
              "--target-accuracy", str(args.target)]  # fmt: skip
    variants = {"sgd": shlex.split(args.sgd) + shared, "spd-kfac": shlex.split(args.kfac) + shared}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    if args.report_only:
        results = json.loads((args.out / "results.json").read_text())
    else:
        for seed in (int(s) for s in args.seeds.split(",")):
            for name, flags in variants.items():
                results[name].append(_run(name, flags, seed, args.epochs, args.out, args.timeout))
                (args.out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"# Time to {args.target:.0%} test accuracy: Fashion-MNIST, {args.model}, 2 workers",
        "",
        # --report-only rewrites the report from the same runs: show the command that ran them.
        f"command: `python {shlex.join(a for a in sys.argv if a != '--report-only')}`  ",
        f"{args.epochs} epochs per run, batch {args.batch_size} per worker (global "
        f"{2 * args.batch_size}), seeds {args.seeds}; one run at a time on the 2-core machine "
        "(one process per core, 1 thread each). Wall time = training time (evaluation "
        "excluded) when the epoch that first reached the target ended.",
        "",
        "| optimizer | flags | epochs to target (per seed) | wall s to target (per seed) | "
        "median epochs | median wall s | final acc (median) | best acc (median) | ms/iter |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    medians: dict[str, float | None] = {}
    epoch_medians: dict[str, float | None] = {}
    for name, runs in results.items():
        epochs = [r["epochs_to_target"] for r in runs]
        seconds = [r["seconds_to_target"] for r in runs]
        medians[name] = _median(seconds)
        median_epochs = epoch_medians[name] = _median(epochs)
        lines.append(
            f"| {name} | `{shlex.join(variants[name])}` | {epochs} | "
            f"{[None if s is None else round(s, 1) for s in seconds]} | "
            f"{'—' if median_epochs is None else median_epochs} | "
            f"{'—' if medians[name] is None else f'{medians[name]:.1f}'} | "
            f"{statistics.median(r['final_accuracy'] for r in runs):.4f} | "
            f"{statistics.median(r['best_accuracy'] for r in runs):.4f} | "
            f"{statistics.median(r['median_iteration_ms'] for r in runs):.1f} |"
        )
    lines.append("")
    for label, values in (("epochs", epoch_medians), ("wall-time", medians)):
        sgd, kfac = values["sgd"], values["spd-kfac"]
        ratio = (
            "n/a (a run did not reach the target)"
            if sgd is None or kfac is None
            else f"{kfac / sgd:.2f}"
        )
        lines += [f"{label} ratio: {ratio}", ""]
    lines += _secondary(results, args.secondary_target)
    if _plot(results, args.target, args.out / "accuracy.png"):
        lines.append("![accuracy vs wall time and epochs](accuracy.png)")
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
