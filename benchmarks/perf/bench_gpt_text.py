"""A short real run of the built-in GPT on the fortunes corpus, 2 workers: AdamW against
AdamW preconditioned by SPD-KFAC, the same steps, validation bits per byte against steps
and training wall time (evaluation excluded). Runs alternate, one at a time.

Protocol (fixed before the runs): ``spdkfac train --model gpt --dataset text`` (default
sizes: 2 blocks, width 128, 4 heads, context 128), batch 16 per worker, ``--steps``
optimizer steps at a constant learning rate of 3e-3 for both (the flags below); K-FAC adds
damping 0.01, factors every 5 and inverses every 50 steps (chosen before the runs, not
tuned: the tuned comparison is a separate study); evaluation on the validation split every
``--eval-every`` steps. Every run is recorded in the report.

    python benchmarks/perf/bench_gpt_text.py --steps 300 --eval-every 25 --repeats 1 \\
        --out benchmarks/reports/gpt_text_2workers
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

from spdkfac.support.optional import optional_import, skip_notice

COMMON = (
    "--model gpt --dataset text --batch-size 16 --lr 3e-3 --lr-schedule constant "
    "--no-tensorboard --threads 1"
)
VARIANTS = {
    "adamw": "--optimizer adamw",
    "adamw+spd-kfac": (
        "--optimizer kfac-adamw --strategy spd-kfac --damping 0.01 "
        "--factor-update-steps 5 --inv-update-steps 50"
    ),
}


def _run(name: str, flags: str, args: argparse.Namespace, repeat: int) -> dict[str, Any]:
    run_dir = args.out / "runs" / f"{name}-{repeat}"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [
        torchrun, "--standalone", "--nproc-per-node", "2", "-m", "spdkfac", "train",
        *shlex.split(COMMON), *shlex.split(flags), "--max-steps", str(args.steps),
        "--eval-every", str(args.eval_every), "--seed", str(repeat), "--out-dir", str(run_dir),
        "--overwrite",  # a rerun of the benchmark replaces its runs
    ]  # fmt: skip
    print("$", shlex.join(command), flush=True)
    started = time.perf_counter()
    result = subprocess.run(
        command, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=args.timeout, text=True,
        capture_output=True,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-4000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["command"] = shlex.join(command)
    summary["total_seconds"] = time.perf_counter() - started
    return summary


def _curve(run: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(step, training seconds, validation bits per byte) per evaluation."""
    return [
        (int(row["step"]), float(row["train_seconds"]), float(row["val_bits_per_byte"]))
        for row in run["metrics"]
    ]


def _plot(results: dict[str, list[dict[str, Any]]], path: Path) -> bool:
    matplotlib = optional_import("matplotlib")
    plt = None if matplotlib is None else optional_import("matplotlib.pyplot")
    if plt is None:
        print(skip_notice("matplotlib", path.name))
        return False
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in results.items():
        for index, run in enumerate(runs):
            curve = _curve(run)
            label = name if index == 0 else None
            left.plot([c[0] for c in curve], [c[2] for c in curve], marker="o", ms=3, label=label)
            right.plot([c[1] for c in curve], [c[2] for c in curve], marker="o", ms=3, label=label)
    for axis, xlabel in ((left, "step"), (right, "training wall time (s)")):
        axis.set_xlabel(xlabel)
        axis.set_ylabel("validation bits per byte")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle("GPT on fortunes, 2 workers: AdamW vs AdamW + SPD-KFAC")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/reports/gpt_text_2workers"))
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    if args.report_only:
        results = json.loads((args.out / "results.json").read_text())
    else:
        for repeat in range(args.repeats):
            for name, flags in VARIANTS.items():
                results[name].append(_run(name, flags, args, repeat))
                (args.out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        "# GPT on the fortunes corpus, 2 workers: AdamW vs AdamW + SPD-KFAC",
        "",
        f"command: `python {shlex.join(a for a in sys.argv if a != '--report-only')}`  ",
        f"Common flags: `{COMMON}`, `--max-steps {args.steps} --eval-every "
        f"{args.eval_every}`, 2 workers (one per core, 1 thread each), runs alternating. "
        "Validation bits per byte after each evaluation; wall time = training time, "
        "evaluation excluded. Every run is listed.",
        "",
        "| variant | flags | run | final val bits/byte | test bits/byte | training s | ms/step |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for name, runs in results.items():
        for index, run in enumerate(runs):
            curve = _curve(run)
            step, seconds, bpb = curve[-1]
            lines.append(
                f"| {name} | `{VARIANTS[name]}` | {index} | {bpb:.3f} | "
                f"{run['test_bits_per_byte']:.3f} | {seconds:.1f} | "
                f"{1e3 * seconds / max(step, 1):.0f} |"
            )
    lines += ["", "Validation bits per byte by step (first run of each variant):", ""]
    curves = {name: _curve(runs[0]) for name, runs in results.items()}
    names = list(curves)
    lines.append("| step | " + " | ".join(f"{n} (s, bits/byte)" for n in names) + " |")
    lines.append("|---:|" + "---|" * len(names))
    for points in zip(*curves.values(), strict=False):
        cells = " | ".join(f"{s:.0f} s, {b:.3f}" for _, s, b in points)
        lines.append(f"| {points[0][0]} | {cells} |")
    for name in names:
        medians = [statistics.median(_curve(r)[-1][1] for r in results[name])]
        lines.append("")
        lines.append(f"median training s, {name}: {medians[0]:.1f}")
    if _plot(results, args.out / "curves.png"):
        lines += ["", "![validation bits per byte](curves.png)"]
    (args.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
