"""Measure a model's per-op and per-layer compute times for ``spdkfac simulate --measured``.

Times every forward/backward op of one iteration and every layer's A and G products on
this machine, one torch thread per process. With ``--concurrent 2`` a second process does
the same at the same time, as the second rank of a 2-rank job does on a 2-core machine, so
the times include that contention; the file holds process 0's times.

    python benchmarks/sim/measure_sim_compute.py --model resnet32 --concurrent 2 \\
        --out benchmarks/reports/sim_measured_resnet32_b32.json
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
from typing import Any

import torch

from spdkfac.sim import MeasuredCompute, measure_compute, model_by_name


def _measure(arguments: tuple[str, int, int | None, int]) -> dict[str, Any]:
    name, batch_size, input_size, repeats = arguments
    torch.set_num_threads(1)
    entry = model_by_name(name, input_size=input_size)
    measured = measure_compute(
        entry.build, entry.input_shape, batch_size=batch_size, name=entry.name, repeats=repeats
    )
    return measured.to_json()  # plain data: results cross a process boundary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet32")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--input-size", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--concurrent", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    job = (args.model, args.batch_size, args.input_size, args.repeats)
    with multiprocessing.get_context("spawn").Pool(args.concurrent) as pool:
        results = pool.map(_measure, [job] * args.concurrent)
    first = MeasuredCompute.from_json(results[0])
    # Two processes doing the same work at once do not run at the same speed; their
    # spread is the rank skew a real 2-rank job sees (``Hardware.rank_spread``).
    totals = [
        sum(item["op_seconds"]) + sum(a + g for a, g in item["factor_seconds"].values())
        for item in results
    ]
    spread = statistics.pstdev(totals) / statistics.fmean(totals) if len(totals) > 1 else 0.0
    measured = MeasuredCompute(
        model=first.model,
        batch_size=first.batch_size,
        input_shape=first.input_shape,
        op_seconds=first.op_seconds,
        factor_seconds=first.factor_seconds,
        metadata={
            **first.metadata,
            "concurrent processes": args.concurrent,
            "process compute seconds": totals,
            "rank_spread": spread,
            "command": "python " + " ".join(sys.argv),
        },
    )
    measured.save(args.out)
    forward_backward = sum(first.op_seconds)
    factors = sum(a + g for a, g in first.factor_seconds.values())
    print(
        f"{args.out}: {len(first.op_seconds)} ops, forward+backward {1e3 * forward_backward:.1f} "
        f"ms, factor products {1e3 * factors:.1f} ms; per process {totals}, spread {spread:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
