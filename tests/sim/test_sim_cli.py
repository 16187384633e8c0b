"""``spdkfac simulate``: JSON schema, reports, traces and argument errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from process_helper import run_command
from spdkfac.cli.main import main
from spdkfac.profiling import BREAKDOWN_CATEGORIES


def test_json_is_keyed_by_strategy(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace, out = tmp_path / "trace.json", tmp_path / "report.md"
    code = main(
        [
            "simulate", "--model", "resnet20", "--workers", "2,4", "--preset", "cpu",
            "--batch-size", "8", "--json", "--trace", str(trace), "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    assert list(document) == ["d-kfac", "mpd-kfac", "spd-kfac", "placement-only", "pipelining-only"]
    for value in document.values():
        assert list(value) == ["runs"]  # no run's fields at the strategy's top level
        assert [run["workers"] for run in value["runs"]] == [2, 4]
        for entry in value["runs"]:
            assert entry["iteration_s"] > 0
            assert set(entry["breakdown"]) == set(BREAKDOWN_CATEGORIES)
            total = sum(entry["breakdown"].values())
            assert total == pytest.approx(entry["iteration_s"], rel=1e-9)
            assert entry["model"] == "resnet20" and entry["batch_size"] == 8
        # Each run its own numbers: 2 and 4 workers differ.
        assert value["runs"][0]["iteration_s"] != value["runs"][1]["iteration_s"]
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"kfac/forward_backward/all", "kfac/factor_comm/wait", "kfac/iteration/all"} <= names
    assert "| 4 | spd-kfac |" in out.read_text()


def test_runtime_knobs_change_the_result(capsys: pytest.CaptureFixture[str]) -> None:
    base = [
        "simulate",
        "--model",
        "resnet20",
        "--workers",
        "8",
        "--json",
        "--strategies",
        "spd-kfac",
    ]
    times = []
    for extra in ([], ["--overlap", "0"], ["--single-queue"]):
        assert main([*base, *extra]) == 0
        times.append(json.loads(capsys.readouterr().out)["spd-kfac"]["runs"][0]["iteration_s"])
    assert times[1] > times[0] and times[2] >= times[0]


def test_markdown_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--model", "mlp", "--workers", "2", "--strategies", "sgd,spd-kfac"])
    assert code == 0
    text = capsys.readouterr().out
    assert text.startswith("# spdkfac simulate") and "| 2 | spd-kfac |" in text


@pytest.mark.parametrize(
    "flags",
    [
        ["--workers", "0"],
        ["--workers", "two"],
        ["--preset", "tpu"],
        ["--strategies", "k-fac"],
        ["--model", "no-such-net"],
        ["--factor-update-steps", "0"],
        ["--overlap", "1.5"],
        ["--comm-scheduler", "lifo"],
        ["--unknown-flag"],
    ],
)
def test_bad_flags_exit_2(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["simulate", *flags])
    assert raised.value.code == 2
    assert "error" in capsys.readouterr().err


def test_missing_cost_model_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["simulate", "--model", "mlp", "--cost-model", str(tmp_path / "none.json")])
    assert code == 1
    assert "none.json" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--trace", "--out"])
@pytest.mark.parametrize("where", ["directory", "top-level directory", "under a file", "missing"])
def test_output_paths_that_cannot_be_written_exit_2_in_one_line(
    flag: str, where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 39 item 7: a directory as --trace or --out was a traceback (IsADirectoryError),
    and a top-level one had the trace's temporary file written into its parent."""
    file = tmp_path / "file"
    file.write_text("x")
    paths = {"directory": tmp_path, "top-level directory": Path(tmp_path.anchor),
             "under a file": file / "x.json", "missing": tmp_path / "none" / "x.json"}  # fmt: skip
    path = paths[where]
    code = main(["simulate", "--model", "mlp", "--workers", "2", "--preset", "cpu",
                 "--strategies", "d-kfac", flag, str(path)])  # fmt: skip
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"spdkfac simulate: error: {flag} {path}: ")
    if path.parent.is_dir():  # no temporary file left beside it
        assert not list(path.parent.glob(f".{path.name}.*.tmp"))


def test_module_entry_point() -> None:
    result = run_command(
        [sys.executable, "-m", "spdkfac", "simulate", "--model", "mlp", "--workers", "2",
         "--preset", "cpu", "--json", "--strategies", "d-kfac"],
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert list(json.loads(result.stdout)) == ["d-kfac"]
