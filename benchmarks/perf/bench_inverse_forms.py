"""Compare inverse-time model forms and fitting grids on this machine, on held-out dims.

Times damped inverses once per trial at every dimension below, then fits the polynomial
``c0 + c2·d² + c3·d³`` (what ``CostModel`` uses) and the SPD-KFAC paper's exponential
``α·e^(β·d)`` (with the authors' √t weights, and unweighted) to two grids: powers of two
only, and ``spdkfac calibrate``'s default (powers of two and the points half-way). Each
fit is scored on its own points and on held-out dims typical of K-FAC factors
(C·k² and C·k²+1 for convolutions, n+1 for linear layers with a bias).

    python benchmarks/perf/bench_inverse_forms.py --threads 1 --trials 2
"""

from __future__ import annotations

import argparse

import torch

from spdkfac.calibrate import measure_inverses
from spdkfac.cli.calibrate import DEFAULT_DIMS
from spdkfac.costmodel import (
    ExponentialInverseModel,
    PolynomialInverseModel,
    Predictor,
    median_relative_error,
)

GRIDS = {"powers of two": (64, 128, 256, 512, 1024, 2048, 4096), "default x1.5": DEFAULT_DIMS}
HELD_OUT = (48, 65, 144, 257, 288, 513, 576, 1025, 1152, 2049, 2304, 3500)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--method", choices=("cholesky", "eigen"), default="cholesky")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# Inverse-time model forms ({args.method}, {args.threads} thread(s))\n")
    print(f"held-out dims: {', '.join(map(str, HELD_OUT))}\n")
    print("| trial | fit grid | model | median error, fit dims | median error, held-out |")
    print("|---|---|---|---|---|")
    measured_lines = []
    for trial in range(args.trials):
        every = sorted({*HELD_OUT, *(d for grid in GRIDS.values() for d in grid)})
        times = dict(measure_inverses(every, args.repeats, args.method))  # type: ignore[arg-type]
        held = [(float(d), times[d]) for d in HELD_OUT]
        for grid_name, grid in GRIDS.items():
            train = [(float(d), times[d]) for d in grid]
            models: dict[str, Predictor] = {
                "c0 + c2·d² + c3·d³": PolynomialInverseModel.fit(train),
                "α·e^(β·d), √t weights (paper)": ExponentialInverseModel.fit(train),
                "α·e^(β·d), unweighted": ExponentialInverseModel.fit(train, paper_weights=False),
            }
            for name, model in models.items():
                print(
                    f"| {trial} | {grid_name} | {name} | "
                    f"{100 * median_relative_error(model, train):.1f} % | "
                    f"{100 * median_relative_error(model, held):.1f} % |"
                )
        measured_lines.append(
            f"trial {trial} (ms): " + ", ".join(f"{d}: {1000 * t:.3g}" for d, t in times.items())
        )
    print("\n" + "\n\n".join(measured_lines))


if __name__ == "__main__":
    main()
