"""Calibration: measurements on one and two ranks, the time budget, the plot, the CLI."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from distributed_helper import run_command, run_distributed
from spdkfac.calibrate import (
    Budget,
    CalibrationPlan,
    FactorWorkload,
    calibrate,
    describe_device,
    format_report,
    measure_collectives,
    measure_inverses,
    plot_calibration,
)
from spdkfac.cli import main
from spdkfac.comm import LocalCommunicator, TorchDistributedCommunicator
from spdkfac.costmodel import AlphaBetaModel, CalibrationFile

DIMS = (8, 16, 32)
SIZES = (4096, 65536)


def _tiny_model() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    return model, (torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,)))


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_single_process_calibration(tmp_path: Path) -> None:
    model, batch = _tiny_model()
    lines: list[str] = []
    calibration = calibrate(
        LocalCommunicator(),
        CalibrationPlan(dims=DIMS, sizes_bytes=SIZES, repeats=2, max_seconds=30),
        factors=FactorWorkload(model, batch),
        log=lines.append,
    )
    zero = AlphaBetaModel(0.0, 0.0)
    assert dict(calibration.communication) == {1: (zero, zero)}
    assert calibration.samples is not None
    assert [d for d, _ in calibration.samples.inverse] == list(DIMS)
    assert calibration.samples.allreduce == ()  # nothing to measure in a group of one
    assert calibration.factor is not None and set(calibration.factor.layers) == {"0", "3"}
    assert {s.kind for s in calibration.samples.factor} == {"A", "G"}
    for key in ("backend", "world_sizes", "device", "torch", "hostname", "date", "threads"):
        assert key in calibration.metadata, key
    assert calibration.metadata["backend"] == "local"
    assert "inverse" in calibration.metadata["fit_errors"]
    assert any("inverses" in line for line in lines)
    path = calibration.save(tmp_path / "one.json")
    assert CalibrationFile.load(path) == calibration
    report = format_report(calibration)
    assert "c0 + c2·d² + c3·d³" in report and "| 32 |" in report


def test_a_cpu_is_told_apart_by_family_model_and_stepping(tmp_path: Path) -> None:
    # Two processors; only the first block counts. A virtual machine's generic name alone
    # would not tell two CPUs apart.
    block = "processor\t: {0}\nmodel name\t: Intel(R) Xeon(R) Processor\ncpu family\t: 6\n"
    block += "model\t\t: 167\nstepping\t: {0}\n\n"
    info = tmp_path / "cpuinfo"
    info.write_text(block.format(1) + block.format(7))
    described = describe_device(torch.device("cpu"), cpuinfo=str(info))
    assert described.startswith(
        "Intel(R) Xeon(R) Processor (cpu family 6, model 167, stepping 1; "
    ), described
    assert described.endswith(" logical CPUs)")
    missing = describe_device(torch.device("cpu"), cpuinfo=str(tmp_path / "absent"))
    assert "stepping" not in missing and missing.endswith(" logical CPUs)")


def test_budget_skips_larger_items_and_says_so() -> None:
    budget = Budget(1e-9)
    samples = measure_inverses((32, 8, 16), repeats=1, budget=budget)
    assert [d for d, _ in samples] == [8]  # the smallest always runs; the rest do not fit
    assert len(budget.notes) == 1 and "[16, 32]" in budget.notes[0]
    assert "--max-seconds" in budget.notes[0]
    with pytest.raises(ValueError, match="max_seconds"):
        Budget(0.0)


def test_measure_collectives_on_one_rank_rounds_to_whole_elements() -> None:
    measured = measure_collectives(LocalCommunicator(), (4097, 16), repeats=1)
    assert [b for b, _ in measured.allreduce] == [16, 4096]
    assert [b for b, _ in measured.broadcast] == [16, 4096]
    assert all(t > 0 for _, t in measured.allreduce + measured.broadcast)
    with pytest.raises(ValueError, match="repeats"):
        measure_collectives(LocalCommunicator(), (16,), repeats=0)


def _two_rank_worker(rank: int, world_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    torch.set_num_threads(1)
    comm = TorchDistributedCommunicator()
    model, batch = _tiny_model()
    plan = CalibrationPlan(dims=DIMS, sizes_bytes=SIZES, repeats=2, max_seconds=30)
    full = calibrate(comm, plan, factors=FactorWorkload(model, batch))
    # A budget that runs out at once: every rank must skip the same items (no hang).
    starved = calibrate(
        comm, CalibrationPlan(dims=DIMS, sizes_bytes=SIZES, repeats=1, max_seconds=1e-6)
    )
    return full.to_json(), starved.to_json()


def test_two_rank_calibration_agrees_on_every_rank() -> None:
    results = run_distributed(_two_rank_worker, 2, timeout=60)
    (full0, starved0), (full1, starved1) = results
    for document in (full0, full1, starved0, starved1):
        del document["metadata"]  # dates and command lines may differ by rank
    assert full0 == full1  # rank 0's timings everywhere
    assert starved0 == starved1
    assert set(full0["communication"]) == {"2"}
    assert [b for b, _ in full0["samples"]["allreduce"]] == list(SIZES)
    assert [d for d, _ in full0["samples"]["inverse"]] == list(DIMS)
    assert all(t > 0 for _, t in full0["samples"]["broadcast"])
    assert len(starved0["samples"]["allreduce"]) == 1 and len(starved0["samples"]["inverse"]) == 1


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    model, batch = _tiny_model()
    calibration = calibrate(
        LocalCommunicator(),
        CalibrationPlan(dims=DIMS, sizes_bytes=SIZES, repeats=1),
        factors=FactorWorkload(model, batch),
    )
    png = tmp_path / "fit.png"
    assert plot_calibration(calibration, None, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_prints_a_notice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now fails
    plan = CalibrationPlan(dims=(8, 16), sizes_bytes=SIZES, repeats=1)
    calibration = calibrate(LocalCommunicator(), plan)
    assert not plot_calibration(calibration, calibration.samples, tmp_path / "fit.png")
    assert "matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "fit.png").exists()


def test_cli_calibrate_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cal.json"
    args = ["calibrate", "--out", str(out), "--dims", "8,16,32", "--repeats", "1"]
    args += ["--model", "mlp", "--batch-size", "4", "--input-size", "8", "--in-channels", "1"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "median rel. error" in printed and f"wrote {out}" in printed
    calibration = CalibrationFile.load(out)
    assert calibration.factor is not None and calibration.metadata["model"] == "mlp"
    assert out.with_suffix(".png").exists() == ("wrote " + str(out.with_suffix(".png")) in printed)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--dims", "0,64"),
        ("--dims", "a,b"),
        ("--sizes", "4XB"),
        ("--repeats", "0"),
        ("--max-seconds", "-1"),
        ("--method", "lu"),
        ("--model", "nonexistent"),
    ],
)
def test_cli_bad_flags_exit_2(flag: str, value: str) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["calibrate", flag, value])
    assert caught.value.code == 2


def test_cli_bad_output_directory_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["calibrate", "--out", str(tmp_path / "missing" / "x.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_bad_flag_exit_code_in_a_subprocess() -> None:
    result = run_command(
        [sys.executable, "-m", "spdkfac", "calibrate", "--sizes", "4KB,lots"], timeout=60
    )
    assert result.returncode == 2
    assert "--sizes" in result.stderr and "lots" in result.stderr


@pytest.mark.parametrize(
    ("plan", "world_size", "message"),
    [(CalibrationPlan(dims=(), sizes_bytes=SIZES), 1, "dims"),
     (CalibrationPlan(dims=(0, 8), sizes_bytes=SIZES), 1, "dims"),
     (CalibrationPlan(dims=DIMS, sizes_bytes=SIZES, repeats=0), 1, "repeats"),
     (CalibrationPlan(dims=DIMS, sizes_bytes=(2,)), 2, "sizes_bytes")],
)  # fmt: skip
def test_an_unusable_plan_is_refused_before_any_measurement(
    plan: CalibrationPlan, world_size: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plan.check(world_size)
    if world_size == 1:
        with pytest.raises(ValueError, match=message):
            calibrate(LocalCommunicator(), plan)
    CalibrationPlan(dims=DIMS, sizes_bytes=(2,)).check(1)  # one rank times no collectives
