"""The time-to-result study driver (benchmarks/study_time_to_accuracy.py): trials drawn
reproducibly, a killed study continuing where it stopped, time to target with never =
full budget, the ratio lines, selection, target-setting runs (text revision 3), the
report (the real smoke study of revision 4: test_study_steps.py).

All but the last test stand a fake launcher in for ``torchrun``: it writes the
``summary.json`` a run would, from a made-up but deterministic curve.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import study_time_to_accuracy  # noqa: E402
from spdkfac.calibrate import describe_device  # noqa: E402
from study.analysis import (  # noqa: E402
    Outcome,
    Row,
    final_rows,
    final_targets,
    outcome,
    ratio,
    reference_paces,
    reference_steps,
    select,
    tuning_targets,
)
from study.driver import planned_trials, run_study  # noqa: E402
from study.protocol import (  # noqa: E402
    Choice,
    LogUniform,
    SearchSpace,
    StudyPlan,
    tuning_trials,
)
from study.report import _where_time_goes, ratio_lines, write_report  # noqa: E402
from study.runner import LaunchResult  # noqa: E402
from study.store import ProtocolMismatchError, TrialStore  # noqa: E402
from study.workloads import build_plan as build_any_plan  # noqa: E402

__all__: list[str] = []


def build_plan(**options: Any) -> StudyPlan:
    """The plan with text revision 3 current: these tests check the protocol it and the
    image workload share (revision 4, scored in steps: test_study_steps.py)."""
    return build_any_plan(text_revision=3, **options)


#: What the workloads' records are known by (their current revisions' keys).
IMAGES = build_plan().workload("fashion-mnist").key
TEXT = build_plan().workload("text").key

#: Seconds per step of each optimizer in the fake runs, how fast its curve rises at its
#: best learning rate, and that rate. K-FAC's median step is a quarter below its mean (its
#: refresh steps).
PACE = {"sgd": 1.0, "adamw": 1.0, "kfac": 1.2, "muon": 1.1, "soap": 2.0, "kfac-adamw": 1.2,
        "kfac-muon": 1.3, "kfac-eigen-adam": 1.4}  # fmt: skip
RATE = {"sgd": 0.02, "adamw": 0.015, "kfac": 0.04, "muon": 0.03, "soap": 0.03, "kfac-adamw": 0.04,
        "kfac-muon": 0.05, "kfac-eigen-adam": 0.035}  # fmt: skip
BEST_LR = {"sgd": 0.1, "kfac": 0.1, "adamw": 0.003, "muon": 0.003, "soap": 0.003,
           "kfac-adamw": 0.003, "kfac-muon": 0.003, "kfac-eigen-adam": 0.003}  # fmt: skip


@pytest.fixture
def kfac_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The text workload's K-FAC rows in the plan, as once ``spdkfac train`` has them."""
    import study.text_r3

    names = {name: "muon" for name in study.text_r3.TEXT_R3_KFAC}
    monkeypatch.setattr(study.text_r3, "OPTIMIZERS", {**study.text_r3.OPTIMIZERS, **names})


def _options(flags: list[str]) -> dict[str, str]:
    options: dict[str, str] = {}
    for index, flag in enumerate(flags):
        if flag.startswith("--"):
            following = flags[index + 1] if index + 1 < len(flags) else ""
            options[flag] = "" if following.startswith("--") else following
    return options


class FakeLauncher:
    """Writes a run's summary.json from its flags; can fail some runs or interrupt one."""

    def __init__(self, *, interrupt_at: int | None = None, fail: str | None = None) -> None:
        self.calls: list[list[str]] = []
        self.interrupt_at = interrupt_at
        self.fail = fail  # fail runs whose flags contain this lr

    def __call__(self, flags: list[str], out_dir: Path, timeout: float) -> LaunchResult:
        self.calls.append(flags)
        out_dir.mkdir(parents=True)
        (out_dir / "metrics.csv").write_text("step\n1\n")  # what a killed run leaves
        if len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt
        option = _options(flags)
        if self.fail is not None and option.get("--lr") == self.fail:
            return LaunchResult(1, 1.0, "", "Traceback ...\nRuntimeError: boom\n")
        name, seed = option["--optimizer"], int(option["--seed"])
        distance = math.log(float(option["--lr"]) / BEST_LR[name])
        rate = RATE[name] * math.exp(-(distance**2) / 8)
        pace = PACE[name] * (1 + 0.01 * seed)
        if option["--dataset"] in ("text", "gcide"):
            total, every = int(option["--max-steps"]), int(option["--eval-every"])
            steps = [*range(every, total, every), total]
            metric = "val_bits_per_byte"
            values = [2 + 4 * math.exp(-rate * s) for s in steps]
            epochs = [s / 500 for s in steps]
        else:
            per_epoch = 100 if "--val-split" in option else 120
            total = int(option["--epochs"]) * per_epoch
            count = int(option["--evals-per-epoch"])
            steps = [-(-i * per_epoch // count) for i in range(1, total * count // per_epoch + 1)]
            metric = "val_accuracy" if "--val-split" in option else "test_accuracy"
            values = [0.95 * (1 - math.exp(-rate * s)) for s in steps]
            epochs = [s / per_epoch for s in steps]
        rows = [
            {"epoch": e, "step": s, "train_loss": 1.0, metric: v, "train_seconds": s * pace}
            for s, v, e in zip(steps, values, epochs, strict=True)
        ]
        summary = {"steps": total, "train_seconds": total * pace, "eval_seconds": 1.0,
                   "median_iteration_ms": 1e3 * pace * (0.75 if "kfac" in name else 1.0),
                   "metrics": rows}  # fmt: skip
        (out_dir / "summary.json").write_text(json.dumps(summary))
        return LaunchResult(0, total * pace + 3.0)


def _records(out: Path) -> list[dict[str, Any]]:
    return TrialStore(out / "trials.jsonl").records


def _study(plan: StudyPlan, out: Path, launcher: FakeLauncher) -> TrialStore:
    return run_study(plan, out, launcher, timeout=60, log=lambda _: None)


def test_trials_are_drawn_the_same_on_every_restart_and_optimizers_alternate() -> None:
    plan = build_plan(trials=3)
    for workload in plan.workloads:
        trials = tuning_trials(plan, workload)
        assert [t.id for t in trials] == [t.id for t in tuning_trials(plan, workload)]
        names = list(workload.spaces)
        assert [t.optimizer for t in trials] == names * plan.trials_of(workload)
        assert len({t.id for t in trials}) == len(trials)
        for trial in trials:
            space = workload.spaces[trial.optimizer].dimensions
            assert set(trial.hparams) == set(space)
            for key, value in trial.hparams.items():
                dimension = space[key]
                if isinstance(dimension, LogUniform):
                    assert dimension.low * 0.99 <= value <= dimension.high * 1.01
                else:
                    assert isinstance(dimension, Choice) and value in dimension.values
    assert set(plan.workload("text").spaces) >= {"adamw", "muon"}
    assert plan.trials_of(plan.workload("text")) == 8  # its own number (the study's: 3)
    images = plan.workload("fashion-mnist")
    assert list(images.spaces) == ["sgd", "adamw", "kfac", "kfac-eigen-adam"]
    assert plan.trials_of(images) == 8 and images.kfac == ("kfac", "kfac-eigen-adam")


def test_a_killed_study_continues_where_it_stopped(tmp_path: Path) -> None:
    plan = build_plan(smoke=True, trials=2, seeds=(1,))
    killed = FakeLauncher(interrupt_at=4)
    with pytest.raises(KeyboardInterrupt):
        _study(plan, tmp_path, killed)
    done = [r["id"] for r in _records(tmp_path)]
    assert len(done) == 3
    fourth = tuning_trials(plan, plan.workloads[0])[3]
    assert (tmp_path / "runs" / f"{fourth.id}.partial").exists()
    # The report of a stopped study says which optimizers have not started tuning.
    report = write_report(plan, _records(tmp_path), tmp_path, "study").read_text()
    assert "no trial has run yet" in report and "every trial failed" not in report

    resumed = FakeLauncher()
    _study(plan, tmp_path, resumed)
    records = _records(tmp_path)
    ids = [r["id"] for r in records]
    assert ids[:3] == done and len(ids) == len(set(ids))
    tuning = planned_trials(plan, TrialStore(tmp_path / "trials.jsonl"), "tune")
    setting = planned_trials(plan, TrialStore(tmp_path / "trials.jsonl"), "target")
    finals = planned_trials(plan, TrialStore(tmp_path / "trials.jsonl"), "final")
    assert len(finals) == sum(len(w.spaces) for w in plan.workloads)
    assert len(setting) == len(plan.workload("text").baselines) >= 2  # images: fixed targets
    assert set(ids) == {t.id for t in tuning + setting + finals}
    assert len(resumed.calls) == len(ids) - 3  # the finished trials were not run again
    assert ids[3] == fourth.id  # the interrupted trial ran again, from scratch
    assert not (tmp_path / "runs" / f"{fourth.id}.partial").exists()
    assert (tmp_path / "runs" / fourth.id / "summary.json").exists()

    idle = FakeLauncher(interrupt_at=1)  # would raise if anything ran
    _study(plan, tmp_path, idle)
    assert idle.calls == [] and len(_records(tmp_path)) == len(ids)


def test_a_torn_last_line_is_dropped(tmp_path: Path) -> None:
    store = TrialStore(tmp_path / "trials.jsonl")
    store.append({"id": "a", "status": "ok"})
    with (tmp_path / "trials.jsonl").open("a") as handle:
        handle.write('{"id": "b", "sta')
    again = TrialStore(tmp_path / "trials.jsonl")
    assert [r["id"] for r in again.records] == ["a"] and again.done("a") and not again.done("b")
    again.append({"id": "b", "status": "ok"})
    assert [r["id"] for r in TrialStore(tmp_path / "trials.jsonl").records] == ["a", "b"]


def test_another_protocol_is_refused_but_workloads_may_come_one_at_a_time(
    tmp_path: Path,
) -> None:
    def plan(workloads: tuple[str, ...], optimizers: tuple[str, ...], trials: int) -> StudyPlan:
        return build_plan(smoke=True, workloads=workloads, optimizers=optimizers,
                          trials=trials, seeds=())  # fmt: skip

    _study(plan(("text",), ("adamw",), 1), tmp_path, FakeLauncher())
    with pytest.raises(ProtocolMismatchError, match=r"differs in: study\.trials"):
        _study(plan(("text",), ("adamw",), 2), tmp_path, FakeLauncher())
    with pytest.raises(ProtocolMismatchError, match="differs in: workload text"):
        _study(plan(("text",), ("adamw", "muon"), 1), tmp_path, FakeLauncher())
    # The image workload joins the study; the text trial already recorded is not rerun.
    both = FakeLauncher()
    _study(plan(("fashion-mnist", "text"), ("sgd", "kfac", "adamw"), 1), tmp_path, both)
    assert [_options(flags)["--dataset"] for flags in both.calls] == ["fashion-mnist"] * 3
    code = study_time_to_accuracy.main(["--smoke", "--workloads", "text", "--optimizers",
                                        "adamw", "--out", str(tmp_path)])  # fmt: skip
    assert code == 2  # refused (6 trials, not 1) before launching anything
    # A report rewritten by a run limited to one workload still covers every workload.
    (tmp_path / "report.md").unlink()
    code = study_time_to_accuracy.main(["--smoke", "--workloads", "text", "--optimizers",
                                        "sgd,kfac,adamw", "--trials", "1", "--seeds", "",
                                        "--phase", "report", "--out", str(tmp_path)])  # fmt: skip
    report = (tmp_path / "report.md").read_text()
    assert code == 0 and "--workloads text" in report
    assert "ratio fashion-mnist" in report and "### Workload fashion-mnist" in report


def test_a_retired_revision_keeps_its_trials_in_the_report_and_out_of_the_results(
    tmp_path: Path,
) -> None:
    plan = build_plan(smoke=True, trials=1, seeds=(1,))
    first, second, third = plan.retired[:3]
    assert (first.key, second.key, third.key) == (
        "fashion-mnist", "fashion-mnist-r2", "fashion-mnist-r3"
    )  # fmt: skip
    assert [w.key for w in plan.retired] == [first.key, second.key, third.key, "text", "text-r2"]
    assert (IMAGES, TEXT) == ("fashion-mnist-r4", "text-r3")
    # A study that ran revisions 1 to 3 (tuning and final runs) goes on under revision 4.
    for index, earlier_revision in enumerate((first, second, third)):
        retired = (first, second, third)[:index]
        _study(replace(plan, workloads=(earlier_revision,), retired=retired), tmp_path,
               FakeLauncher())  # fmt: skip
    earlier = _records(tmp_path)
    assert [r["workload"] for r in earlier] == [
        key for key in (first.key, second.key, third.key) for _ in range(6)
    ]
    revised = FakeLauncher()
    _study(plan, tmp_path, revised)
    records = _records(tmp_path)
    assert records[:18] == earlier  # nothing of revisions 1 to 3 ran again
    later = [r for r in records[18:] if r["workload"] == IMAGES]
    optimizers = len(plan.workload("fashion-mnist").spaces)  # one trial, one final run each
    assert len(later) == 2 * optimizers and all(f"-{IMAGES}-" in r["id"] for r in later)
    report = (tmp_path / "report.md").read_text()
    for revision in ("revision 1", "revision 2", "revision 3"):
        assert f"### Retired: workload fashion-mnist, {revision}" in report
    assert "### Workload fashion-mnist (revision 4)" in report
    assert "Changed from revision 3: a third tuning stage for every optimizer" in report
    assert "### fashion-mnist (retired)" in report
    assert "### fashion-mnist (revision 3) (retired)" in report
    trial_rows = [
        line
        for line in report.splitlines()
        if re.match(r"\| (tune|target|final) \| [\w-]+ \| \d", line)
    ]
    assert len(trial_rows) == len(records)  # every trial, retired ones included
    # The results come from revision 4 only: one final run (seed 1) per optimizer, not four.
    rows = final_rows(records, plan.workload("fashion-mnist"), 0.6)
    assert [len(row.outcomes) for row in rows] == [1] * optimizers
    # Every retired revision keeps its ratio lines, apart from the answer.
    report_lines = report.splitlines()
    assert sum(x.startswith("- retired: ratio fashion-mnist 60%") for x in report_lines) == 3
    assert sum(x.startswith("ratio fashion-mnist 60%") for x in report_lines) == 1


def test_later_image_revisions_tune_around_the_previous_choices_to_stricter_targets() -> None:
    plan = build_plan()
    images = plan.workload("fashion-mnist")
    assert images.revision == 4 and images.targets == (0.92, 0.93)
    assert tuning_targets((), images) == (0.925, 0.935)
    assert plan.trials_of(images) == 8
    text = plan.workload("text")
    assert text.tune_margin == 0 and tuning_targets((), text) == ()  # set by target runs
    third = next(w for w in plan.retired if w.key == "fashion-mnist-r3")
    kfac = third.spaces["kfac"].dimensions
    assert kfac["lr"] == LogUniform(0.00947, 0.0852)
    assert kfac["schedule"] == Choice((0.3, 0.4, 0.5, 0.6, 0.8))
    assert third.spaces["sgd"].dimensions["schedule"] == Choice((0.5, 0.6, 0.8, 1.0))
    assert third.spaces["adamw"].dimensions["weight_decay"] == LogUniform(0.00667, 0.06)
    # Revision 4: around revision 3's choices; where one sat at a bound, wider.
    kfac = images.spaces["kfac"].dimensions
    assert kfac["lr"] == LogUniform(0.0269, 0.242)  # revision 3: at most 0.0852
    assert kfac["inv_update_steps"] == Choice((50, 100, 200, 400))  # revision 3 chose 100
    assert kfac["weight_sharing"] == Choice(("expand", "reduce"))
    assert kfac["factor_examples"] == Choice((16, 32))
    assert "--factor-examples" not in images.spaces["kfac"].fixed  # searched, not fixed
    assert images.spaces["sgd"].dimensions["schedule"] == Choice((0.6, 0.8, 1.0))
    assert images.spaces["sgd"].dimensions["warmup"] == Choice((0.0, 0.05, 0.1, 0.2))
    assert "weight_sharing" not in images.spaces["sgd"].dimensions
    # A validation curve that passes 92 % but not 92.5 % reaches no tuning target.
    record = {"status": "ok", "summary": {"steps": 10, "train_seconds": 10.0, "metrics": [
        {"step": 5, "epoch": 1, "train_seconds": 5.0, "val_accuracy": 0.924},
        {"step": 10, "epoch": 2, "train_seconds": 10.0, "val_accuracy": 0.93},
    ]}}  # fmt: skip
    targets = tuning_targets((), images)
    assert [outcome(record, images, "val_accuracy", t).reached for t in targets] == [True, False]
    assert not outcome(record, images, "val_accuracy", 0.935).reached
    assert outcome(record, images, "val_accuracy", 0.92).steps == 5


def test_a_dimension_may_choose_among_a_flags_names() -> None:
    """``--weight-sharing reduce``: a named choice is a flag's value as it is, in the
    protocol's description and in the trials' flags."""
    images = build_plan().workload("fashion-mnist")
    space = images.spaces["kfac"]
    named = Choice(("expand", "reduce"))
    workload = replace(
        images,
        spaces={"kfac": SearchSpace(space.fixed, {**space.dimensions, "weight_sharing": named})},
    )
    assert named.describe() == "one of {expand, reduce}"
    assert workload.protocol()["spaces"]["kfac"]["dimensions"]["weight_sharing"] == (
        "one of {expand, reduce}"
    )
    drawn = tuning_trials(StudyPlan((workload,), trials=12, seeds=(1,)), workload)
    assert {t.hparams["weight_sharing"] for t in drawn} == {"expand", "reduce"}
    for trial in drawn:
        index = trial.flags.index("--weight-sharing")
        assert trial.flags[index + 1] == trial.hparams["weight_sharing"]


def test_the_committed_study_still_matches_the_plan() -> None:
    """The study on disk continues under this plan: every workload it holds has the
    protocol it ran under, and every tuning trial it recorded is one the plan draws."""
    directory = ROOT / "benchmarks" / "reports" / "study_time_to_accuracy"
    saved = json.loads((directory / "protocol.json").read_text())
    plan = build_any_plan()  # text revision 4 current, revision 3 retired
    assert saved["study"] == json.loads(json.dumps(plan.protocol()["study"]))
    known = {w.key: w for w in (*plan.workloads, *plan.retired)}
    declared = {**known, **{w.key: w for w in plan.steps}}
    assert set(saved["workloads"]) <= set(declared)
    for key, protocol in saved["workloads"].items():
        assert json.loads(json.dumps(declared[key].protocol())) == protocol, key
    recorded = TrialStore(directory / "trials.jsonl").records
    assert recorded  # the committed study
    for key, workload in known.items():
        drawn = {t.id for t in tuning_trials(plan, workload)}
        ran = {r["id"] for r in recorded if r["workload"] == key and r["phase"] == "tune"}
        assert ran <= drawn, key


def test_unknown_optimizer_or_workload_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"unknown optimizer.*lion; choose from"):
        build_plan(optimizers=("lion",))
    with pytest.raises(ValueError, match="workload text needs adamw"):
        build_plan(workloads=("text",), optimizers=("muon",))
    with pytest.raises(SystemExit) as exit_info:
        study_time_to_accuracy.main(["--workloads", "cifar"])
    assert exit_info.value.code == 2
    assert "unknown workload(s) cifar" in capsys.readouterr().err


def _record(
    optimizer: str,
    points: list[tuple[int, float, float]],
    *,
    phase: str = "final",
    seed: int = 1,
    steps: int = 1600,
    seconds: float = 800.0,
    index: int = 0,
    metric: str = "test_accuracy",
    workload: str = IMAGES,
) -> dict[str, Any]:
    rows = [{"epoch": s / 200, "step": s, metric: v, "train_seconds": t} for s, t, v in points]
    return {"id": f"{phase}-{optimizer}-{seed}-{index}", "workload": workload,
            "optimizer": optimizer, "phase": phase, "index": index, "seed": seed,
            "hparams": {}, "status": "ok",
            "summary": {"steps": steps, "train_seconds": seconds, "metrics": rows}}  # fmt: skip


def test_never_reaching_a_target_counts_as_the_full_budget() -> None:
    workload = build_plan().workload("fashion-mnist")  # budget: 10 epochs
    run = _record("sgd", [(200, 100.0, 0.90), (600, 300.0, 0.925), (1600, 800.0, 0.928)])
    reached = outcome(run, workload, "test_accuracy", 0.92)
    assert (reached.reached, reached.steps, reached.seconds) == (True, 600, 300.0)
    never = outcome(run, workload, "test_accuracy", 0.93)
    # 200 steps per epoch, 0.5 s per step: the 10-epoch budget is 2000 steps, 1000 s.
    assert (never.reached, never.steps, never.seconds) == (False, 2000, 1000.0)
    failed = {**run, "status": "failed"}
    assert math.isinf(outcome(failed, workload, "test_accuracy", 0.93).seconds)


def test_ratio_is_kfacs_median_over_the_best_other_median() -> None:
    plan = build_plan()
    records = []
    for seed, (sgd, kfac) in enumerate([(100.0, 50.0), (120.0, 70.0), (110.0, 400.0)], 1):
        records.append(_record("sgd", [(200, sgd, 0.921), (1600, 800.0, 0.925)], seed=seed))
        records.append(_record("adamw", [(1600, 800.0, 0.91)], seed=seed))
        at_93 = [(400, 90.0 + seed, 0.935)] if seed < 3 else []  # seed 3 never gets there
        records.append(_record("kfac", [(100, kfac, 0.922), *at_93, (1600, 800.0, 0.929)],
                               seed=seed))  # fmt: skip
    workload = plan.workload("fashion-mnist")
    rows = final_rows(records, workload, 0.92)
    found = ratio(rows, "kfac")
    assert found is not None and found[2].optimizer == "sgd"  # adamw never reached 92 %
    assert found[0] == pytest.approx(70.0 / 110.0)
    # 93 %: K-FAC's seeds take 91, 92 and the full budget (1000 s): median 92; SGD and
    # AdamW never get there, so the best other is their full budget, 1000 s.
    assert ratio(final_rows(records, workload, 0.93), "kfac")[0] == pytest.approx(0.092)  # type: ignore[index]
    setters = ", ".join(plan.workload("text").baselines)
    assert ratio_lines(plan, records) == [
        # (no kfac-eigen-adam runs: 9 of the plan's 12)
        "ratio fashion-mnist 92%: 0.64 (provisional: 9 of 12 final runs recorded)",
        "ratio fashion-mnist 93%: 0.09 (provisional: 9 of 12 final runs recorded)",
        f"ratio text: n/a (the target-setting runs of {setters} set this target; none has "
        "finished)",
    ]


def test_selection_goes_to_the_fastest_to_the_strictest_target() -> None:
    workload = build_plan().workload("fashion-mnist")
    tune = {"phase": "tune", "metric": "val_accuracy"}
    # Tuning targets 92.5 % and 93.5 % (the test targets + the margin).
    quick_92 = _record("sgd", [(100, 50.0, 0.93), (1600, 800.0, 0.933)], index=0, **tune)
    slow_93 = _record("sgd", [(100, 60.0, 0.93), (900, 500.0, 0.936)], index=1, **tune)
    broken = {**_record("sgd", [], index=2, **tune), "status": "failed"}
    best_92 = _record("adamw", [(300, 150.0, 0.926), (1600, 800.0, 0.931)], index=0, **tune)
    late_92 = _record("adamw", [(700, 350.0, 0.926), (1600, 800.0, 0.934)], index=1, **tune)
    chosen = select([quick_92, slow_93, broken, best_92, late_92], workload)
    assert chosen["sgd"] is slow_93 and chosen["adamw"] is best_92 and chosen["kfac"] is None


def test_trials_on_different_machines_compare_in_steps_of_the_reference() -> None:
    workload = build_plan().workload("fashion-mnist")
    tune = {"phase": "tune", "metric": "val_accuracy", "steps": 1000}

    def on(machine: str, record: dict[str, Any]) -> dict[str, Any]:
        return {**record, "machine": machine}

    # SGD steps take 1 s on the slow machine and 0.5 s on the fast one.
    slow_sgd = on("slow", _record("sgd", [(600, 600.0, 0.926)], seconds=1000.0, **tune))
    fast_sgd = on("fast", _record("sgd", [(800, 400.0, 0.926)], seconds=500.0, index=1, **tune))
    # K-FAC: 900 slow-machine SGD steps against 300 s / 0.5 s = 600 on the fast machine,
    # where its own steps cost more than SGD's (0.6 s): they count in full.
    slow_kfac = on("slow", _record("kfac", [(600, 900.0, 0.926)], seconds=1500.0, **tune))
    fast_kfac = on("fast", _record("kfac", [(500, 300.0, 0.926)], seconds=600.0, index=1, **tune))
    records = [slow_sgd, fast_sgd, slow_kfac, fast_kfac]
    assert reference_paces(records, workload) == {"slow": 1000.0, "fast": 500.0}
    chosen = select(records, workload)
    # By seconds the fast machine's SGD trial would win (400 s against 600 s).
    assert chosen["sgd"] is slow_sgd and chosen["kfac"] is fast_kfac
    # Records without a machine are one machine; one without a reference there is counted
    # at the median reference pace.
    unknown = _record("adamw", [(300, 150.0, 0.926)], **tune)
    assert reference_steps(150.0, unknown, {"slow": 1000.0, "fast": 500.0}) == 200.0
    assert reference_paces([{**slow_sgd, "machine": None}], workload) == {"not recorded": 1000.0}


def test_revision_2s_text_target_came_from_adamws_best_configuration() -> None:
    plan = build_plan()
    workload = next(w for w in plan.retired if w.key == "text-r2")
    text = {"workload": workload.key, "metric": "val_bits_per_byte"}
    adamw = [_record("adamw", [(300, 90.0, 3.0), (600, 180.0, value)], phase="tune", index=i,
                     **text) for i, value in enumerate((2.6, 2.4, 2.5))]  # fmt: skip
    fast = _record("muon", [(200, 70.0, 2.39), (400, 140.0, 2.3)], phase="tune", **text)
    slow = _record("muon", [(500, 150.0, 2.35), (600, 180.0, 2.2)], phase="tune", index=1, **text)
    records = [*adamw, fast, slow]
    assert tuning_targets(records, workload) == (2.4,)
    assert select(records, workload)["muon"] is fast  # sooner to 2.4, though slow ends lower
    finals = [_record("adamw", [(600, 180.0, v)], seed=s, **text)
              for s, v in enumerate((2.45, 2.41, 2.5), 1)]  # fmt: skip
    assert final_targets(finals, workload) == (2.45,)


@pytest.mark.usefixtures("kfac_rows")
def test_the_report_puts_the_protocol_first_and_every_trial_in(tmp_path: Path) -> None:
    plan = build_plan(trials=2, seeds=(1, 2, 3))
    assert set(plan.workload("text").kfac) <= set(plan.workload("text").spaces)
    first_sgd = tuning_trials(plan, plan.workload("fashion-mnist"))[0]
    launcher = FakeLauncher(fail=f"{first_sgd.hparams['lr']:g}")  # a failed trial
    _study(plan, tmp_path, launcher)
    records = _records(tmp_path)
    assert sum(r["status"] == "failed" for r in records) == 1
    report = (tmp_path / "report.md").read_text()
    lines = report.splitlines()
    assert report.index("## Protocol") < report.index("## Results") < report.index("ratio ")
    for label in ("fashion-mnist 92%", "fashion-mnist 93%", "text"):
        assert sum(bool(re.fullmatch(rf"ratio {label}: \d+\.\d\d", line)) for line in lines) == 1
    trial_rows = [
        line for line in lines if re.match(r"\| (tune|target|final) \| [\w-]+ \| \d", line)
    ]
    assert len(trial_rows) == len(records) == len(launcher.calls)
    assert "| failed |" in report and "RuntimeError: boom" in report
    assert "| 92% (0.92) | kfac | 3/3 |" in report
    # Every run says which CPU it ran on; the tuning times are also in reference steps.
    machine = describe_device(torch.device("cpu"))
    assert {r["machine"] for r in records} == {machine} and f"- A: {machine}" in lines
    assert "| in sgd steps |" in report and "| in adamw steps |" in report
    assert "Caution: these final runs ran on" not in report
    # Until every final run is in, a ratio line says it is provisional.
    last = max(i for i, r in enumerate(records) if r["workload"] == TEXT and r["phase"] == "final")
    partial = write_report(plan, records[:last] + records[last + 1 :], tmp_path, "study")
    planned = len(plan.seeds) * len(plan.workload("text").spaces)
    told = f"(provisional: {planned - 1} of {planned} final runs recorded)"
    assert re.search(rf"^ratio text: \d+\.\d\d {re.escape(told)}$", partial.read_text(), re.M)
    assert not re.search(r"^ratio fashion-mnist .*provisional", partial.read_text(), re.M)
    records[-1]["machine"] = "another CPU"  # a final run of the text workload
    report = write_report(plan, records, tmp_path, "study").read_text()
    assert report.count("Caution: these final runs ran on 2 machines") == 1
    assert "- B: another CPU" in report
    # A retired revision's final runs keep their ratio and table, apart from the answer.
    retired = plan.retired[-1]
    assert retired.name == "text" and retired.key != TEXT
    # (Its K-FAC optimizer was kfac-adamw: kfac-muon's runs stand in for it.)
    old = [
        {**r, "workload": retired.key, "optimizer": r["optimizer"].replace("-muon", "-adamw")}
        for r in records
        if r["workload"] == TEXT and r["optimizer"] != "kfac-eigen-adam"
    ]
    report = write_report(plan, [*records, *old], tmp_path, "study").read_text()
    lines = report.splitlines()
    (line,) = [x for x in lines if x.startswith("- retired: ratio text: ")]
    found = ratio(final_rows(old, retired, final_targets(old, retired)[0]), retired.kfac)
    assert found is not None and line == f"- retired: ratio text: {found[0]:.2f}"
    assert report.index("## Results") < report.index("### Retired: text, revision 2")
    assert sum(bool(re.fullmatch(r"ratio text: \d+\.\d\d", x)) for x in lines) == 1
    # Where K-FAC's time goes: the share of its steps' time above their median.
    assert "the time above the median (refresh steps) is 25% of its total" in report
    # ... and how far through its schedule it passes the target (the schedule's tail).
    tail = r"it passes the target at step (\d+) of its (\d+)-step schedule \((\d+)%"
    passed = [tuple(map(int, m.groups())) for m in re.finditer(tail, report)]
    assert passed and all(round(100 * n / total) == share for n, total, share in passed)
    # The text target: set by the baselines' target-setting runs, and said how.
    (told,) = [x for x in lines if x.startswith("Target: ")]
    assert re.match(r"Target: \d\.\d{4} val_bits_per_byte, set by \w+'s target-setting runs", told)
    for workload in (IMAGES, TEXT):
        plotted = (tmp_path / f"{workload}.png").exists()
        assert plotted == (f"]({workload}.png)" in report)
        assert plotted or "plot skipped" in report
    # The fake K-FAC climbs faster: the report's ratio is the analysis's number.
    rows = final_rows(records, plan.workload("fashion-mnist"), 0.92)
    value = ratio(rows, "kfac")[0]  # type: ignore[index]
    assert f"ratio fashion-mnist 92%: {value:.2f}" in lines and value < 1


@pytest.mark.usefixtures("kfac_rows")
def test_text_revision_3_sets_its_target_by_the_best_baselines_full_budget_runs(
    tmp_path: Path,
) -> None:
    plan = build_plan(smoke=True, workloads=("text",), trials=3, seeds=(1, 2, 3))
    workload = plan.workload("text")
    assert workload.target_setting and workload.reference is None
    assert set(workload.kfac) == {"kfac-muon", "kfac-eigen-adam"} <= set(workload.spaces)
    assert "kfac-muon" not in workload.baselines and "adamw" in workload.baselines
    adamw = workload.spaces["adamw"].dimensions
    assert adamw["beta2"] == Choice((0.95, 0.99, 0.999)) and adamw["grad_clip"] == Choice((0, 1))
    shared = ("lr", "weight_decay", "schedule", "warmup", "grad_clip")
    for space in workload.spaces.values():  # the same choices for every optimizer
        assert {k: space.dimensions[k] for k in shared} == {k: adamw[k] for k in shared}
    store = _study(plan, tmp_path, FakeLauncher())
    records = store.records
    phases = [r["phase"] for r in records]
    # Tuning, then every target-setting run, then the final runs.
    assert phases == sorted(phases, key=["tune", "target", "final"].index)
    setting = [r for r in records if r["phase"] == "target"]
    assert [r["optimizer"] for r in setting] == list(workload.baselines) * 3
    assert {r["seed"] for r in setting} == {101, 102, 103}
    chosen = select(records, workload)
    for run in setting:  # the chosen configuration over the whole budget
        assert run["hparams"] == {**chosen[run["optimizer"]]["hparams"], "schedule": 1.0}  # type: ignore[index]
        assert _options(run["flags"])["--max-steps"] == str(workload.budget)
    # The target: the best baseline's median final score over its target-setting runs.
    medians = {
        name: sorted(r["summary"]["metrics"][-1]["val_bits_per_byte"] for r in setting
                     if r["optimizer"] == name)[1]
        for name in workload.baselines
    }  # fmt: skip
    assert final_targets(records, workload) == (min(medians.values()),)
    # Tuning trials are timed to the best final score of the baselines' tuning trials.
    baseline_finals = [
        r["summary"]["metrics"][-1]["val_bits_per_byte"]
        for r in records
        if r["phase"] == "tune" and r["optimizer"] in workload.baselines
    ]
    assert tuning_targets(records, workload) == (min(baseline_finals),)  # fmt: skip
    # The ratio: the best K-FAC row's median time over the best other optimizer's.
    rows = final_rows(records, workload, final_targets(records, workload)[0])
    found = ratio(rows, workload.kfac)
    assert found is not None and found[1].optimizer in workload.kfac
    kfac_best = min(
        (r for r in rows if r.optimizer in workload.kfac), key=lambda r: r.median_seconds
    )
    assert found[1] is kfac_best and found[2].optimizer in workload.baselines
    report = (tmp_path / "report.md").read_text()
    assert f"ratio text: {found[0]:.2f}" in report.splitlines()
    # What was tried before the study (not study trials) follows where the time goes.
    tried = report.index("Tried before the study (pilots, not study trials): K-FAC")
    assert report.index("- text: kfac-") < tried < report.index("pilot_text_forms/report.md")


@pytest.mark.usefixtures("kfac_rows")
def test_final_runs_wait_for_every_target_setting_run(tmp_path: Path) -> None:
    plan = build_plan(smoke=True, workloads=("text",), optimizers=("adamw", "muon"), trials=1,
                      seeds=(1, 2))  # fmt: skip
    with pytest.raises(KeyboardInterrupt):  # 2 tuning trials, 2 target-setting runs, then 1
        _study(plan, tmp_path, FakeLauncher(interrupt_at=5))
    store = TrialStore(tmp_path / "trials.jsonl")
    assert [r["phase"] for r in store.records] == ["tune", "tune", "target", "target"]
    assert planned_trials(plan, store, "final") == []  # 2 of 4 target-setting runs recorded
    report = write_report(plan, store.records, tmp_path, "study").read_text()
    assert "ratio text: n/a (needs final runs of kfac-muon or kfac-eigen-adam" in report
    assert "(provisional: 2 of 4 target-setting runs recorded)" in report
    with pytest.raises(ValueError, match="workload text needs a baseline"):
        build_plan(workloads=("text",), optimizers=("kfac-muon",))
    # Continued, the study runs the other target-setting runs before any final run.
    _study(plan, tmp_path, FakeLauncher())
    phases = [r["phase"] for r in _records(tmp_path)]
    assert phases == ["tune"] * 2 + ["target"] * 4 + ["final"] * 4


def test_where_the_time_goes_names_every_k_fac_form_and_its_step_cost() -> None:
    """Issue 41: steps against time per step for each K-FAC form over the best other, the
    chosen form first, and each form's mean step over every other optimizer's."""
    workload = build_plan().workload("text")

    def row(name: str, steps: float, ms: float) -> Row:
        outcomes = tuple(Outcome(True, steps, steps * ms / 1000) for _ in range(3))
        return Row(name, 2.5, outcomes, ms, (2.5,) * 3, median_step_ms=ms * 0.9)

    rows = [row("muon", 1000, 200.0), row("soap", 800, 400.0),
            row("kfac-eigen-adam", 900, 250.0), row("kfac-muon", 800, 220.0)]  # fmt: skip
    lines = _where_time_goes(rows, workload, "text")
    assert lines[0].startswith(
        "- text: kfac-muon takes 0.88x the time of muon (the best other): "
        "0.80x the steps to the target at 1.10x the time per step"
    )
    assert lines[1].startswith("- text: kfac-eigen-adam takes 1.12x the time of muon")
    assert lines[2] == (
        "- text, mean time per step (refresh steps included): kfac-muon 1.10x muon, 0.55x soap; "
        "kfac-eigen-adam 1.25x muon, 0.62x soap."
    )
    # A median run that never reached the target is said to be the budget's cost.
    never = Outcome(False, 1500, 300.0)
    rows[0] = replace(rows[0], outcomes=(never, never, rows[0].outcomes[0]))
    lines = _where_time_goes(rows, workload, "text")
    assert lines[2] == (
        "- text: reached by muon in 1 of 3 runs only. A run that never reaches the target "
        "counts as the whole budget at its own pace, so a median without the target is the "
        "cost of the budget, not a time to the target."
    )
