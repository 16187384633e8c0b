"""Soak: 2 ranks, many K-FAC steps with refreshes every step and injected faults.

One ``spdkfac train`` run under ``torchrun --nproc-per-node 2 --max-restarts 1`` trains an
MLP on Fashion-MNIST (synthetic images when the dataset is not installed) with factor and
inverse refresh every step, checkpoints every ``--checkpoint-every`` steps, NaN batches on
random ranks at random steps, and one rank SIGKILLed at a random step (``SPDKFAC_FAULT``,
see :mod:`spdkfac.training.faults`). It then checks that nothing was lost: the run reached
every step, the restarted workers resumed from the last checkpoint before the kill, each
NaN batch skipped exactly one step on every rank, and parameters and K-FAC state are
bitwise identical across ranks; with ``--reference`` (the default) also that the final
state equals, bit for bit, an uninterrupted run with the same NaN batches.

    python benchmarks/perf/soak.py --steps 2000 --report benchmarks/reports/soak.md
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shlex
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

BATCH = 32


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


def _data_flags(work: Path, synthetic: bool) -> tuple[list[str], str]:
    """Flags selecting the data, and its description for the report."""
    if not synthetic:
        from spdkfac.data import load_fashion_mnist

        try:
            load_fashion_mnist(None, train=False)
            return [], "Fashion-MNIST (installed copy)"
        except FileNotFoundError:
            pass
    root = work / "data"
    root.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(0)
    for prefix, count in (("train", 2048), ("t10k", 512)):
        labels = generator.integers(0, 10, size=count)
        # Class-dependent means make the task learnable, so the loss has a trend.
        images = generator.normal(64 + 12 * labels[:, None, None], 40, size=(count, 28, 28))
        _write_idx(root / f"{prefix}-images-idx3-ubyte.gz", np.clip(images, 0, 255))
        _write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return ["--data", str(root)], "synthetic Fashion-MNIST-shaped images (2,048 train)"


def _faults(steps: int, nan_faults: int, seed: int) -> tuple[list[tuple[int, int]], int, int]:
    """(NaN steps with their rank, kill step, killed rank), drawn from ``seed``."""
    generator = np.random.default_rng(seed)
    nan_steps = sorted(int(s) for s in generator.choice(np.arange(1, steps), nan_faults, False))
    first = int(generator.integers(0, 2))  # alternating from a random rank: both get some
    nans = [(step, (first + index) % 2) for index, step in enumerate(nan_steps)]
    kill = int(generator.integers(int(steps * 0.3), int(steps * 0.7)))
    return nans, kill, int(generator.integers(0, 2))


def _launch(
    out: Path, flags: list[str], fault: str, restarts: int, timeout: float
) -> tuple[list[str], subprocess.CompletedProcess[str], float]:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [
        torchrun, "--standalone", "--nproc-per-node", "2", f"--max-restarts={restarts}",
        "-m", "spdkfac", "train", *flags, "--out-dir", str(out),
    ]  # fmt: skip
    # Restarted workers must not share torchrun's rendezvous store: they could read the
    # gloo addresses of the killed attempt from it (pytorch/pytorch#135712).
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "SPDKFAC_FAULT": fault,
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    print(f"$ SPDKFAC_FAULT={fault} {shlex.join(command)}", flush=True)
    started = time.perf_counter()
    result = subprocess.run(command, env=env, timeout=timeout, text=True, capture_output=True)
    seconds = time.perf_counter() - started
    (out / "stdout.txt").write_text(result.stdout)
    (out / "stderr.txt").write_text(result.stderr)
    return command, result, seconds


def _final(out: Path) -> dict[str, Any]:
    name = (out / "checkpoints" / "latest").read_text().strip()
    state: dict[str, Any] = torch.load(
        out / "checkpoints" / name / "common.pt", map_location="cpu", weights_only=True
    )
    return state


def _bitwise_equal(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, torch.Tensor):
        return isinstance(theirs, torch.Tensor) and torch.equal(ours, theirs)
    if isinstance(ours, dict):
        return ours.keys() == theirs.keys() and all(
            _bitwise_equal(ours[k], theirs[k]) for k in ours
        )
    if isinstance(ours, (list, tuple)):
        return len(ours) == len(theirs) and all(
            _bitwise_equal(a, b) for a, b in zip(ours, theirs, strict=True)
        )
    return bool(ours == theirs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--nan-faults", type=int, default=6, help="NaN batches to inject")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    parser.add_argument("--synthetic", action="store_true", help="synthetic data always")
    parser.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run without the kill and compare the final state bit for bit",
    )
    parser.add_argument("--timeout", type=float, default=540, help="seconds per launch")
    parser.add_argument("--work", type=Path, default=None, help="run directory (default: tmp)")
    parser.add_argument("--report", type=Path, default=Path("benchmarks/reports/soak.md"))
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="spdkfac-soak-"))
    data_flags, data_note = _data_flags(work, args.synthetic)
    nans, kill_step, kill_rank = _faults(args.steps, args.nan_faults, args.seed)
    nan_spec = ",".join(f"nan@{step}:rank{rank}" for step, rank in nans)
    flags = [
        *data_flags, "--model", "mlp", "--optimizer", "kfac", "--strategy", "spd-kfac",
        "--batch-size", str(BATCH), "--epochs", "1000", "--max-steps", str(args.steps),
        "--lr", "0.02", "--lr-schedule", "constant", "--damping", "0.03",
        "--factor-update-steps", "1", "--inv-update-steps", "1", "--no-augment",
        "--checkpoint-every", str(args.checkpoint_every), "--resume", "--threads", "1",
        "--no-tensorboard", "--collective-timeout", "120",
    ]  # fmt: skip
    faulted = work / "faulted"
    command, result, seconds = _launch(
        faulted, flags, f"{nan_spec},kill@{kill_step}:rank{kill_rank}", 1, args.timeout
    )
    checks: list[tuple[str, bool, str]] = []
    checks.append(
        ("run exited 0 after the restart", result.returncode == 0, f"rc {result.returncode}")
    )
    numbers: dict[str, Any] = {"faulted_seconds": seconds}
    if result.returncode == 0:
        state = _final(faulted)
        summary = json.loads((faulted / "summary.json").read_text())
        resumed = [int(m) for m in re.findall(r"resumed from \S+ at step (\d+)", result.stdout)]
        expected_resume = kill_step // args.checkpoint_every * args.checkpoint_every
        skipped = int(state["preconditioner"]["skipped_steps"])
        checks += [
            ("every step ran", state["step"] == summary["steps"] == args.steps, str(state["step"])),
            (
                "restarted once, resumed from the last checkpoint before the kill",
                resumed == [expected_resume],
                f"resumed at {resumed}, expected [{expected_resume}]",
            ),
            ("each NaN batch skipped one step on all ranks", skipped == len(nans), str(skipped)),
            (
                "parameters and K-FAC state identical across ranks",
                bool(summary["replicas_identical"]),
                str(summary["replicas_identical"]),
            ),
        ]
        last = summary["metrics"][-1] if summary["metrics"] else {}
        numbers |= {
            "median_iteration_ms": summary["median_iteration_ms"],
            "final_accuracy": summary["final_accuracy"],
            "final_loss": last.get("train_loss"),
            "skipped_steps": skipped,
            "resumed_at": resumed,
        }
        if args.reference:
            clean = work / "uninterrupted"
            _, reference, reference_seconds = _launch(clean, flags, nan_spec, 0, args.timeout)
            numbers["uninterrupted_seconds"] = reference_seconds
            same = reference.returncode == 0 and all(
                _bitwise_equal(state[k], _final(clean)[k])
                for k in ("step", "model", "optimizer", "preconditioner")
            )
            checks.append(
                (
                    "final state bitwise equal to an uninterrupted run",
                    same,
                    f"rc {reference.returncode}",
                )
            )
    ok = all(passed for _, passed, _ in checks)
    fault = f"{nan_spec},kill@{kill_step}:rank{kill_rank}"
    _report(args, command, fault, nans, kill_step, kill_rank, data_note, numbers, checks, work)
    print(f"soak {'passed' if ok else 'FAILED'}; report in {args.report}")
    if not ok:
        print(result.stderr[-4000:], file=sys.stderr)
    return 0 if ok else 1


def _report(
    args: argparse.Namespace,
    command: list[str],
    fault: str,
    nans: list[tuple[int, int]],
    kill_step: int,
    kill_rank: int,
    data_note: str,
    numbers: dict[str, Any],
    checks: list[tuple[str, bool, str]],
    work: Path,
) -> None:
    argv = shlex.join([Path(sys.executable).name, *sys.argv])
    lines = [
        "# Soak: 2 ranks, K-FAC refreshes every step, injected faults",
        "",
        f"Command: `{argv}` (runs in `{work}`).",
        "",
        "Training launch, with `OMP_NUM_THREADS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` and",
        "`SPDKFAC_FAULT` as below (the uninterrupted reference: `--max-restarts=0`, no kill):",
        "",
        f"    SPDKFAC_FAULT={fault} {shlex.join(command)}",
        "",
        f"- Steps: {args.steps}, 2 ranks (gloo, CPU, one thread each), batch {BATCH} per "
        f"rank, MLP, SPD-KFAC with factor and inverse refresh every step; checkpoint every "
        f"{args.checkpoint_every} steps. Data: {data_note}.",
        f"- NaN batches (step:rank): {', '.join(f'{s}:{r}' for s, r in nans)}.",
        f"- SIGKILL of rank {kill_rank} at step {kill_step}, first attempt only; torchrun "
        "`--max-restarts=1` restarts both workers with `--resume`.",
        "",
        "| measure | value |",
        "|---|---|",
    ]
    for key, value in numbers.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"| {key.replace('_', ' ')} | {shown} |")
    lines += ["", "| check | result | detail |", "|---|---|---|"]
    for name, passed, detail in checks:
        lines.append(f"| {name} | {'pass' if passed else 'FAIL'} | {detail} |")
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
