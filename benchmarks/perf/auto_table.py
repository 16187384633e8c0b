"""The ``strategy="auto"`` table of issue 19 from ``spdkfac bench --variants auto`` runs.

For each run (a cell: model, link, refresh intervals) it prints the fastest composition by
mean iteration time (refresh steps in their share), auto's mean and choice, auto over the
fastest, and auto against D-KFAC beside D-KFAC's IQR.

    python benchmarks/perf/auto_table.py benchmarks/reports/bench_auto_*/results.json
"""

from __future__ import annotations

import argparse
import sys

from spdkfac.bench.results import BenchResults, iteration_stats


def row(path: str) -> str:
    results = BenchResults.load(path)
    stats = {v.name: iteration_stats(v) for v in results.variants if v.name != "sgd"}
    auto = stats.pop("auto")
    fastest = min(stats, key=lambda name: stats[name].mean)
    d_kfac = stats["d-kfac"]
    chosen = next(v.plan for v in results.variants if v.name == "auto").split(" ")[1]
    settings = results.settings.get("factor/inverse update steps", "?")
    iqr = (d_kfac.q3 - d_kfac.q1) * 1e3
    return (
        f"| {results.model} | {results.link} | {settings} "
        f"| {fastest} {stats[fastest].mean * 1e3:.1f} "
        f"| {chosen} | {auto.mean * 1e3:.1f} | {auto.mean / stats[fastest].mean:.3f} "
        f"| {d_kfac.mean * 1e3:.1f} (IQR {iqr:.1f}) | {(auto.mean - d_kfac.mean) * 1e3:+.1f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="results.json of spdkfac bench runs")
    args = parser.parse_args(argv)
    print(
        "| model | link | factor/inverse steps | fastest (mean ms) | auto chose | auto mean ms "
        "| auto / fastest | d-kfac mean ms | auto − d-kfac ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for path in args.results:
        print(row(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
