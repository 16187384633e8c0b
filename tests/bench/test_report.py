"""The report writer on a synthetic run: tables, ratios, Fig. 10 percentages, files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spdkfac.bench.report import format_report, last_iterations, write_outputs
from spdkfac.bench.results import (
    BenchResults,
    VariantResult,
    exposed_factor_comm,
    iteration_stats,
    ratio_to,
)
from spdkfac.profiling import BREAKDOWN_CATEGORIES, Event


def _variant(name: str, seconds: float, factor_comm: float = 0.0) -> VariantResult:
    # Warm-up 1 (a slow first iteration); rank 1 is slower in the last iteration only, so
    # the per-iteration maximum is [s, s, s + 0.01] with median s.
    times = ((9.0, seconds, seconds, seconds), (9.0, seconds, seconds, seconds + 0.01))
    breakdown = dict.fromkeys(BREAKDOWN_CATEGORIES, 0.0)
    breakdown.update({"FF&BP": 0.05, "FactorComm": factor_comm})
    return VariantResult(name, times, warmup=1, breakdown=breakdown, plan=f"plan of {name}")


def _results() -> BenchResults:
    return BenchResults(
        command="spdkfac bench --model mlp",
        model="mlp",
        world_size=2,
        batch_size=32,
        link="loopback",
        variants=(
            _variant("sgd", 0.100),
            _variant("d-kfac", 0.400, factor_comm=0.080),
            _variant("mpd-kfac", 0.500, factor_comm=0.080),
            _variant("spd-kfac", 0.300, factor_comm=0.015),
            _variant("placement-only", 0.350, factor_comm=0.060),
            _variant("pipelining-only", 0.320, factor_comm=0.030),
        ),
        settings={"chunk": "5"},
        machine={"torch": "x"},
        cost_model={"source": "test"},
        factor_unpack=0.010,
    )


def _row(report: str, name: str, section: str) -> list[str]:
    body = report.split(section, 1)[1]
    line = next(line for line in body.splitlines() if line.startswith(f"| {name} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_statistics_use_the_slowest_rank_after_warmup() -> None:
    stats = iteration_stats(_results().variants[0])
    assert stats.count == 3
    assert stats.median == pytest.approx(0.100)
    assert stats.q1 == pytest.approx(0.100)
    assert stats.q3 == pytest.approx(0.105)  # linear interpolation between 0.10 and 0.11


def test_ratios() -> None:
    results = _results()
    assert ratio_to(results, "spd-kfac", "sgd") == pytest.approx(3.0)
    assert ratio_to(results, "spd-kfac", "d-kfac") == pytest.approx(0.75)
    assert ratio_to(results, "spd-kfac", "fusion:optimal") is None


def test_time_table_rows() -> None:
    report = format_report(_results())
    assert _row(report, "sgd", "## Iteration time") == [
        "sgd", "100.0", "100.0–105.0", "103.3", "3", "1.00", "0.250", "4.00",
    ]  # fmt: skip
    assert _row(report, "spd-kfac", "## Iteration time") == [
        "spd-kfac", "300.0", "300.0–305.0", "303.3", "3", "3.00", "0.750", "1.33",
    ]  # fmt: skip
    assert _row(report, "d-kfac", "## Iteration time")[5:] == ["4.00", "1.000", "1.00"]


def test_fig10_percentages_hidden_against_the_after_backward_twin() -> None:
    rows = {row.name: row for row in exposed_factor_comm(_results())}
    assert set(rows) == {"d-kfac", "mpd-kfac", "spd-kfac", "placement-only", "pipelining-only"}
    assert rows["spd-kfac"].baseline == "placement-only"
    assert rows["spd-kfac"].hidden_percent == pytest.approx(75.0)
    assert rows["spd-kfac"].reduction == pytest.approx(4.0)
    assert rows["pipelining-only"].baseline == "d-kfac"
    assert rows["pipelining-only"].hidden_percent == pytest.approx(62.5)
    assert rows["d-kfac"].hidden_percent == pytest.approx(0.0)
    # Without the 10 ms of unpacking: 5 ms against 50 ms, and 20 ms against 70 ms.
    assert rows["spd-kfac"].communication == pytest.approx(0.005)
    assert rows["spd-kfac"].hidden_communication_percent == pytest.approx(90.0)
    assert rows["pipelining-only"].hidden_communication_percent == pytest.approx(100 * 5 / 7)
    report = format_report(_results())
    section = "## Exposed factor communication"
    assert _row(report, "spd-kfac", section) == [
        "spd-kfac", "optimal", "balanced", "15.0", "placement-only", "75.0%", "4.00", "5.0",
        "90.0%",
    ]  # fmt: skip
    assert _row(report, "pipelining-only", section)[3:] == [
        "30.0", "d-kfac", "62.5%", "2.67", "20.0", "71.4%",
    ]  # fmt: skip
    assert "10.0 ms per step on rank 0" in report
    assert "hides 75.0% of placement-only's exposed factor communication (90.0%" in report
    assert "SPD-KFAC is 1.33x as fast as D-KFAC" in report and "**met**" in report


def test_breakdown_table_and_header() -> None:
    report = format_report(_results(), png="breakdown.png", traces="traces")
    assert report.startswith("# spdkfac bench: mlp, 2 rank(s) x batch 32, link loopback")
    assert "command: `spdkfac bench --model mlp`" in report
    row = _row(report, "d-kfac", "## Breakdown")
    assert row[1] == "50.0" and row[4] == "80.0" and row[-1] == "130.0"
    assert "![breakdown per variant](breakdown.png)" in report
    assert "`traces/d-kfac.json`" in report


def test_without_a_baseline_the_fig10_cells_are_dashes() -> None:
    lone = BenchResults("c", "mlp", 2, 8, "loopback", (_variant("spd-kfac", 0.3, 0.01),))
    assert _row(format_report(lone), "spd-kfac", "## Exposed")[4:] == [
        "—", "—", "—", "10.0", "—",
    ]  # fmt: skip
    assert "## Goals" not in format_report(lone)


def test_last_iterations_keeps_every_ranks_tail() -> None:
    events = [
        Event("kfac/iteration/all", rank, start + rank * 0.01, 0.5)
        for rank in (0, 1)
        for start in (0.0, 1.0, 2.0)
    ] + [Event("kfac/factor_comm/wait", 1, 1.2, 0.1), Event("kfac/factor_comm/wait", 0, 0.2, 0.1)]
    kept = last_iterations(events, 2)
    assert sorted((e.rank, e.start) for e in kept if e.phase == "iteration") == [
        (0, 1.0), (0, 2.0), (1, 1.01), (1, 2.01),
    ]  # fmt: skip
    assert [e.rank for e in kept if e.phase == "factor_comm"] == [1]


def test_write_outputs_round_trip(tmp_path: Path) -> None:
    results = _results()
    events = {"sgd": [Event("kfac/iteration/all", 0, 1.0, 0.1)]}
    report = write_outputs(results, events, tmp_path, trace_iterations=5, log=lambda _: None)
    assert report.read_text().count("| spd-kfac |") == 3  # time, breakdown, Fig. 10
    assert BenchResults.load(tmp_path / "results.json") == results
    trace = json.loads((tmp_path / "traces" / "sgd.json").read_text())
    assert any(e.get("name") == "kfac/iteration/all" for e in trace["traceEvents"])
    pytest.importorskip("matplotlib")
    assert (tmp_path / "breakdown.png").read_bytes()[:4] == b"\x89PNG"
