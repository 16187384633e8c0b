"""The measured link: its numbers, label and JSON, the report's section, the CLI's order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from distributed_helper import run_distributed
from spdkfac.bench import linkprobe
from spdkfac.bench.link import LinkMeasurement, MeasuredLink, format_bytes
from spdkfac.bench.netns import Cluster, link_shape
from spdkfac.bench.report import format_report, record_link, write_outputs
from spdkfac.bench.results import BenchResults, VariantResult
from spdkfac.cli import bench as bench_cli
from spdkfac.cli import main
from spdkfac.comm import LocalCommunicator, init_distributed

_SIZES = (4096, 65536, 1 << 20, 16 << 20)


def _measurement(alpha: float = 5e-4, beta: float = 8e-9, world_size: int = 2) -> LinkMeasurement:
    # Exactly α + β·n, so the fit must give α and β back.
    allreduce = tuple((n, alpha + beta * n) for n in _SIZES)
    broadcast = tuple((n, alpha / 2 + beta * n) for n in _SIZES)
    return LinkMeasurement(world_size=world_size, allreduce=allreduce, broadcast=broadcast)


def test_rates_and_fit_of_a_measurement() -> None:
    measured = _measurement()
    assert measured.allreduce_fit.alpha == pytest.approx(5e-4, rel=1e-6)
    assert measured.allreduce_fit.beta == pytest.approx(8e-9, rel=1e-6)
    assert measured.broadcast_fit.alpha == pytest.approx(2.5e-4, rel=1e-6)
    seconds = 5e-4 + 8e-9 * (16 << 20)
    assert measured.large_message_bytes == 16 << 20
    assert measured.gigabytes_per_second == pytest.approx((16 << 20) / seconds / 1e9)
    assert measured.gigabits_per_second == pytest.approx(8 * measured.gigabytes_per_second)
    assert measured.bus_gigabytes_per_second == pytest.approx(measured.gigabytes_per_second)
    four = _measurement(world_size=4)
    assert four.bus_gigabytes_per_second == pytest.approx(1.5 * four.gigabytes_per_second)


def test_label_quotes_the_measurement_and_the_rate_only_as_the_setting() -> None:
    link = MeasuredLink(link_shape("1gbit"), _measurement())
    assert link.label() == (
        "emulated (tbf setting 1gbit): measured 0.125 GB/s (1.00 Gbit/s) for a 16 MiB "
        "all-reduce, α 0.500 ms, β 8.00 ns/B"
    )
    slower = MeasuredLink(link.shape, link.before, after=_measurement(beta=1e-8))
    assert slower.label().endswith("β 8.00 ns/B; 0.100 GB/s after the run")
    four = MeasuredLink(link.shape, _measurement(world_size=4))
    assert "all-reduce, ring bus bandwidth 0.187 GB/s, α" in four.label()


def test_measurement_json_round_trip() -> None:
    link = MeasuredLink(link_shape("1gbit"), _measurement(), after=_measurement(beta=9e-9))
    data = json.loads(json.dumps(link.to_json()))
    assert data["before"]["gigabytes_per_second"] == pytest.approx(link.before.gigabytes_per_second)
    assert data["before"]["allreduce_fit"]["beta_seconds_per_byte"] == pytest.approx(8e-9)
    assert MeasuredLink.from_json(data) == link
    alone = MeasuredLink(link.shape, link.before)
    assert MeasuredLink.from_json(json.loads(json.dumps(alone.to_json()))) == alone


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 1}, "world_size must be >= 2"),
        ({"allreduce": ()}, "allreduce must hold at least one"),
        ({"broadcast": ((4096, 0.0),)}, "broadcast needs bytes > 0 and seconds > 0"),
    ],
)
def test_bad_measurements_are_refused(kwargs: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"world_size": 2, "allreduce": ((4096, 1e-3),),
                              "broadcast": ((4096, 1e-3),)}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        LinkMeasurement(**{**fields, **kwargs})


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(4096, "4 KiB"), (16 << 20, "16 MiB"), (1 << 30, "1 GiB"), (1000, "1000 B")],
)
def test_format_bytes(nbytes: int, text: str) -> None:
    assert format_bytes(nbytes) == text


def _results(link: MeasuredLink | None = None) -> BenchResults:
    times = ((0.2, 0.1, 0.1), (0.2, 0.1, 0.1))
    return BenchResults(
        command="spdkfac bench --link 1gbit",
        model="mlp",
        world_size=2,
        batch_size=32,
        link="emulated 1gbit" if link is None else link.label(),
        variants=(VariantResult("sgd", times, warmup=1, breakdown={"FF&BP": 0.05}),),
        link_measurement={} if link is None else link.to_json(),
    )


def test_report_shows_the_link_table_only_when_measured() -> None:
    assert "## Link" not in format_report(_results())
    link = MeasuredLink(link_shape("1gbit"), _measurement(), after=_measurement(beta=1e-8))
    report = format_report(_results(link))
    assert report.startswith(f"# spdkfac bench: mlp, 2 rank(s) x batch 32, link {link.label()}")
    section = report.split("## Link", 1)[1].split("##", 1)[0]
    assert "`tbf rate 1gbit burst 62500 latency 50ms` (burst = 0.50 ms" in section
    assert (
        "| message | all-reduce before | all-reduce after | broadcast before | broadcast after |"
        in section
    )
    # 16 MiB: 0.5 ms + 134.2 ms before, + 167.8 ms after; broadcast α is half.
    assert "| 16 MiB | 134.718 ms (0.125 GB/s) | 168.272 ms (0.100 GB/s) | 134.468 ms" in section
    assert "| α-β fit | α 0.500 ms, β 8.00 ns/B | α 0.500 ms, β 10.00 ns/B | α 0.250 ms" in section
    without_after = format_report(_results(MeasuredLink(link.shape, link.before)))
    assert "| message | all-reduce before | broadcast before |" in without_after
    assert "just before the benchmark:" in without_after


def test_results_json_keeps_the_link_measurement(tmp_path: Path) -> None:
    link = MeasuredLink(link_shape("1gbit"), _measurement())
    results = _results(link)
    loaded = BenchResults.load(results.save(tmp_path / "results.json"))
    assert loaded == results
    assert MeasuredLink.from_json(loaded.link_measurement) == link
    assert (
        BenchResults.from_json({**_results().to_json(), "link_measurement": None}).link_measurement
        == {}
    )


def test_record_link_rewrites_results_and_report(tmp_path: Path) -> None:
    write_outputs(_results(), {}, tmp_path, trace_iterations=2, log=lambda _: None)
    had_png = "](breakdown.png)" in (tmp_path / "report.md").read_text()
    link = MeasuredLink(link_shape("1gbit"), _measurement(), after=_measurement(beta=9e-9))
    report = record_link(tmp_path, link)
    text = report.read_text()
    assert f"link {link.label()}" in text.splitlines()[0]
    assert "## Link" in text and ("](breakdown.png)" in text) == had_png
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["link"] == link.label()
    assert saved["link_measurement"]["after"]["gigabytes_per_second"] == pytest.approx(
        link.after.gigabytes_per_second if link.after else 0.0
    )
    with pytest.raises(FileNotFoundError):
        record_link(tmp_path / "missing", link)


def _measure_on_rank(rank: int, world_size: int) -> dict[str, Any]:
    comm = init_distributed("gloo")
    return linkprobe.measure_link(comm, sizes=(4096, 65536), repeats=1).to_json()


def test_measure_link_on_two_gloo_ranks() -> None:
    first, second = run_distributed(_measure_on_rank, 2, timeout=60)
    assert first == second  # every rank returns the slowest rank's medians
    measured = LinkMeasurement.from_json(first)
    assert measured.world_size == 2
    assert [n for n, _ in measured.allreduce] == [4096, 65536]
    assert [n for n, _ in measured.broadcast] == [4096, 65536]


def test_measure_link_needs_two_ranks() -> None:
    with pytest.raises(ValueError, match="needs >= 2 ranks, got world size 1"):
        linkprobe.measure_link(LocalCommunicator())


def _fake_cluster() -> Cluster:
    return Cluster(("ns0", "ns1"), ("v0", "v1"), ("10.0.0.1", "10.0.0.2"), link_shape("1gbit"))


class _FakeClusterContext:
    def __enter__(self) -> Cluster:
        return _fake_cluster()

    def __exit__(self, *exc: object) -> None:
        return None


def _patch_link_run(
    monkeypatch: pytest.MonkeyPatch, probes: list[LinkMeasurement | None], code: int = 0
) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(bench_cli, "available", lambda: True)
    monkeypatch.setattr(bench_cli, "emulated_cluster", lambda ranks, rate: _FakeClusterContext())

    def probe(cluster: Cluster, *, timeout: float, port: int = 0) -> LinkMeasurement | None:
        calls.append(("probe", timeout))
        return probes.pop(0)

    def launch(flags: list[str], *, nproc: int, cluster: Cluster, timeout: float) -> int:
        calls.append(("launch", flags[flags.index("--link-label") + 1]))
        return code

    def record(out_dir: str, link: MeasuredLink) -> Path:
        calls.append(("record", link))
        return Path(out_dir) / "report.md"

    monkeypatch.setattr(bench_cli, "probe_cluster", probe)
    monkeypatch.setattr(bench_cli, "launch_ranks", launch)
    monkeypatch.setattr(bench_cli, "record_link", record)
    return calls


def test_link_runs_measure_before_and_after_and_record_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    before, after = _measurement(), _measurement(beta=9e-9)
    calls = _patch_link_run(monkeypatch, [before, after])
    assert main(["bench", "--link", "1gbit", "--timeout", "600"]) == 0
    assert [name for name, _ in calls] == ["probe", "launch", "probe", "record"]
    assert calls[0][1] == 120.0  # a probe gets at most two minutes
    expected = MeasuredLink(link_shape("1gbit"), before)
    assert calls[1][1] == expected.label()  # the ranks label the report with it
    assert calls[3][1] == MeasuredLink(expected.shape, before, after)


def test_link_runs_stop_when_the_link_cannot_be_measured(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = _patch_link_run(monkeypatch, [None])
    assert main(["bench", "--link", "1gbit"]) == 1
    assert [name for name, _ in calls] == ["probe"]
    assert "could not measure the emulated link" in capsys.readouterr().err


def test_a_failed_benchmark_is_not_measured_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _patch_link_run(monkeypatch, [_measurement()], code=3)
    assert main(["bench", "--link", "1gbit"]) == 3
    assert [name for name, _ in calls] == ["probe", "launch"]


def test_a_failed_second_probe_still_records_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _measurement()
    calls = _patch_link_run(monkeypatch, [before, None])
    assert main(["bench", "--link", "1gbit"]) == 0
    assert calls[-1] == ("record", MeasuredLink(link_shape("1gbit"), before))
