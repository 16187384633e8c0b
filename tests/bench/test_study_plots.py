"""The study's final-run plots (benchmarks/study/plots.py): target lines labelled, the
score axis zoomed on the band where the targets are."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from spdkfac.support.optional import optional_import  # noqa: E402
from study.images import fashion  # noqa: E402
from study.plots import plot_final_runs, target_band  # noqa: E402


def test_the_band_holds_the_targets_and_the_best_score() -> None:
    low, high = target_band([0.92, 0.93], [0.5, 0.91, 0.938], higher_is_better=True)
    assert low == pytest.approx(0.90) and high == pytest.approx(0.943)
    low, high = target_band([2.0], [5.1, 2.3, 1.96], higher_is_better=False)
    assert low == pytest.approx(1.94) and high == pytest.approx(2.08)


def _run(optimizer: str, key: str, accuracies: list[float]) -> dict[str, Any]:
    metrics = [{"train_seconds": 10.0 * (i + 1), "test_accuracy": a}
               for i, a in enumerate(accuracies)]  # fmt: skip
    return {"workload": key, "phase": "final", "optimizer": optimizer, "status": "ok",
            "summary": {"metrics": metrics}}  # fmt: skip


@pytest.mark.skipif(optional_import("matplotlib.pyplot") is None, reason="needs matplotlib")
def test_the_plot_labels_its_targets_and_zooms_on_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.pyplot as plt

    workload = fashion(smoke=False, data=None)  # builds the protocol only; reads no data
    records = [_run(name, workload.key, [0.6, 0.91, 0.925, 0.935]) for name in workload.spaces]
    figures: list[Any] = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read it back
    assert plot_final_runs(workload, records, [0.92, 0.93], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
    axis = figures[0].axes[0]
    assert [text.get_text() for text in axis.texts] == ["target 92%", "target 93%"]
    assert axis.get_ylim() == pytest.approx((0.90, 0.94))
    assert "zoomed on the targets" in axis.get_title()
