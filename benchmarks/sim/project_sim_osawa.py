"""Project Osawa et al.'s owner-computes K-FAC beside SPD-KFAC and D-KFAC at 64 workers.

ResNet-50, ResNet-152 and DenseNet-201 at the SPD-KFAC paper's batch sizes (32, 8, 16 per
worker) on the ``paper`` preset (its cluster, 100 Gbit/s InfiniBand) and on ``eth10``
(one 10 Gbit/s Ethernet link per 8-GPU node): iteration time per strategy, every step
and amortised over stale refresh intervals, the factor + inverse memory of the most
loaded rank, and the strategy with the lowest predicted time per cell.

    python benchmarks/sim/project_sim_osawa.py --out benchmarks/reports/sim_osawa.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from project_sim_scale import Kinds, _amortised, _ms, _simulate  # benchmarks/: script dir
from spdkfac.sim import PRESETS, CollectiveOp, StrategyResult, workload_for
from spdkfac.sim.costs import WorkloadCosts
from spdkfac.sim.owners import gather_sizes, scatter_chunks
from spdkfac.sim.paper import PAPER_TABLE_III
from spdkfac.sim.strategies import STRATEGY_TABLE, prepare
from spdkfac.sim.workload import Workload

WORKERS = 64
MODELS = ("resnet50", "resnet152", "densenet201")
PRESET_NAMES = ("paper", "eth10")
STRATEGIES = ("sgd", "d-kfac", "spd-kfac", "osawa", "osawa-pipelined")
KFAC = STRATEGIES[1:]
#: (factor, inverse) refresh intervals: every step, and stale phases of 10 and 100.
INTERVALS = ((1, 1), (10, 10), (100, 100))
SHOWN = ("GradComm", "FactorComm", "InverseComp", "InverseComm", "Precondition", "Other")

Results = dict[tuple[str, str, str], tuple[StrategyResult, Kinds]]

NOTES = """\
## What this projection cannot tell

* What the simulator runs for `osawa` is in `spdkfac.sim.owners` (and `docs/cli.md`): the
  real planners' owners and buckets, no inverse broadcast, each reduce-scatter as one
  reduce per owner with a non-empty chunk and the gather as one broadcast per owner, in
  rank order on the exchange's process group, as `TorchDistributedCommunicator` does.
* A reduce of n bytes is costed as the preset's broadcast of n bytes (a broadcast run
  backwards); the reduction arithmetic is not costed (NCCL pipelines it with the
  transfer at GPU memory speed). The engine runs a channel's collectives one at a time,
  as NCCL runs one communicator's operations on its stream, so the per-owner reduces and
  broadcasts never overlap each other; grouping them (as `ncclGroupStart`/`End` can)
  might hide some start-ups, which the real code does not try.
* The LPT owner plan is blind to nodes: it gives the largest layers to ranks 0, 1, 2, ...,
  the first node. The optimal fusion plans with all-reduce costs, as the real planner is
  given them, but its buckets are reduced per owner (one start-up per owner, not per
  bucket); a planner given that cost would favour fewer, larger buckets.
* Compute is the SPD-KFAC paper's RTX 2080 Ti fit on both presets; links are the
  assumptions of `spdkfac.sim.clusters`; overlap is free. Batch-norm layers are not
  preconditioned (Osawa et al. precondition them, unit-wise).
"""


def _run(workloads: dict[str, Workload]) -> Results:
    results: Results = {}
    for preset in PRESET_NAMES:
        hardware = PRESETS[preset]()
        for model, workload in workloads.items():
            for name in STRATEGIES:
                started = time.perf_counter()
                results[preset, model, name] = _simulate(workload, hardware, WORKERS, name)
                elapsed = time.perf_counter() - started
                print(f"{model} {preset} {name}: {elapsed:.1f} s", file=sys.stderr)
    return results


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f}"


def _time(results: Results, key: tuple[str, str, str], interval: tuple[int, int]) -> float:
    result, kinds = results[key]
    if not STRATEGY_TABLE[result.strategy].uses_kfac:  # SGD: one kind, every step alike
        return result.iteration_s
    return _amortised(kinds, *interval)[0]


def _times_table(results: Results, preset: str) -> list[str]:
    header = " | ".join(f"{f}/{i} ms" for f, i in INTERVALS)
    lines = [
        f"| model | strategy | {header} | vs d-kfac (1/1) | factors+inverses MiB/rank |",
        "|---|---|" + "---|" * (len(INTERVALS) + 2),
    ]
    for model in MODELS:
        reference = _time(results, (preset, model, "d-kfac"), (1, 1))
        best = {
            interval: min(KFAC, key=lambda n: _time(results, (preset, model, n), interval))
            for interval in INTERVALS
        }
        for name in STRATEGIES:
            result = results[preset, model, name][0]
            cells = []
            for interval in INTERVALS:
                text = _ms(_time(results, (preset, model, name), interval))
                cells.append(f"**{text}**" if best[interval] == name else text)
            every = _time(results, (preset, model, name), (1, 1))
            lines.append(
                f"| {model} | {name} | "
                + " | ".join(cells)
                + f" | {reference / every:.2f}x | {_mib(result.factor_memory_bytes)} |"
            )
    return lines


def _breakdown_table(results: Results, preset: str) -> list[str]:
    lines = [
        "| model | strategy | iteration ms | " + " | ".join(SHOWN) + " | plan |",
        "|---|---|---|" + "---|" * (len(SHOWN) + 1),
    ]
    for model in MODELS:
        for name in KFAC:
            result, kinds = results[preset, model, name]
            seconds, split = _amortised(kinds, 1, 1)
            plan = result.plan.split(", max CT")[0]
            lines.append(
                f"| {model} | {name} | {_ms(seconds)} | "
                + " | ".join(_ms(split[c]) for c in SHOWN)
                + f" | {plan} |"
            )
    return lines


def _winners(results: Results) -> list[str]:
    header = " | ".join(f"{f}/{i}" for f, i in INTERVALS)
    lines = [f"| preset | model | {header} |", "|---|---|" + "---|" * len(INTERVALS)]
    for preset in PRESET_NAMES:
        for model in MODELS:
            cells = []
            for interval in INTERVALS:
                ranked = sorted(KFAC, key=lambda n: _time(results, (preset, model, n), interval))
                first, second = ranked[0], ranked[1]
                lead = _time(results, (preset, model, second), interval) / _time(
                    results, (preset, model, first), interval
                )
                cells.append(f"{first} ({lead:.2f}x {second})")
            lines.append(f"| `{preset}` | {model} | " + " | ".join(cells) + " |")
    return lines


def _memory(results: Results, workload: Workload) -> list[str]:
    per_layer = {layer.name: 2 * 4 * (layer.a_dim**2 + layer.g_dim**2) for layer in workload.layers}
    total = sum(per_layer.values())
    largest = workload.layer(max(per_layer, key=per_layer.__getitem__))
    setup = prepare(WorkloadCosts(workload, PRESETS["paper"](), WORKERS), STRATEGY_TABLE["osawa"])
    owners = len(set(setup.layer_owners.values()))
    lines = ["| strategy | most loaded rank MiB | all factors / 64 MiB |", "|---|---|---|"]
    for name in KFAC:
        memory = results["paper", "resnet50", name][0].factor_memory_bytes
        lines.append(f"| {name} | {_mib(memory)} | {_mib(total / WORKERS)} |")
    lines += [
        "",
        f"Every factor and inverse of ResNet-50 (float32 squares, as the real blocks store "
        f"them) is {_mib(total)} MiB; D-KFAC and SPD-KFAC hold all of it on every rank. "
        f"With one owner per layer ({len(workload.layers)} layers on {owners} of the "
        f"{WORKERS} ranks), the most loaded rank holds {largest.name} alone "
        f"({_mib(per_layer[largest.name])} MiB), {total / per_layer[largest.name]:.1f}x "
        f"less than every factor, not the {WORKERS}x of a perfect split: that layer's A "
        f"({largest.a_dim} x {largest.a_dim}) and its inverse alone take "
        f"{_mib(2 * 4 * largest.a_dim**2)} MiB, so no split by layer or by factor goes "
        "lower. Per-rank memory falls as 1/P only while P is below the number of layers "
        "of similar size.",
    ]
    return lines


def _findings(results: Results, workloads: dict[str, Workload], closed: Closed) -> list[str]:
    """What the tables say, with their numbers."""

    def ratio(preset: str, model: str, interval: tuple[int, int]) -> float:
        # SPD-KFAC's time over osawa-pipelined's (> 1: osawa-pipelined is faster).
        return _time(results, (preset, model, "spd-kfac"), interval) / _time(
            results, (preset, model, "osawa-pipelined"), interval
        )

    def ratios(interval: tuple[int, int]) -> str:
        faster = sum(ratio(p, m, interval) > 1 for p in PRESET_NAMES for m in MODELS)
        return f"faster in {faster} of {len(PRESET_NAMES) * len(MODELS)} cells; " + "; ".join(
            f"`{p}` " + ", ".join(f"{m} {ratio(p, m, interval):.2f}x" for m in MODELS)
            for p in PRESET_NAMES
        )

    d_kfac = _amortised(results["paper", "resnet50", "d-kfac"][1], 1, 1)[1]["InverseComp"]
    plan = prepare(
        WorkloadCosts(workloads["resnet50"], PRESETS["paper"](), WORKERS),
        STRATEGY_TABLE["osawa"],
    ).plan
    assert plan is not None
    lines = [
        "* **Every step** (factors and inverses refreshed each iteration), `osawa-pipelined` "
        f"against SPD-KFAC (SPD-KFAC's time over its): {ratios((1, 1))}. The fastest "
        "strategy per cell is in the table below. No inverse travels and each "
        f"owner inverts only its layers (ResNet-50: D-KFAC's {_ms(d_kfac)} ms of "
        f"inversions per rank, at most {_ms(max(plan.loads()))} ms predicted on the "
        "busiest owner). Pipelining matters as much as for SPD-KFAC: plain `osawa` "
        "(factors after backward) waits for its factor reduces."
    ]
    stale = []
    for model in MODELS:
        gather = _amortised(results["paper", model, "osawa-pipelined"][1], 100, 100)[1]
        local = _amortised(results["paper", model, "spd-kfac"][1], 100, 100)[1]
        stale.append(
            f"{model} {_ms(gather['GradComm'])} vs "
            f"{_ms(local['GradComm'] + local['Precondition'])} ms"
        )
    lines.append(
        "* **Where `osawa` loses: stale refreshes.** With factors and inverses refreshed "
        "every 10 or 100 steps most steps refresh nothing. SPD-KFAC then all-reduces the "
        "gradients and preconditions every layer locally from its replicated inverses; "
        "`osawa` still reduces each gradient bucket to its owners, all-reduces the KL sum "
        "and gathers every owner's preconditioned gradients: on every step, whatever the "
        "refresh interval, it pays for an exchange that SPD-KFAC only pays when it "
        "refreshes (100/100 on `paper`, GradComm of `osawa-pipelined` vs GradComm + "
        f"Precondition of SPD-KFAC: {'; '.join(stale)}). `osawa-pipelined` against "
        f"SPD-KFAC at 10/10: {ratios((10, 10))}; at 100/100: {ratios((100, 100))}. The "
        "factor and inverse memory is where `osawa` wins at any interval (table below)."
    )
    parts = []
    for preset in PRESET_NAMES:
        gat, grads = (closed[preset, "resnet50"][e] for e in ("gather", "gradients"))
        alpha = PRESETS[preset]().collective(CollectiveOp.REDUCE, WORKERS).choose(0)[1].alpha
        parts.append(
            f"on `{preset}` (start-up {1e3 * alpha:.2f} ms) the gather's {gat[1]:.0f} "
            f"broadcasts take {_ms(gat[3])} ms, {_ms(gat[4])} of it start-ups, "
            f"{gat[3] / gat[5]:.2f}x one all-gather of the same bytes; the gradients' "
            f"{grads[1]:.0f} reduces {_ms(grads[3])} ms, {_ms(grads[4])} of it start-ups, "
            f"{grads[3] / grads[5]:.2f}x one even ring reduce-scatter per bucket"
        )
    lines.append(
        "* **The per-owner exchanges pay start-ups.** One broadcast per owner and one "
        "reduce per owner per bucket move each chunk's bytes about once per link, "
        "whatever the other chunks' sizes, but each pays a whole collective's start-up. "
        "For ResNet-50, every step, " + "; ".join(parts) + " (closed forms below, without "
        "overlap). On `paper`, whose fitted broadcast start-up equals its all-reduce's, "
        "start-ups are most of both exchanges, paid on every step, refresh or not; on "
        "`eth10` they are a small share and the rest is bandwidth: a broadcast or reduce "
        "sends its n bytes across the nodes, a ring all-gather or reduce-scatter (N − 1)/N "
        "of them over N nodes. The even ring is out of reach: "
        "the chunks are uneven (the owner of the 4608-wide A receives most of its "
        "after-backward bucket), NCCL's reduce-scatter pads every chunk to the largest, "
        "far slower (table below), and an all-to-all sends the owner P − 1 copies."
    )
    return lines


#: (preset, model) → exchange → (buckets or owners, collectives, bytes, simulated s,
#: its start-ups s, alternatives s...): the gather's one all-gather; the reduce-scatters'
#: even ring and padded ring.
Closed = dict[tuple[str, str], dict[str, tuple[float, ...]]]


def _closed_forms(workloads: dict[str, Workload]) -> Closed:
    """Closed-form costs of ``osawa``'s exchanges at 64 workers, without overlap: each as
    simulated (one collective per owner, as the real code issues them) beside what one
    collective over the whole buffer would take."""
    closed: Closed = {}
    for preset in PRESET_NAMES:
        hardware = PRESETS[preset]()
        price = {op: hardware.collective(op, WORKERS) for op in CollectiveOp}

        def per_owner(op: CollectiveOp, sizes: list[float]) -> tuple[float, float]:
            """(total, start-ups) seconds of one ``op`` per size, one after another."""
            startup = sum(price[op].choose(n)[1].alpha for n in sizes)
            return sum(price[op].predict(n) for n in sizes), startup

        for model, workload in workloads.items():
            setup = prepare(WorkloadCosts(workload, hardware, WORKERS), STRATEGY_TABLE["osawa"])
            sizes = [nbytes for _, nbytes in gather_sizes(setup)]
            ag = price[CollectiveOp.ALL_GATHER].predict(sum(sizes))
            gather = (len(sizes), len(sizes), sum(sizes))
            closed[preset, model] = {
                "gather": (*gather, *per_owner(CollectiveOp.BROADCAST, sizes), ag)
            }
            rs = price[CollectiveOp.REDUCE_SCATTER]
            for exchange, buckets in scatter_chunks(setup).items():
                chunks = [n for bucket in buckets for n in bucket.values()]
                totals = [sum(bucket.values()) for bucket in buckets if bucket]
                padded = [WORKERS * max(bucket.values()) for bucket in buckets if bucket]
                closed[preset, model][exchange] = (
                    len(buckets),
                    len(chunks),
                    sum(chunks),
                    *per_owner(CollectiveOp.REDUCE, chunks),
                    sum(rs.predict(n) for n in totals),
                    sum(rs.predict(n) for n in padded),
                )
    return closed


def _closed_table(closed: Closed, exchanges: tuple[str, ...], header: str) -> list[str]:
    lines = [f"| preset | model | {header} |", "|---" * (header.count("|") + 3) + "|"]
    for (preset, model), costs in closed.items():
        for exchange in exchanges:
            count, collectives, nbytes, *seconds = costs[exchange]
            name = "" if len(exchanges) == 1 else f"{exchange} | {count:.0f} | "
            lines.append(
                f"| `{preset}` | {model} | {name}{collectives:.0f} | {_mib(nbytes)} | "
                + " | ".join(_ms(s) for s in seconds)
                + " |"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="markdown file to write")
    args = parser.parse_args()
    started = time.perf_counter()
    workloads = {
        model: workload_for(model, batch_size=PAPER_TABLE_III[model][0]) for model in MODELS
    }
    results = _run(workloads)
    closed = _closed_forms(workloads)
    sections: dict[str, list[str]] = {
        "What the projection says": _findings(results, workloads, closed),
        "Lowest predicted time per cell (K-FAC strategies; factor/inverse refresh interval)": [
            *_winners(results),
            "",
            "Each cell: the fastest strategy and how much faster it is than the runner-up.",
        ],
    }
    for preset in PRESET_NAMES:
        description = PRESETS[preset]().description
        sections[f"Iteration time at {WORKERS} workers on `{preset}`: {description}"] = [
            "Mean ms per iteration over the refresh cycle (factor/inverse steps); bold: "
            "lowest K-FAC strategy of the column. Memory: running factors and inverses on "
            "the rank holding the most.",
            "",
            *_times_table(results, preset),
        ]
        sections[f"Breakdown every step on `{preset}`, ms per iteration"] = [
            "Averaged over ranks; communication columns are the time ranks wait. `osawa`'s "
            "GradComm holds the wait for the gradient reduces and the gather of the "
            "preconditioned gradients; its InverseComm is the failure-flag all-reduce, "
            "where ranks wait for the slowest owner's inversions.",
            "",
            *_breakdown_table(results, preset),
        ]
    sections[f"ResNet-50 factor + inverse memory per rank at {WORKERS} workers"] = _memory(
        results, workloads["resnet50"]
    )
    sections["The per-owner exchanges in closed form"] = [
        "Costs of the preset's collectives at 64 workers, one after another, without "
        "overlap (the simulation overlaps them with compute and each other's waits). The "
        "gather: one broadcast per owner (simulated, as the real code does it) vs one "
        "all-gather of the same bytes.",
        "",
        *_closed_table(
            closed,
            ("gather",),
            "broadcasts | MiB | broadcasts ms | of which start-ups ms | one all-gather ms",
        ),
        "",
        "The reduce-scatters of every factor bucket (a factor step, `osawa`'s "
        "after-backward buckets) and of DDP's gradient buckets (every step): one reduce "
        "per owner with a non-empty chunk (simulated, as the real code does it), vs one "
        "ring reduce-scatter per bucket over even chunks (a lower bound no uneven split "
        "reaches) and over chunks padded to the bucket's largest (what NCCL's equal-chunk "
        "reduce-scatter needs). An all-to-all (not shown) sends each owner P − 1 copies.",
        "",
        *_closed_table(
            closed,
            ("factors", "gradients"),
            "exchange | buckets | reduces | MiB | reduces ms | of which start-ups ms | "
            "even ring ms | padded ring ms",
        ),
    ]
    lines = [
        "# Projection: Osawa et al.'s owner-computes K-FAC vs SPD-KFAC and D-KFAC, 64 workers",
        "",
        f"command: `python {' '.join(sys.argv)}` "
        f"({time.perf_counter() - started:.0f} s on this project's 2-core machine)  ",
        "Batch per worker: the SPD-KFAC paper's (ResNet-50 32, ResNet-152 8, DenseNet-201 "
        "16). Both presets use the SPD-KFAC paper's RTX 2080 Ti compute fit; only the "
        "network differs.",
        "",
    ]
    for title, table in sections.items():
        lines += [f"## {title}", "", *table, ""]
    text = "\n".join(lines) + "\n" + NOTES
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
