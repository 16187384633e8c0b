"""Project K-FAC under FSDP2 beside K-FAC under DDP and FSDP2 alone (issue 40).

GPT (the zoo's default sizes) and ResNet-50 at 32 examples per worker, 8 and 64 workers,
on the ``ib100`` preset (8-GPU nodes, 100 Gbit/s InfiniBand) and on ``eth10`` (10 Gbit/s
Ethernet per node): each strategy's iteration time under DDP (the simulator's own run) and
under FSDP2 (:mod:`spdkfac.sim.fsdp`: per-unit parameter all-gathers, forward and, with
``reshard_after_forward``, backward, gradient reduce-scatters in place of the all-reduce,
and K-FAC's gradient gathers at ``step()``), with the bytes each rank sends in FSDP2's and
K-FAC's gradient collectives.

    python benchmarks/sim/project_sim_fsdp.py --out benchmarks/reports/sim_fsdp.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from spdkfac.sim import PRESETS, simulate_strategy, workload_for
from spdkfac.sim.fsdp import FsdpResult, fsdp_result

MODELS = ("gpt", "resnet50")
WORKERS = (8, 64)
PRESET_NAMES = ("ib100", "eth10")
STRATEGIES = ("sgd", "d-kfac", "spd-kfac", "osawa")
BATCH = 32

NOTES = """\
## Reading the tables

* The `sgd` row is the two baselines without K-FAC: its DDP column is DDP alone, its
  FSDP2 column FSDP2 alone. The K-FAC rows' DDP column is DDP + K-FAC, their FSDP2 column
  FSDP2 + K-FAC. "MiB sent/rank" is what each rank sends in FSDP2's pass collectives and
  K-FAC's step gathers (the factor exchange, the same under both, not counted).
* The zoo's GPT is small (its default sizes); its numbers show start-up-bound
  collectives, ResNet-50's bandwidth-bound ones.

## What this projection is and is not

* FSDP2's units are every module holding parameters (`fully_shard` on each); a real run
  shards coarser units (transformer blocks), which have fewer, larger collectives: the
  bytes are the same, the start-ups fewer.
* The FSDP2 time is the DDP row's simulated iteration with its exposed gradient
  communication (`GradComm`) replaced by FSDP2's: the first unit's all-gather is exposed,
  the rest of the passes' all-gathers and reduce-scatters only beyond the forward and
  backward compute (FSDP2 prefetches and overlaps them); K-FAC's gradient gathers run in
  `step()` and are exposed whole. It is an overlay, not a per-unit event simulation: the
  units' collectives do not contend with the factor buckets on the link, so where the
  factor exchange already fills the backward window the FSDP2 + K-FAC time is optimistic.
* Bytes are float32; `MixedPrecisionPolicy` (bf16 parameters and reductions) halves the
  passes' traffic, not K-FAC's gathers.
* `osawa` under FSDP2: one reduce-scatter per layer brings its full gradient to its owner,
  each rank sending the layer's full size (P times a gather's bytes), which is why its
  FSDP2 bytes grow with P; its broadcast of the preconditioned result is the DDP row's.
"""


def _row(label: str, ddp_ms: float, result: FsdpResult) -> str:
    return (
        f"| {label} | {ddp_ms:.1f} | {1e3 * result.iteration_s:.1f} "
        f"| {1e3 * result.pass_exposed_s:.1f} | {1e3 * result.step_comm_s:.1f} "
        f"| {result.bytes_per_rank / 2**20:.1f} |"
    )


def _section(model: str, preset: str, workers: int) -> list[str]:
    workload = workload_for(model, batch_size=BATCH)
    hardware = PRESETS[preset]()
    lines = [
        f"### {model}, {workers} workers, {preset}",
        "",
        "| strategy | DDP ms | FSDP2 ms | FSDP2 passes exposed ms | K-FAC gathers ms "
        "| FSDP2 + K-FAC MiB sent/rank |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in STRATEGIES:
        ddp = simulate_strategy(workload, hardware, workers, name)
        result = fsdp_result(ddp, workload, hardware)
        label = "sgd (no K-FAC: DDP alone, FSDP2 alone)" if name == "sgd" else name
        lines.append(_row(label, 1e3 * ddp.iteration_s, result))
    params = workload.parameter_count
    lines += ["", f"{params / 1e6:.1f} M parameters ({4 * params / 2**20:.0f} MiB float32).", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the markdown report here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    lines = [
        "# K-FAC under FSDP2 vs DDP, projected (`spdkfac.sim.fsdp`)",
        "",
        "Command: `PYTHONPATH=src python benchmarks/sim/project_sim_fsdp.py "
        "--out benchmarks/reports/sim_fsdp.md` (also: `spdkfac simulate --layout fsdp`).",
        f"Batch {BATCH} per worker; factors and inverses refreshed every step.",
        "",
    ]
    for preset in PRESET_NAMES:
        lines += [f"## {preset}", ""]
        for model in MODELS:
            for workers in WORKERS:
                lines += _section(model, preset, workers)
    lines += [NOTES, f"Simulated in {time.perf_counter() - start:.0f} s."]
    report = "\n".join(lines) + "\n"
    if args.out is not None:
        Path(args.out).write_text(report)
    sys.stdout.write(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
