"""Measure each inverse form's compute time relative to a damped inverse by Cholesky.

The placement planners and the simulator price one result of a form as the cost model's
inverse-time fit (calibrated on Cholesky inverses) times the form's ``compute_scale``
(:data:`spdkfac.forms.COMPUTE_SCALES`). This prints, per dimension, the median seconds of
each form's :meth:`~spdkfac.forms.InverseForm.compute` on one symmetric positive definite
factor and its ratio to Cholesky, to check or re-derive those scales on a machine:

    python benchmarks/sim/measure_sim_form_costs.py --threads 1 --dims 128,384,768,1025,2048
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from spdkfac.forms import COMPUTE_SCALES, FORM_METHODS, inverse_form


def _factor(dim: int, generator: torch.Generator) -> torch.Tensor:
    matrix = torch.randn(dim, dim, generator=generator)
    matrix = (matrix + matrix.T).mul_(0.5)
    matrix.diagonal().add_(2.0 * math.sqrt(dim))
    return matrix


def _median_seconds(method: str, factor: torch.Tensor, repeats: int) -> float:
    form = inverse_form(method)
    form.compute(factor, 1e-3)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        form.compute(factor, 1e-3)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dims", default="64,128,384,513,768,1025,2048")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    print(f"# Inverse forms' compute time vs Cholesky ({args.threads} thread(s))\n")
    print("stated scales: " + ", ".join(f"{m} {COMPUTE_SCALES[m]:g}" for m in FORM_METHODS))
    print("\n| d | " + " | ".join(FORM_METHODS) + " |")
    print("|---" * (len(FORM_METHODS) + 1) + "|")
    for dim in (int(part) for part in args.dims.split(",") if part.strip()):
        factor = _factor(dim, generator)
        seconds = {m: _median_seconds(m, factor, args.repeats) for m in FORM_METHODS}
        base = seconds["cholesky"]
        cells = [f"{1e3 * seconds[m]:.2f} ms ({seconds[m] / base:.2f}x)" for m in FORM_METHODS]
        print(f"| {dim} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
