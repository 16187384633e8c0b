"""Workloads scored in steps to a target (AlgoPerf's rules, modded-nanogpt's metric).

The order of such a workload, each phase planned only once the one before it is recorded:

1. ``target-tune``: the target-setting baselines' trials at the declared budget (every
   schedule ends at the budget); the best of them by its lowest validation score;
2. ``target-seeds``: that configuration with the declared seeds; the target is the median of
   their *best* scores, and the scored budget ``budget_factor`` times their median steps
   to it (a run that misses counts as never);
3. ``pilot``: each K-FAC candidate's pilot trials at the scored budget; the candidates
   with the fewest steps to the target become the study's K-FAC rows, the first the
   primary one (declared before any scored run);
4. ``score``: ``studies`` independent studies of ``trials`` trials per row. A trial
   scores the step of its first evaluation at or below the target (a miss: infinity), a
   study the minimum over its trials, a row the median over its studies.

Every run is one process on one thread, so trials may run two at a time: steps do not
depend on the machine's load. Time comes from a separate step-cost measurement.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from spdkfac.training.config import OPTIMIZERS
from study.protocol import SearchSpace, Trial, show

__all__ = [
    "STEPS_PHASES",
    "StepsWorkload",
    "Target",
    "best_baseline",
    "best_score",
    "kfac_rows",
    "planned_steps_trials",
    "row_medians",
    "row_scores",
    "setting_choice",
    "steps_ratio",
    "steps_to",
    "target_of",
]

#: The phases of a steps-scored workload, in order.
STEPS_PHASES = ("target-tune", "target-seeds", "pilot", "score")
#: Seeds of pilot trials and of scored study s are offsets plus the trial's index (the
#: same seeds for every row: trial i of study s reads the same batches for every optimizer).
PILOT_SEED, STUDY_SEED = 500, 1000


@dataclass(frozen=True)
class StepsWorkload:
    """A workload scored in steps to a target set by its baselines (see the module).

    Attributes:
        name: The ratio lines' label (``text``).
        revision: The protocol's revision (records know it by :attr:`key`).
        description: One line for the report.
        flags: ``spdkfac train`` flags of every run (model, data, validation split).
        budget: The target-setting runs' budget, in steps.
        metric: The validation score (lower is better).
        baselines: The other optimizers' rows, in the order runs alternate.
        setters: The baselines whose tuning sets the target.
        setter_trials: Target-setting tuning trials per setter.
        setting_seeds: Seeds of the chosen configuration's target-setting runs.
        candidates: The K-FAC rows the pilots choose among, by ``--optimizer``-like name.
        pilot_trials: Pilot trials per candidate.
        kfac_rows: How many candidates become study rows (the first is primary).
        studies: Independent studies per row.
        trials: Trials per study.
        evaluations: At least this many evaluations per run, evenly spaced.
        budget_factor: The scored budget over the setters' median steps to the target.
        changes: What the revision changed and why (for the report).
        pilots: What was tried before the revision and left out of it (for the report).
    """

    name: str
    revision: int
    description: str
    flags: tuple[str, ...]
    budget: int
    metric: str
    baselines: dict[str, SearchSpace]
    setters: tuple[str, ...]
    setter_trials: int
    setting_seeds: tuple[int, ...]
    candidates: dict[str, SearchSpace]
    pilot_trials: int
    kfac_rows: int
    studies: int
    trials: int
    evaluations: int = 50
    budget_factor: Fraction = Fraction(4, 3)
    changes: str = ""
    pilots: str = ""

    @property
    def key(self) -> str:
        return f"{self.name}-r{self.revision}"

    @property
    def title(self) -> str:
        return f"{self.name} (revision {self.revision})"

    @property
    def available(self) -> tuple[str, ...]:
        """The candidates ``spdkfac train --optimizer`` has (the pilots try these)."""
        return tuple(
            name for name, space in self.candidates.items() if space.fixed[1] in OPTIMIZERS
        )

    def space(self, row: str) -> SearchSpace:
        return {**self.baselines, **self.candidates}[row]

    def every(self, budget: int) -> int:
        """The evaluation interval of a run of ``budget`` steps."""
        return max(1, budget // self.evaluations)

    def flags_for(self, row: str, hparams: dict[str, Any], budget: int, seed: int) -> list[str]:
        """A run's flags: the schedule ends at ``budget``, warm-up a fraction of it."""
        flags = [*self.flags, *self.space(row).fixed]
        flags += ["--max-steps", str(budget), "--lr-schedule-steps", str(budget)]
        warmup = round(float(hparams.get("warmup", 0.0)) * budget)
        if warmup > 0:
            flags += ["--warmup-steps", str(warmup)]
        for name in self.space(row).dimensions:
            if name in hparams and name != "warmup":
                flags += ["--" + name.replace("_", "-"), show(hparams[name])]
        return [*flags, "--eval-every", str(self.every(budget)), "--seed", str(seed)]

    def trial(
        self, row: str, phase: str, index: int, seed: int, hparams: dict[str, Any], budget: int
    ) -> Trial:
        flags = tuple(self.flags_for(row, hparams, budget, seed))
        return Trial(self.key, row, phase, index, seed, hparams, flags)

    def draws(self, row: str, stage: str, count: int) -> list[dict[str, Any]]:
        """``count`` draws of ``row``'s space from a generator of its own per stage."""
        rng = random.Random(f"{self.key}/{stage}/{row}")
        return [self.space(row).sample(rng) for _ in range(count)]

    def protocol(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "revision": self.revision,
            "scoring": "steps to target (AlgoPerf's rules)",
            "flags": list(self.flags),
            "budget": [self.budget, "steps"],
            "metric": self.metric,
            "setters": list(self.setters),
            "setter_trials": self.setter_trials,
            "setting_seeds": list(self.setting_seeds),
            "budget_factor": str(self.budget_factor),
            "pilot_trials": self.pilot_trials,
            "kfac_rows": self.kfac_rows,
            "studies": self.studies,
            "trials": self.trials,
            "evaluations": self.evaluations,
            "spaces": {
                name: {
                    "fixed": list(space.fixed),
                    "dimensions": {k: d.describe() for k, d in space.dimensions.items()},
                }
                for name, space in {**self.baselines, **self.candidates}.items()
            },
        }


@dataclass(frozen=True)
class Target:
    """The target and the scored budget the target-setting runs set."""

    value: float
    budget: int
    setter: str
    setter_steps: float


def _mine(
    records: Sequence[dict[str, Any]], workload: StepsWorkload, phase: str
) -> list[dict[str, Any]]:
    return [r for r in records if r["workload"] == workload.key and r["phase"] == phase]


def _all_done(trials: Sequence[Trial], records: Sequence[dict[str, Any]]) -> bool:
    done = {r["id"] for r in records}
    return all(t.id in done for t in trials)


def _scores(record: dict[str, Any], metric: str) -> list[tuple[int, float]]:
    rows = record.get("summary", {}).get("metrics", []) if record["status"] == "ok" else []
    return [(int(row["step"]), float(row[metric])) for row in rows if row.get(metric) is not None]


def best_score(record: dict[str, Any], metric: str) -> float:
    """A run's lowest ``metric`` over its evaluations (infinity: failed or none)."""
    values = [v for _, v in _scores(record, metric) if math.isfinite(v)]
    return min(values, default=math.inf)


def steps_to(record: dict[str, Any], metric: str, target: float) -> float:
    """The step of a run's first evaluation at or below ``target`` (infinity: never)."""
    return next((float(s) for s, v in _scores(record, metric) if v <= target), math.inf)


def _median(values: Sequence[float]) -> float:
    """The median, infinity counted as the largest value (the lower middle of an even count
    would favour misses; there is none with an odd count)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if len(ordered) % 2 else statistics.median(ordered)


def _setter_tuning(workload: StepsWorkload) -> list[Trial]:
    draws = {row: workload.draws(row, "target", workload.setter_trials) for row in workload.setters}
    return [
        workload.trial(row, "target-tune", index, 0, draws[row][index], workload.budget)
        for index in range(workload.setter_trials)
        for row in workload.setters
    ]


def setting_choice(
    workload: StepsWorkload, records: Sequence[dict[str, Any]]
) -> dict[str, Any] | None:
    """The target-setting trial with the lowest best score (None until all are recorded)."""
    if not _all_done(_setter_tuning(workload), records):
        return None
    tuned = _mine(records, workload, "target-tune")
    best = min(tuned, key=lambda r: (best_score(r, workload.metric), r["index"], r["optimizer"]))
    return best if math.isfinite(best_score(best, workload.metric)) else None


def _setting_runs(workload: StepsWorkload, records: Sequence[dict[str, Any]]) -> list[Trial]:
    chosen = setting_choice(workload, records)
    if chosen is None:
        return []
    return [
        workload.trial(
            chosen["optimizer"], "target-seeds", seed, seed, chosen["hparams"], workload.budget
        )
        for seed in workload.setting_seeds
    ]


def target_of(workload: StepsWorkload, records: Sequence[dict[str, Any]]) -> Target | None:
    """The target (median of the setting runs' best scores) and the scored budget (the
    budget factor times their median steps to it, rounded up); None until recorded."""
    runs = _setting_runs(workload, records)
    if not runs or not _all_done(runs, records):
        return None
    ids = {t.id for t in runs}
    mine = [r for r in records if r["id"] in ids]
    value = _median([best_score(r, workload.metric) for r in mine])
    steps = _median([steps_to(r, workload.metric, value) for r in mine])
    if not math.isfinite(steps):
        return None
    budget = math.ceil(workload.budget_factor * Fraction(int(steps)))
    return Target(value, budget, mine[0]["optimizer"], steps)


def _pilots(workload: StepsWorkload, target: Target) -> list[Trial]:
    draws = {
        row: workload.draws(row, "pilot", workload.pilot_trials) for row in workload.candidates
    }
    return [
        workload.trial(row, "pilot", i, PILOT_SEED + i, draws[row][i], target.budget)
        for i in range(workload.pilot_trials)
        for row in workload.candidates
    ]


def kfac_rows(workload: StepsWorkload, records: Sequence[dict[str, Any]]) -> tuple[str, ...]:
    """The K-FAC rows the pilots chose, primary first: fewest steps to the target by a
    candidate's best pilot, then lowest best score (empty until every pilot is recorded)."""
    target = target_of(workload, records)
    if target is None or not _all_done(_pilots(workload, target), records):
        return ()
    pilots = _mine(records, workload, "pilot")

    def rank(row: str) -> tuple[float, float, int]:
        mine = [r for r in pilots if r["optimizer"] == row]
        steps = min(steps_to(r, workload.metric, target.value) for r in mine)
        score = min(best_score(r, workload.metric) for r in mine)
        return steps, score, list(workload.candidates).index(row)

    return tuple(sorted(workload.available, key=rank)[: workload.kfac_rows])


def _scored(workload: StepsWorkload, target: Target, rows: Sequence[str]) -> list[Trial]:
    trials = []
    for study in range(workload.studies):
        draws = {row: workload.draws(row, f"score/{study}", workload.trials) for row in rows}
        for i in range(workload.trials):
            seed = STUDY_SEED * (study + 1) + i
            for row in rows:
                index = study * workload.trials + i
                trials.append(
                    workload.trial(row, "score", index, seed, draws[row][i], target.budget)
                )
    return trials


def planned_steps_trials(
    workload: StepsWorkload, records: Sequence[dict[str, Any]], phase: str
) -> list[Trial]:
    """The trials of ``phase`` as far as the phases before it allow (none before)."""
    if phase == "target-tune":
        return _setter_tuning(workload)
    if phase == "target-seeds":
        return _setting_runs(workload, records)
    target = target_of(workload, records)
    if target is None:
        return []
    if phase == "pilot":
        return _pilots(workload, target)
    rows = kfac_rows(workload, records)
    return _scored(workload, target, (*workload.baselines, *rows)) if rows else []


def row_scores(
    workload: StepsWorkload, records: Sequence[dict[str, Any]], target: Target
) -> dict[str, list[float]]:
    """Each row's study scores (the minimum steps to the target over a study's recorded
    trials), for the studies with every trial recorded."""
    scored = _mine(records, workload, "score")
    result: dict[str, list[float]] = {}
    for row in (*workload.baselines, *kfac_rows(workload, records)):
        studies = []
        for study in range(workload.studies):
            indices = range(study * workload.trials, (study + 1) * workload.trials)
            mine = [r for r in scored if r["optimizer"] == row and r["index"] in indices]
            if len(mine) == workload.trials:
                studies.append(min(steps_to(r, workload.metric, target.value) for r in mine))
        result[row] = studies
    return result


def row_medians(
    workload: StepsWorkload, records: Sequence[dict[str, Any]]
) -> dict[str, float] | None:
    """Each row's median study score (infinity: the median study never reaches the
    target); None until the target is set and every scored study is recorded."""
    target = target_of(workload, records)
    if target is None or not kfac_rows(workload, records):
        return None
    scores = row_scores(workload, records, target)
    if any(len(values) < workload.studies for values in scores.values()):
        return None
    return {row: _median(values) for row, values in scores.items()}


def best_baseline(workload: StepsWorkload, medians: Mapping[str, float]) -> str:
    """The baseline with the fewest median steps (the first declared on a tie)."""
    return min(workload.baselines, key=lambda row: medians[row])


def steps_ratio(
    workload: StepsWorkload, records: Sequence[dict[str, Any]]
) -> tuple[float, str] | None:
    """(the primary K-FAC row's median study score over the best baseline's, that
    baseline); None until every study is recorded or when either never reaches the target
    (``n/a``: a miss is infinity, never a budget)."""
    medians = row_medians(workload, records)
    if medians is None:
        return None
    primary, best = kfac_rows(workload, records)[0], best_baseline(workload, medians)
    if not (math.isfinite(medians[primary]) and math.isfinite(medians[best])):
        return None
    return medians[primary] / medians[best], best
