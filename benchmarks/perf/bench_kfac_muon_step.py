"""Step cost of K-FAC before Muon's orthogonalization against Muon alone, on the text
workload's model (revision 4: the built-in GPT, 4 blocks of width 96, 4 heads, context
128, 64 windows per step), one thread: each round times every optimizer once, in turn,
over the same steps (refresh steps included), and prints each K-FAC row's mean step time
over Muon's in that round (paired ratios), then the median and range over rounds.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/perf/bench_kfac_muon_step.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from spdkfac.models import build_model
from spdkfac.training.config import TrainConfig
from spdkfac.training.loop import cross_entropy_pass, train_step
from spdkfac.training.setup import make_optimizers

__all__ = ["main"]

#: Row -> ``spdkfac train`` options: the study's declared intervals, factors every 2
#: (eigen-Adam forms) or 5, bases every 10 or inverses every 50.
ROWS: dict[str, dict[str, object]] = {
    "muon": {"optimizer": "muon"},
    "kfac-muon": {"optimizer": "kfac-muon", "factor_update_steps": 5, "inv_update_steps": 50},
    "kfac-eigen-adam-muon": {
        "optimizer": "kfac-eigen-adam-muon", "factor_update_steps": 2, "inv_update_steps": 10,
    },
    "kfac-two-sided-muon": {
        "optimizer": "kfac-muon", "inverse_method": "cholesky", "factor_update_steps": 5,
        "inv_update_steps": 50,
    },
}  # fmt: skip


def _mean_step(optimizer: str, steps: int, warmup: int) -> float:
    torch.manual_seed(0)
    model = build_model("gpt", vocab_size=256, block_size=128, n_layer=4, n_head=4, d_model=96)
    config = TrainConfig.from_dict(
        {"model": "gpt", "dataset": "text", "lr": 0.005, **ROWS[optimizer]}
    )
    _, combined, precond = make_optimizers(config, model, steps_per_epoch=1000)
    generator = torch.Generator().manual_seed(1)
    start = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            start = time.perf_counter()
        tokens = torch.randint(0, 256, (64, 129), generator=generator)
        passes = [cross_entropy_pass(model, tokens[:, :-1], tokens[:, 1:])]
        train_step(model, combined, precond, passes)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ratios: dict[str, list[float]] = {row: [] for row in list(ROWS)[1:]}
    for round_ in range(args.rounds):
        times = {row: _mean_step(row, args.steps, args.warmup) for row in ROWS}
        line = ", ".join(f"{row} {times[row] * 1e3:.0f} ms" for row in ROWS)
        print(f"round {round_ + 1}: {line}", flush=True)
        for row in list(ROWS)[1:]:
            ratios[row].append(times[row] / times["muon"])
    for row, values in ratios.items():
        print(
            f"{row} / muon: median {statistics.median(values):.3f} "
            f"(range {min(values):.3f}-{max(values):.3f}; per round "
            f"{', '.join(f'{v:.3f}' for v in values)})"
        )


if __name__ == "__main__":
    main()
