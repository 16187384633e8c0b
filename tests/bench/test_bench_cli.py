"""``spdkfac bench`` end to end on two local ranks, and its argument errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spdkfac.bench.runner import BenchOptions, run_worker
from spdkfac.cli import bench as bench_cli
from spdkfac.cli import main


def _bench(
    argv: list[str], out: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> tuple[str, str]:
    """Run ``spdkfac bench`` as launched by hand (no torchrun environment): its report and
    standard error."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    code = main(argv)
    result = capfd.readouterr()
    assert code == 0, result.err[-3000:]
    return (out / "report.md").read_text(), result.err


def test_two_ranks_end_to_end(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    # The launcher runs here (one interpreter fewer to start); it starts the two ranks.
    argv = [
        "bench", "--model", "mlp", "--iters", "4", "--warmup", "1", "--chunk", "2",
        "--variants", "sgd,d-kfac,spd-kfac", "--nproc", "2", "--out-dir", str(out),
        "--timeout", "120",  # the launcher kills every rank after that
        # An 8x8 input keeps the MLP's first factor at 193 (3073 at 32x32 costs ~10 s here).
        "--input-size", "8", "--factor-examples", "16",
        "--no-flush-denormal",  # a bool reaches the ranks too
    ]  # fmt: skip
    report, err = _bench(argv, out, monkeypatch, capfd)
    assert report.startswith("# spdkfac bench: mlp, 2 rank(s) x batch 32, link loopback")
    assert "--variants sgd,d-kfac,spd-kfac" in report.splitlines()[2]
    for name in ("sgd", "d-kfac", "spd-kfac"):
        assert f"| {name} |" in report.split("## Iteration time")[1].split("##")[0]
        trace = json.loads((out / "traces" / f"{name}.json").read_text())
        ranks = {e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X"}
        assert ranks == {0, 1}
    results = json.loads((out / "results.json").read_text())
    assert [v["name"] for v in results["variants"]] == ["sgd", "d-kfac", "spd-kfac"]
    assert results["settings"]["SGD"].endswith("statistics from 16 examples per rank")
    assert results["machine"]["subnormal floats"] == "kept"
    for variant in results["variants"]:
        assert len(variant["times"]) == 2 and all(len(t) == 4 for t in variant["times"])
        assert variant["breakdown"]["FF&BP"] > 0
    assert results["variants"][0]["breakdown"]["GradComm"] > 0  # the DDP hook's window
    assert results["variants"][1]["breakdown"]["FactorComm"] > 0
    assert "bench [" in err  # rank 0's progress bar


def test_two_ranks_under_fsdp2(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--layout fsdp``: SGD, spd-kfac and osawa rows with every variant's model sharded
    by FSDP2 (the report and results.json say so; no DDP bucket is timed)."""
    out = tmp_path / "out"
    argv = [
        "bench", "--model", "mlp", "--iters", "3", "--warmup", "1", "--chunk", "2",
        "--variants", "sgd,spd-kfac,variant:osawa", "--nproc", "2", "--out-dir", str(out),
        "--timeout", "120", "--input-size", "8", "--factor-examples", "16",
        "--layout", "fsdp",
    ]  # fmt: skip
    report, _ = _bench(argv, out, monkeypatch, capfd)
    assert report.startswith("# spdkfac bench: mlp, 2 rank(s) x batch 32 under FSDP2, link")
    assert "sharded by FSDP2" in report and "--layout fsdp" in report.splitlines()[2]
    results = json.loads((out / "results.json").read_text())
    assert results["layout"] == "fsdp"
    assert [v["name"] for v in results["variants"]] == ["sgd", "spd-kfac", "osawa"]
    for variant in results["variants"]:
        assert len(variant["times"]) == 2 and all(len(t) == 3 for t in variant["times"])
        assert variant["breakdown"]["FF&BP"] > 0
    sgd, spd, osawa = (variant["breakdown"] for variant in results["variants"])
    assert sgd["GradComm"] == spd["GradComm"] == 0  # FSDP2's reduce-scatters: in backward
    assert osawa["GradComm"] > 0  # the owners' reduce-scatter and the return of results
    assert spd["FactorComm"] > 0


@pytest.mark.parametrize(
    "flags",
    [
        ["--iters", "0"],
        ["--layout", "fsdp2"],
        ["--nproc", "1", "--layout", "fsdp"],
        ["--iters", "3", "--warmup", "3"],
        ["--variants", "sgd,adam"],
        ["--variants", ""],
        ["--model", "vgg"],
        ["--link", "fast"],
        ["--nproc", "1", "--link", "1gbit"],
        ["--bogus"],
    ],
)
def test_bad_flags_exit_with_code_2(
    flags: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as info:
        main(["bench", *flags])
    assert info.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_link_without_root_says_so_and_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(bench_cli, "available", lambda: False)
    assert main(["bench", "--link", "1gbit"]) == 2
    assert "needs root" in capsys.readouterr().err


def test_an_out_dir_that_is_a_file_exits_2_before_any_rank_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 39 item 7: the benchmark ran to its end, then raised FileExistsError."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    launched: list[object] = []
    monkeypatch.setattr(bench_cli, "launch_ranks", lambda *a, **k: launched.append(a) or 0)
    monkeypatch.setattr(bench_cli, "run_worker", lambda *a, **k: launched.append(a) or 0)
    file = tmp_path / "file"
    file.write_text("x")
    for out in (file, file / "run"):
        with pytest.raises(SystemExit) as info:
            main(["bench", "--out-dir", str(out)])
        assert info.value.code == 2
        assert capsys.readouterr().err.strip().endswith("is not a directory")
    assert launched == []


def test_missing_cost_model_file_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "costs.json"
    assert main(["bench", "--cost-model", str(missing)]) == 1
    assert str(missing) in capsys.readouterr().err


def test_bench_options_refuse_an_unknown_layout_and_fsdp_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The library's checks, for callers that skip the CLI: before any collective."""
    with pytest.raises(ValueError, match="layout must be one of ddp, fsdp, got 'fsdp2'"):
        BenchOptions(layout="fsdp2")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="layout 'fsdp' needs at least 2 ranks"):
        run_worker(BenchOptions(layout="fsdp", model="mlp", iters=2, warmup=1))
