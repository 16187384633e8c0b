"""The declared protocol: workloads, targets, budgets, search spaces and the trials they make.

Everything here is fixed before any run: a study directory stores :meth:`StudyPlan.
protocol` and refuses to continue under a different one. Search dimensions map to
``spdkfac train`` options, except ``schedule`` (the schedule's length as a fraction of
the workload's budget: an optimizer may end early) and ``warmup`` (the linear warm-up as a
fraction of that schedule), which :meth:`Workload.flags_for` translates.

A workload whose target the baselines set (``target_setting``, AlgoPerf's rule) has a
phase between tuning and the final runs: each baseline's chosen configuration runs the
whole budget (schedule 1.0) with seeds :data:`TARGET_SEED_OFFSET` + the final seeds
(:func:`target_trial`); the target is the best baseline's median final score.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "TARGET_SEED_OFFSET",
    "Choice",
    "Dimension",
    "LogUniform",
    "SearchSpace",
    "StudyPlan",
    "Trial",
    "Workload",
    "final_trial",
    "show",
    "target_trial",
    "tuning_trials",
]

#: Target-setting runs use the final runs' seeds plus this (independent of the final runs).
TARGET_SEED_OFFSET = 100


def show(value: Any) -> str:
    """A drawn value as a flag and the report write it: numbers in ``g`` format (3
    significant digits at most, as drawn), names (``reduce``) as they are."""
    return value if isinstance(value, str) else f"{value:g}"


@dataclass(frozen=True)
class LogUniform:
    """A number drawn log-uniformly from [low, high], kept to 3 significant digits."""

    low: float
    high: float

    def sample(self, rng: random.Random) -> float:
        value = math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        return float(f"{value:.3g}")

    def describe(self) -> str:
        return f"log-uniform in [{self.low:g}, {self.high:g}]"


@dataclass(frozen=True)
class Choice:
    """One of a few values (numbers or a flag's names), uniformly."""

    values: tuple[Any, ...]

    def sample(self, rng: random.Random) -> Any:
        return rng.choice(self.values)

    def describe(self) -> str:
        return "one of {" + ", ".join(map(show, self.values)) + "}"


Dimension = LogUniform | Choice


@dataclass(frozen=True)
class SearchSpace:
    """An optimizer's flags and the dimensions its trials draw from."""

    fixed: tuple[str, ...]
    dimensions: dict[str, Dimension]

    def sample(self, rng: random.Random) -> dict[str, Any]:
        return {name: dimension.sample(rng) for name, dimension in self.dimensions.items()}


@dataclass(frozen=True)
class Workload:
    """A fixed task, its targets and budget, and each optimizer's search space.

    Attributes:
        name: ``fashion-mnist`` or ``text`` (the ratio lines use it).
        description: One line for the report.
        flags: ``spdkfac train`` flags of every run.
        budget: The most a run may train, in ``unit`` (``epochs`` or ``steps``).
        unit: ``epochs`` (``--epochs``) or ``steps`` (``--max-steps``).
        tune_flags: Extra flags of tuning trials (the validation split, evaluations).
        final_flags: Extra flags of final runs (the evaluation schedule).
        tune_metric: The score tuning trials are chosen on (held-out training data).
        final_metric: The score final runs are timed on.
        higher_is_better: Whether a larger score is better (accuracy) or not (bits/byte).
        targets: Fixed targets, or empty when ``reference`` sets the target.
        labels: The ratio line's label of each target ("" for a workload's only one).
        reference: The optimizer whose best configuration's final score is the target
            (None: the baselines' target-setting runs set it, or fixed targets).
        kfac: The K-FAC optimizers; the ratio divides the fastest one's time. The other
            optimizers are the baselines.
        spaces: Optimizer name -> search space, in the order runs alternate.
        revision: The protocol's revision; a revised protocol is a workload of its own
            (its trials are told apart by :attr:`key`) and the earlier one is retired.
        changes: For a revision after the first: what changed and why (for the report).
        tune_margin: How much stricter than ``targets`` tuning trials' targets are on the
            validation split (towards better scores), so that the configuration chosen
            there reaches the target on the test set too.
        trials: Tuning trials per optimizer (None: the study's number).
        target_setting: Whether the target comes from target-setting runs: each
            baseline's chosen configuration over the whole budget, the best baseline's
            median final score (AlgoPerf's rule; see :func:`target_trial`).
        pilots: What was tried before the study and left out of it, for the results
            (not part of the protocol: pilots are not study trials).
    """

    name: str
    description: str
    flags: tuple[str, ...]
    budget: int
    unit: str
    tune_flags: tuple[str, ...]
    final_flags: tuple[str, ...]
    tune_metric: str
    final_metric: str
    higher_is_better: bool
    targets: tuple[float, ...]
    labels: tuple[str, ...]
    reference: str | None
    kfac: tuple[str, ...]
    spaces: dict[str, SearchSpace]
    revision: int = 1
    changes: str = ""
    tune_margin: float = 0.0
    trials: int | None = None
    target_setting: bool = False
    pilots: str = ""

    @property
    def key(self) -> str:
        """What trials, records and the protocol file know the workload by: its name, with
        ``-r<revision>`` from the second revision on."""
        return self.name if self.revision == 1 else f"{self.name}-r{self.revision}"

    @property
    def baselines(self) -> tuple[str, ...]:
        """The optimizers that are not K-FAC, in the spaces' order."""
        return tuple(name for name in self.spaces if name not in self.kfac)

    @property
    def pace_reference(self) -> str:
        """The optimizer whose step is the unit tuning trials are compared in across
        machines: the reference optimizer, or the first (the plain baseline)."""
        return self.reference or next(iter(self.spaces))

    @property
    def title(self) -> str:
        """The name, with the revision from the second one on (headings)."""
        return self.name if self.revision == 1 else f"{self.name} (revision {self.revision})"

    def schedule_length(self, fraction: float) -> int:
        return max(1, round(self.budget * fraction))

    def flags_for(self, optimizer: str, hparams: dict[str, Any]) -> list[str]:
        """The optimizer's flags with ``hparams`` (no phase flags, no seed)."""
        flags = [*self.flags, *self.spaces[optimizer].fixed]
        length = self.schedule_length(float(hparams.get("schedule", 1.0)))
        flags += (
            ["--epochs", str(length)]
            if self.unit == "epochs"
            else ["--max-steps", str(length), "--lr-schedule-steps", str(length)]
        )
        warmup = float(hparams.get("warmup", 0.0)) * length
        if self.unit == "epochs" and warmup > 0:
            flags += ["--warmup-epochs", f"{warmup:g}"]
        elif self.unit == "steps" and round(warmup) > 0:
            flags += ["--warmup-steps", str(round(warmup))]
        # In the space's order, so a record read back (keys sorted) gives the same flags.
        for name in self.spaces[optimizer].dimensions:
            if name in hparams and name not in ("schedule", "warmup"):
                flags += ["--" + name.replace("_", "-"), show(hparams[name])]
        return flags

    def protocol(self) -> dict[str, Any]:
        revision: dict[str, Any] = {} if self.revision == 1 else {"revision": self.revision}
        if self.tune_margin:
            revision["tune_margin"] = self.tune_margin
        if self.trials is not None:
            revision["trials"] = self.trials
        if self.target_setting:
            revision["target_setting"] = {
                "optimizers": list(self.baselines),
                "seeds": f"final seeds + {TARGET_SEED_OFFSET}",
                "schedule": 1.0,
                "target": f"best median final {self.final_metric}",
            }
        return {
            "name": self.name,
            **revision,
            "flags": list(self.flags),
            "budget": [self.budget, self.unit],
            "tune_flags": list(self.tune_flags),
            "final_flags": list(self.final_flags),
            "metrics": [self.tune_metric, self.final_metric],
            "targets": list(self.targets),
            "reference": self.reference,
            "spaces": {
                name: {
                    "fixed": list(space.fixed),
                    "dimensions": {k: d.describe() for k, d in space.dimensions.items()},
                }
                for name, space in self.spaces.items()
            },
        }


@dataclass(frozen=True)
class Trial:
    """One ``spdkfac train`` run of the study: a tuning trial, a target-setting run
    (phase ``target``) or a final run."""

    workload: str
    optimizer: str
    phase: str
    index: int
    seed: int
    hparams: dict[str, Any] = field(compare=False)
    flags: tuple[str, ...]

    @property
    def id(self) -> str:
        """Stable across restarts; a changed flag makes it another trial."""
        text = json.dumps([self.workload, self.optimizer, self.phase, self.seed, self.flags])
        digest = hashlib.sha256(text.encode()).hexdigest()[:8]
        return f"{self.phase}-{self.workload}-{self.optimizer}-{self.index:02d}-{digest}"


@dataclass(frozen=True)
class StudyPlan:
    """The whole study: workloads, trials per optimizer, seeds, world size, the retired
    revisions of workloads (their trials stay in the report; none runs again) and the
    workloads scored in steps (:mod:`study.steps`, their own phases and trial counts)."""

    workloads: tuple[Workload, ...]
    trials: int
    seeds: tuple[int, ...]
    tune_seed: int = 0
    workers: int = 2
    smoke: bool = False
    notes: tuple[str, ...] = ()
    retired: tuple[Workload, ...] = ()
    #: Workloads scored in steps to a target (``study.steps.StepsWorkload``).
    steps: tuple[Any, ...] = ()

    def workload(self, name: str) -> Workload:
        return next(w for w in self.workloads if w.name == name)

    def trials_of(self, workload: Workload) -> int:
        """Tuning trials per optimizer of ``workload``: its own number, or the study's."""
        return self.trials if workload.trials is None else workload.trials

    @property
    def target_seeds(self) -> tuple[int, ...]:
        """The seeds of target-setting runs."""
        return tuple(TARGET_SEED_OFFSET + seed for seed in self.seeds)

    def protocol(self) -> dict[str, Any]:
        """What a resumed study must share with the one it continues: the study-wide
        settings, and each workload's own (a study may run its workloads one at a time)."""
        return {
            "study": {
                "trials": self.trials,
                "seeds": list(self.seeds),
                "tune_seed": self.tune_seed,
                "workers": self.workers,
                "smoke": self.smoke,
            },
            "workloads": {w.key: w.protocol() for w in (*self.workloads, *self.steps)},
        }


def tuning_trials(plan: StudyPlan, workload: Workload) -> list[Trial]:
    """Every tuning trial of ``workload``: trial i of each optimizer in turn, so the
    optimizers alternate on the machine. Each optimizer's draws come from its own seeded
    generator, the same on every restart."""
    drawn = {}
    for optimizer, space in workload.spaces.items():
        rng = random.Random(f"{plan.tune_seed}/{workload.key}/{optimizer}")
        drawn[optimizer] = [space.sample(rng) for _ in range(plan.trials_of(workload))]
    trials = []
    for index in range(plan.trials_of(workload)):
        for optimizer in workload.spaces:
            hparams = drawn[optimizer][index]
            flags = workload.flags_for(optimizer, hparams) + list(workload.tune_flags)
            flags += ["--seed", str(plan.tune_seed)]
            trials.append(
                Trial(workload.key, optimizer, "tune", index, plan.tune_seed, hparams, tuple(flags))
            )
    return trials


def final_trial(workload: Workload, optimizer: str, hparams: dict[str, Any], seed: int) -> Trial:
    """The final run of ``optimizer``'s chosen ``hparams`` with ``seed``."""
    flags = workload.flags_for(optimizer, hparams) + list(workload.final_flags)
    flags += ["--seed", str(seed)]
    return Trial(workload.key, optimizer, "final", seed, seed, hparams, tuple(flags))


def target_trial(workload: Workload, optimizer: str, hparams: dict[str, Any], seed: int) -> Trial:
    """The target-setting run of a baseline's chosen ``hparams``: its schedule stretched to
    the whole budget (``schedule`` 1.0, warm-up the same fraction of it), the final runs'
    evaluations, ``seed``."""
    whole = {**hparams, "schedule": 1.0} if "schedule" in hparams else dict(hparams)
    flags = workload.flags_for(optimizer, whole) + list(workload.final_flags)
    flags += ["--seed", str(seed)]
    return Trial(workload.key, optimizer, "target", seed, seed, whole, tuple(flags))
