"""The text workload's revision 4, scored in steps (benchmarks/study/steps.py): the phases
in order, the target and budget by AlgoPerf's rule, misses as infinity, the pilots'
choice of K-FAC rows, study scores and the ratio line, trials side by side and a killed
study resumed; then one real smoke run of the target-setting phases.

All but the last test stand a fake launcher in for ``spdkfac train``: it writes the
``summary.json`` a run would, from a made-up curve that falls faster near each row's best
learning rate.
"""

from __future__ import annotations

import copy
import gzip
import json
import math
import shutil
import statistics
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import study_time_to_accuracy  # noqa: E402
from study.driver import planned_trials, run_study  # noqa: E402
from study.report import write_report  # noqa: E402
from study.runner import LaunchResult  # noqa: E402
from study.steps import (  # noqa: E402
    STEPS_PHASES,
    kfac_rows,
    row_scores,
    steps_ratio,
    steps_to,
    target_of,
)
from study.steps_cost import best_scored  # noqa: E402
from study.store import TrialStore, check_protocol  # noqa: E402
from study.workloads import build_plan  # noqa: E402

__all__: list[str] = []

#: The learning rate each row's fake curve likes best, and how fast it falls there.
BEST = {"adamw": (0.008, 0.010), "muon": (0.006, 0.014), "soap": (0.03, 0.013),
        "kfac-muon": (0.006, 0.016), "kfac-eigen-adam": (0.002, 0.012),
        "kfac-eigen-adam-muon": (0.006, 0.017)}  # fmt: skip


#: Seconds per step of the fake runs (0.1 for the others).
PACE = {"kfac-muon": 0.12, "kfac-eigen-adam": 0.13, "kfac-eigen-adam-muon": 0.14}


def _options(flags: list[str]) -> dict[str, str]:
    return {
        flag: value
        for flag, value in zip(flags, [*flags[1:], ""], strict=True)
        if flag.startswith("--")
    }


class FakeLauncher:
    """A run's evaluations from its flags; may interrupt the n-th call; thread-safe."""

    def __init__(self, interrupt_at: int | None = None) -> None:
        self.calls: list[list[str]] = []
        self.interrupt_at = interrupt_at
        self.lock = threading.Lock()

    def __call__(self, flags: list[str], out_dir: Path, timeout: float) -> LaunchResult:
        with self.lock:
            self.calls.append(flags)
            number = len(self.calls)
        out_dir.mkdir(parents=True)
        if number == self.interrupt_at:
            raise KeyboardInterrupt
        option = _options(flags)
        name = option["--optimizer"]
        # (the two-sided row, --optimizer kfac-muon --inverse-method cholesky, falls as
        # the one-sided one)
        best, rate = BEST[name]
        rate *= math.exp(-(math.log(float(option["--lr"]) / best) ** 2) / 2)
        total, every = int(option["--max-steps"]), int(option["--eval-every"])
        seed = int(option["--seed"])
        steps = [*range(every, total, every), total]
        # A step's cost: K-FAC's rows dearer, and every run a little off in its own way.
        pace = PACE.get(name, 0.1) * (1 + 0.05 * ((7 * number + seed) % 3))
        rows = [
            {"step": s, "train_seconds": pace * s, "epoch": s / 1000,
             "val_bits_per_byte": 2 + 0.001 * (seed % 7) + 4 * math.exp(-rate * s)}
            for s in steps
        ]  # fmt: skip
        summary = {"steps": total, "train_seconds": pace * total, "eval_seconds": 1.0,
                   "median_iteration_ms": 100.0, "world_size": 1, "metrics": rows}  # fmt: skip
        (out_dir / "summary.json").write_text(json.dumps(summary))
        return LaunchResult(0, pace * total)


def _plan(**options: Any) -> Any:
    return build_plan(smoke=True, workloads=("text",), **options)


def _study(out: Path, launcher: FakeLauncher, **options: Any) -> TrialStore:
    plan = _plan()
    return run_study(plan, out, launcher, timeout=60, log=lambda _: None, **options)


@pytest.fixture
def all_candidates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every declared K-FAC candidate available, as once ``spdkfac train`` has them."""
    import study.steps

    names = {"kfac-eigen-adam-muon": "muon"}
    monkeypatch.setattr(study.steps, "OPTIMIZERS", {**study.steps.OPTIMIZERS, **names})


def test_revision_4_is_declared_with_the_text_workload_and_retires_revision_3() -> None:
    plan = build_plan()
    (workload,) = plan.steps
    assert workload.key == "text-r4" and [w.name for w in plan.workloads] == ["fashion-mnist"]
    assert [(w.name, w.revision) for w in plan.retired if w.name == "text"] == [
        ("text", 1), ("text", 2), ("text", 3),
    ]  # fmt: skip
    assert workload.setters == ("muon", "soap") and workload.setting_seeds == (1, 2, 3, 4, 5)
    assert (workload.studies, workload.trials, workload.kfac_rows) == (3, 5, 2)
    assert workload.every(workload.budget) <= 0.02 * workload.budget
    # Muon and every K-FAC row ending in Muon search the same learning rates.
    muon = workload.space("muon").dimensions["lr"]
    for row in ("kfac-muon", "kfac-eigen-adam-muon", "kfac-two-sided-muon"):
        assert workload.space(row).dimensions["lr"] == muon
    for space in (*workload.baselines.values(), *workload.candidates.values()):
        assert "schedule" not in space.dimensions  # every schedule ends at the budget
    assert "--decay-scope" in workload.flags and "--grad-clip" in workload.flags
    # 12 bytes of text per parameter (484,416) at the target-setting budget.
    assert workload.budget * 64 * 128 >= 12 * 484_416
    assert "text-r4" in plan.protocol()["workloads"]


def test_the_committed_study_continues_under_revision_4(tmp_path: Path) -> None:
    committed = ROOT / "benchmarks" / "reports" / "study_time_to_accuracy" / "protocol.json"
    shutil.copy(committed, tmp_path / "protocol.json")
    check_protocol(tmp_path, build_plan().protocol())  # raises on a mismatch


@pytest.mark.usefixtures("all_candidates")
def test_phases_run_in_order_and_set_the_target_by_algoperfs_rule(tmp_path: Path) -> None:
    store = _study(tmp_path, FakeLauncher(), parallel=2)
    workload = _plan().steps[0]
    records = store.records
    phases = [r["phase"] for r in records if r["workload"] == workload.key]
    assert phases == sorted(phases, key=[*STEPS_PHASES, "cost"].index)
    tuned = [r for r in records if r["phase"] == "target-tune"]
    assert {r["optimizer"] for r in tuned} == {"muon", "soap"}
    seeds = [r for r in records if r["phase"] == "target-seeds"]
    assert sorted(r["seed"] for r in seeds) == [1, 2, 3]
    assert len({json.dumps(r["hparams"], sort_keys=True) for r in seeds}) == 1
    target = target_of(workload, records)
    assert target is not None
    bests = sorted(min(row["val_bits_per_byte"] for row in r["summary"]["metrics"]) for r in seeds)
    assert target.value == bests[1]  # the median of their best scores
    reached = sorted(steps_to(r, workload.metric, target.value) for r in seeds)
    assert target.setter_steps == reached[1]
    assert target.budget == math.ceil(4 * reached[1] / 3)
    for record in records:
        if record["phase"] in ("pilot", "score"):
            assert _options(record["flags"])["--max-steps"] == str(target.budget)
    rows = kfac_rows(workload, records)
    assert len(rows) == 2 and set(rows) <= set(workload.candidates)
    scores = row_scores(workload, records, target)
    assert set(scores) == {"adamw", "muon", "soap", *rows}
    assert all(len(values) == workload.studies for values in scores.values())
    # Trial i of study s reads the same data for every row.
    scored = [r for r in records if r["phase"] == "score"]
    by_index = {}
    for record in scored:
        assert by_index.setdefault(record["index"], record["seed"]) == record["seed"]
    found = steps_ratio(workload, records)
    assert found is not None
    value, best = found
    medians = {row: statistics.median(values) for row, values in scores.items()}
    assert best == min(("adamw", "muon", "soap"), key=medians.__getitem__)
    assert value == pytest.approx(medians[rows[0]] / medians[best])
    report = write_report(_plan(), records, tmp_path, "study").read_text()
    assert "### Workload text (revision 4)" in report
    assert f"ratio text steps: {value:.2f} ({rows[0]}'s median" in report
    assert "ratio text: n/a (the step-cost runs are not all in)" not in report
    cost = [r for r in records if r["phase"] == "cost"]
    assert len(cost) == 5 * len(scores)  # every row, 5 rounds, one at a time
    for record in cost:
        assert _options(record["flags"])["--max-steps"] == "200"
    paired = statistics.median(
        _mean_step(rows[0], round_, cost) / _mean_step(best, round_, cost) for round_ in range(5)
    )
    assert f"ratio text: {value * paired:.2f} (the steps ratio" in report
    # Each row's cost runs and its line in the report are its fewest-steps scored trial.
    for row in scores:
        first = min(
            (r for r in scored if r["optimizer"] == row),
            key=lambda r: (steps_to(r, workload.metric, target.value), r["index"]),
        )
        assert first is best_scored(workload, records, row, target.value)
        assert {json.dumps(r["hparams"]) for r in cost if r["optimizer"] == row} == {
            json.dumps(first["hparams"])
        }
        study = first["index"] // workload.trials + 1
        assert f"| {row} | {study} | {first['index']} | {first['seed']} | " in report
    # Every row against the best baseline: steps, paired step cost, their product.
    assert f"Every row against {best}, the baseline with the fewest median steps" in report
    for row in scores:
        pairs = [
            _mean_step(row, round_, cost) / _mean_step(best, round_, cost) for round_ in range(5)
        ]
        by_muon = [
            _mean_step(row, round_, cost) / _mean_step("muon", round_, cost) for round_ in range(5)
        ]
        steps = medians[row] / medians[best]
        paired = statistics.median(pairs)
        ms = 1000 * statistics.median(_mean_step(row, round_, cost) for round_ in range(5))
        assert (
            f"| {row} | {medians[row]:.0f} | {steps:.2f} | {ms:.0f} "
            f"| {statistics.median(by_muon):.2f} ({min(by_muon):.2f}-{max(by_muon):.2f}) "
            f"| {paired:.2f} ({min(pairs):.2f}-{max(pairs):.2f}) | {steps * paired:.2f} |"
        ) in report


def test_a_row_that_never_reaches_the_target_scores_infinity() -> None:
    record = {
        "status": "ok",
        "summary": {"metrics": [{"step": 4, "val_bits_per_byte": 3.0},
                                {"step": 8, "val_bits_per_byte": 2.5}]},
    }  # fmt: skip
    assert steps_to(record, "val_bits_per_byte", 2.5) == 8
    assert steps_to(record, "val_bits_per_byte", 2.4) == math.inf
    assert steps_to({"status": "failed"}, "val_bits_per_byte", 9.0) == math.inf


def _mean_step(row: str, round_: int, cost: list[dict[str, Any]]) -> float:
    """A cost run's seconds per step."""
    (record,) = [r for r in cost if r["optimizer"] == row and r["index"] == round_]
    return float(record["summary"]["train_seconds"]) / record["summary"]["steps"]


@pytest.mark.usefixtures("all_candidates")
def test_a_primary_row_that_never_reaches_the_target_is_named_in_the_ratio_line(
    tmp_path: Path,
) -> None:
    store = _study(tmp_path, FakeLauncher(), parallel=2)
    workload = _plan().steps[0]
    primary = kfac_rows(workload, store.records)[0]
    records = copy.deepcopy(store.records)
    for record in records:
        if record["phase"] == "score" and record["optimizer"] == primary:
            for row in record["summary"]["metrics"]:
                row["val_bits_per_byte"] = 9.0
    report = write_report(_plan(), records, tmp_path, "study").read_text()
    why = f"{primary}'s median study never reaches the target: K-FAC does not win"
    assert f"ratio text steps: n/a ({why})" in report
    assert f"ratio text: n/a ({why})" in report
    assert f"| {primary} | never | — |" in report  # its row of the comparison, still shown


def _scored(index: int, curve: list[float]) -> dict[str, Any]:
    metrics = [{"step": 10 * (i + 1), "val_bits_per_byte": v} for i, v in enumerate(curve)]
    return {"workload": _plan().steps[0].key, "phase": "score", "optimizer": "muon",
            "index": index, "status": "ok", "summary": {"metrics": metrics}}  # fmt: skip


def test_the_best_scored_trial_is_the_fewest_steps_then_the_lowest_best_score() -> None:
    workload = _plan().steps[0]

    def best(*records: dict[str, Any]) -> int:
        return int(best_scored(workload, records, "muon", 2.0)["index"])

    # Fewest steps first, whatever the best score.
    assert best(_scored(0, [2.5, 1.5]), _scored(1, [1.9, 2.2])) == 1
    # A row that never reaches the target: its lowest best score, not its first trial.
    assert best(_scored(0, [2.5, 2.3]), _scored(1, [2.4, 2.1]), _scored(2, [2.2, 2.6])) == 1
    # The same steps: the lower best score; then the lower index.
    assert best(_scored(0, [2.5, 1.9]), _scored(1, [2.5, 1.7])) == 1
    assert best(_scored(0, [2.5, 1.7]), _scored(1, [2.5, 1.7])) == 0


@pytest.mark.usefixtures("all_candidates")
def test_the_ratio_is_na_until_the_target_is_set(tmp_path: Path) -> None:
    plan = _plan()
    store = run_study(
        plan, tmp_path, FakeLauncher(), timeout=60, log=lambda _: None, phases=("target-tune",)
    )
    assert planned_trials(plan, store, "pilot") == []
    report = write_report(plan, store.records, tmp_path, "study").read_text()
    assert "ratio text steps: n/a (the target is not set yet)" in report
    assert "ratio text: 1" not in report


@pytest.mark.usefixtures("all_candidates")
def test_a_killed_study_with_trials_side_by_side_resumes(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt):
        _study(tmp_path, FakeLauncher(interrupt_at=4), parallel=2)
    done = {r["id"] for r in TrialStore(tmp_path / "trials.jsonl").records}
    assert len(done) >= 2  # the other run side by side may finish first
    resumed = FakeLauncher()
    store = _study(tmp_path, resumed, parallel=2)
    ids = [r["id"] for r in store.records]
    assert done <= set(ids) and len(ids) == len(set(ids))
    assert len(resumed.calls) == len(ids) - len(done)
    assert steps_ratio(_plan().steps[0], store.records) is not None


def test_a_smoke_study_runs_spdkfac_train_through_the_target_setting_phases(
    tmp_path: Path,
) -> None:
    pytest.importorskip("heavyball")
    entry = (b"Abuse \\A*buse\"\\, v. t. [F. abuser.]\n   To put to a wrong use; to misapply;"
             b" to misuse.\n   [1913 Webster]\n\n")  # fmt: skip
    dictionary = tmp_path / "tiny.dict.dz"
    dictionary.write_bytes(gzip.compress(b"00-database-url\n   nowhere\n\n" + entry * 200))
    out = tmp_path / "study"
    for phase in ("target-tune", "target-seeds"):
        code = study_time_to_accuracy.main([
            "--smoke", "--workloads", "text", "--text-data", str(dictionary), "--out", str(out),
            "--timeout", "120", "--phase", phase, "--parallel", "2",
        ])  # fmt: skip
        assert code == 0
    records = TrialStore(out / "trials.jsonl").records
    assert [r["phase"] for r in records].count("target-tune") == 2
    assert [r["phase"] for r in records].count("target-seeds") == 3
    assert all(r["status"] == "ok" for r in records), [r.get("error") for r in records]
    for record in records:
        assert "torchrun" not in record["command"]  # one process per run
        assert all(0 < row["val_bits_per_byte"] < 9 for row in record["summary"]["metrics"])
    target = target_of(_plan(text_data=str(dictionary)).steps[0], records)
    assert target is not None and target.budget >= 1
    report = (out / "report.md").read_text()
    assert f"- Target: {target.value:.4f} val_bits_per_byte" in report
