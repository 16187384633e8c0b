"""benchmarks/gpu/gpu_check.sh and gpu_check.py: the dry run on the CPU writes every section
(the device run's command, kept working), and one failing section loses no other."""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from process_helper import run_command
from spdkfac.costmodel import CalibrationFile

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import gpu_check  # noqa: E402
import gpu_check_measure  # noqa: E402


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


def test_the_dry_run_writes_every_section(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT / "src")}  # fmt: skip
    result = run_command(["bash", str(ROOT / "benchmarks" / "gpu" / "gpu_check.sh"), "--dry-run"],
                         timeout=240, env=env)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    suite = ET.parse(tmp_path / "device_tests.xml").getroot().find("testsuite")
    assert suite is not None and int(suite.get("failures", "1")) == 0
    assert int(suite.get("tests", "0")) > int(suite.get("skipped", "0"))  # CPU cases ran
    assert _json(tmp_path / "environment.json")["dry_run"] is True
    kernels = _json(tmp_path / "factor_kernels.json")
    assert {(row["model"], row["dtype"]) for row in kernels} == {
        (model, dtype) for model in ("resnet20", "gpt") for dtype in ("float32", "bfloat16")
    }
    assert all(row["seconds"] > 0 and row["mm_seconds"] > 0 and row["rows"] > 0 for row in kernels)
    steps = _json(tmp_path / "training_steps.json")
    assert [(row["model"], row["variant"]) for row in steps] == [
        (model, variant)
        for model in ("resnet20", "gpt")
        for variant in ("plain", "kfac 1/1", "kfac 2/4")
    ]
    calibration = CalibrationFile.load(tmp_path / "costmodel_cpu.json")
    assert calibration.samples is not None and calibration.samples.inverse
    sim = _json(tmp_path / "sim_compute.json")
    assert sim["device"]["gemm_flops_per_second"] > 0 and sim["inverse"] and sim["factor"]
    report = (tmp_path / "gpu_check.md").read_text()
    assert "## Factor kernels" in report and "## Training steps" in report


def test_a_failing_section_is_recorded_and_the_others_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> object:
        raise RuntimeError("injected")

    steps = [{"model": "m", "variant": v, "steps": 2, "mean_seconds": s, "median_seconds": s}
             for v, s in (("plain", 0.1), ("kfac 1/1", 0.3))]  # fmt: skip
    monkeypatch.setattr(gpu_check_measure, "peak_matmul", broken)
    monkeypatch.setattr(gpu_check_measure, "factor_kernels", lambda *a: [])
    monkeypatch.setattr(gpu_check_measure, "inverse_cost_model", broken)
    monkeypatch.setattr(gpu_check_measure, "training_steps", lambda *a: steps)
    monkeypatch.setattr(gpu_check_measure, "sim_device_model", lambda *a: {"gemm": 1.0})
    assert gpu_check.main(["--out", str(tmp_path), "--dry-run"]) == 1
    assert "injected" in (tmp_path / "peak_matmul.error.txt").read_text()
    assert (tmp_path / "costmodel_cpu.error.txt").exists()
    assert _json(tmp_path / "training_steps.json") == steps
    assert _json(tmp_path / "sim_compute.json") == {"device": {"gemm": 1.0}}
    report = (tmp_path / "gpu_check.md").read_text()
    assert (
        "| peak_matmul | False |" in report and "| m | kfac 1/1 | 2 | 300.00 | 3.000x |" in report
    )
