"""``spdkfac bench --model gpt``: the language model on random token ids, one rank."""

from __future__ import annotations

import json
from pathlib import Path

from spdkfac.cli import main

__all__: list[str] = []


def test_gpt_runs_on_random_tokens(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = main(
        ["bench", "--model", "gpt", "--nproc", "1", "--iters", "3", "--warmup", "1",
         "--chunk", "2", "--variants", "sgd,d-kfac", "--batch-size", "2", "--input-size", "8",
         "--out-dir", str(out)]
    )  # fmt: skip
    assert code == 0
    report = (out / "report.md").read_text()
    assert "8 random token ids (vocabulary 256) per example" in report
    results = json.loads((out / "results.json").read_text())
    assert [v["name"] for v in results["variants"]] == ["sgd", "d-kfac"]
    for variant in results["variants"]:
        assert variant["breakdown"]["FF&BP"] > 0 and variant["skipped_steps"] == 0
