"""Time spdkfac on one device and write everything under ``--out`` (``gpu_check.sh`` runs it).

Sections, each in its own JSON file (a failing section writes its traceback instead, and
the others still run): ``environment.json``; ``factor_kernels.json`` (every layer's factor
kernel of ResNet-50 at ImageNet shapes and of a GPT, float32 and bf16, against
``torch.mm`` of the same shape and the square-matmul roofline); ``costmodel_<device>.json``
(``spdkfac calibrate``'s file: inverses by size and factor products, fitted: load it with
``KFACPreconditioner(cost_model=...)`` or ``spdkfac simulate --cost-model``);
``training_steps.json`` (plain SGD, K-FAC 1/1 and 10/100 amortized); ``sim_compute.json``
(the simulator's device constants, with the calibration's inverse and factor fits: what an
H200 preset in ``spdkfac.sim.presets`` takes); and ``gpu_check.md``, the report.

    python benchmarks/gpu/gpu_check.py --out /tmp/gpu-check            # on a GPU
    python benchmarks/gpu/gpu_check.py --out /tmp/gpu-check --dry-run  # tiny sizes, CPU
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import gpu_check_measure as measure


def _environment(device: torch.device, dry_run: bool) -> dict[str, Any]:
    cuda = device.type == "cuda"
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "dry_run": dry_run,
        "threads": torch.get_num_threads(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "memory_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
    }


def _section(out: Path, name: str, run: Callable[[], Any], log: dict[str, Any]) -> Any:
    """Run one section, write ``name.json`` (or ``name.error.txt``) and log its time."""
    start = time.perf_counter()
    try:
        value = run()
    except Exception:  # one failing section must not lose the others' numbers
        (out / f"{name}.error.txt").write_text(traceback.format_exc())
        log[name] = {"ok": False, "seconds": time.perf_counter() - start}
        print(f"[gpu_check] {name}: FAILED (see {name}.error.txt)", flush=True)
        return None
    data = value.to_json() if hasattr(value, "to_json") else value
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    log[name] = {"ok": True, "seconds": time.perf_counter() - start}
    print(f"[gpu_check] {name}: {log[name]['seconds']:.1f} s", flush=True)
    return value


def _sim_compute(device_model: Any, calibration: Any) -> dict[str, Any]:
    """The constants of a simulator preset: the fitted roofline, the calibrated inverse and
    factor-product fits."""
    result: dict[str, Any] = {"device": device_model}
    if calibration is not None:
        data = calibration.to_json()
        result["inverse"] = data.get("inverse")
        result["factor"] = data.get("factor")
    return result


def _factor_summary(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | dtype | factor time (ms) | same-shape mm (ms) | share of roofline |",
             "| --- | --- | ---: | ---: | ---: |"]  # fmt: skip
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["dtype"]), []).append(row)
    for (model, dtype), items in groups.items():
        seconds = sum(r["seconds"] for r in items)
        mm = sum(r["mm_seconds"] for r in items)
        # time-weighted share: total roofline seconds over total kernel seconds
        share = sum(r["share_of_peak"] * r["seconds"] for r in items) / seconds
        lines.append(f"| {model} | {dtype} | {seconds * 1e3:.3f} | {mm * 1e3:.3f} | "
                     f"{share:.1%} |")  # fmt: skip
    return lines


def _steps_summary(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| model | variant | steps | mean step (ms) | vs plain |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    plain = {r["model"]: r["mean_seconds"] for r in rows if r["variant"] == "plain"}
    for row in rows:
        ratio = row["mean_seconds"] / plain[row["model"]] if row["model"] in plain else float("nan")
        lines.append(f"| {row['model']} | {row['variant']} | {row['steps']} | "
                     f"{row['mean_seconds'] * 1e3:.2f} | {ratio:.3f}x |")  # fmt: skip
    return lines


def _report(out: Path, env: dict[str, Any], results: dict[str, Any], log: dict[str, Any]) -> str:
    lines = [f"# gpu_check on {env['device']}", "",
             f"torch {env['torch']} (CUDA {env['cuda']}), Python {env['python']}; "
             f"dry run: {env['dry_run']}; TF32 matmul: {env['tf32_matmul']}.", "",
             "| section | ok | seconds |", "| --- | --- | ---: |"]  # fmt: skip
    lines += [f"| {name} | {entry['ok']} | {entry['seconds']:.1f} |" for name, entry in log.items()]
    peaks = results.get("peak_matmul")
    if peaks:
        lines += ["", "Square matmul roofline: " + ", ".join(
            f"{name} {rate / 1e12:.1f} TFLOP/s" for name, rate in peaks.items())]  # fmt: skip
    if results.get("factor_kernels"):
        lines += ["", "## Factor kernels (goal: >= 50 % of the roofline)", ""]
        lines += _factor_summary(results["factor_kernels"])
    if results.get("training_steps"):
        lines += ["", "## Training steps (goal: K-FAC 10/100 <= 1.1x plain on ResNet-50)", ""]
        lines += _steps_summary(results["training_steps"])
    calibration = results.get("costmodel")
    if calibration is not None:
        inverse = calibration.to_json().get("inverse")
        lines += ["", f"Inverse-time fit: `{json.dumps(inverse)}`"]
    text = "\n".join(lines) + "\n"
    (out / "gpu_check.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    use_cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    sizes = measure.DRY if args.dry_run else measure.FULL
    env = _environment(device, args.dry_run)
    (out / "environment.json").write_text(json.dumps(env, indent=1) + "\n")
    log: dict[str, Any] = {}
    results: dict[str, Any] = {}
    results["peak_matmul"] = _section(
        out, "peak_matmul", lambda: measure.peak_matmul(sizes, device), log
    )
    peaks = results["peak_matmul"] or {"float32": float("nan"), "bfloat16": float("nan")}
    results["factor_kernels"] = _section(
        out, "factor_kernels", lambda: measure.factor_kernels(sizes, device, peaks), log
    )
    results["costmodel"] = _section(
        out, f"costmodel_{device.type}", lambda: measure.inverse_cost_model(sizes, device), log
    )
    results["training_steps"] = _section(
        out, "training_steps", lambda: measure.training_steps(sizes, device), log
    )
    device_model = _section(out, "sim_device", lambda: measure.sim_device_model(sizes, device), log)
    if device_model is not None:
        sim = _sim_compute(device_model, results["costmodel"])
        (out / "sim_compute.json").write_text(json.dumps(sim, indent=1) + "\n")
    print(_report(out, env, results, log), flush=True)
    return 0 if all(entry["ok"] for entry in log.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
