"""``strategy="auto"``: try the candidate compositions online, keep the fastest.

Which composition wins depends on the model, the link and the machine (hidden
communication comes back as slower compute when the collectives' threads share the cores),
so ``auto`` measures instead of guessing: during the first steps of training each
candidate runs in turn — its warm-up first (a measured fusion plans after
``fusion_warmup_steps`` factor steps), then at least ``auto_trial_steps`` timed steps —
and the candidate with the lowest *amortized* iteration time on the *slowest* rank is
kept. Steps are timed by kind (inverse refresh, factor refresh, plain) and each kind's
median is weighted by its share at the configured refresh intervals, so refresh steps
count in their true proportion (the amortized mean, not the median of all steps). The
first candidate starts timing only after ``auto_trial_steps`` steps of training. When
inverses refresh less often than the trial lasts, the candidate's inverse phase is timed
once on its own (its results are discarded: the inverses in use stay those of the last
scheduled refresh) and an inverse step costs a factor step plus that phase.

Ten steps cannot separate compositions within a few per cent on a busy machine, and a
machine drifts while the trials run (caches, allocator, other load), so the trials run in
``auto_rounds`` rounds: after a round the candidates whose estimate is within
:data:`ROUND_MARGIN` of the fastest run again, in reverse order (the last one goes on
without a switch; a drift then weighs on them more evenly), and their samples are pooled.
The rest are dropped. This is successive halving's idea (Jamieson and Talwalkar 2016,
"Non-stochastic Best Arm Identification and Hyperparameter Optimization") with a margin
instead of a fixed fraction: the extra steps go only to candidates that may still win.

Every rank follows the same schedule: it depends only on the step counter, the refresh
intervals and whether a candidate's fusion plan is final, all replicated. The decision is
one all-reduce (maximum over ranks of each candidate's mean) at the end of every round
(every rank keeps the same candidates: it compares the same agreed numbers) and one
broadcast of rank 0's choice, issued at the same step everywhere, so ranks whose clocks
disagree still pick the same candidate. Switching keeps the results: every candidate
computes the same update (up to rounding), and the preconditioner moves its state across
with ``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from spdkfac.comm import Communicator
from spdkfac.config import KFACConfig
from spdkfac.strategies import AutoStrategy, Strategy

__all__ = [
    "KINDS",
    "ROUND_MARGIN",
    "AutoChoice",
    "AutoTuner",
    "amortized_seconds",
    "kind_shares",
]


#: The kinds of step whose mean times make up the amortized iteration time.
KINDS = ("inverse", "factor", "plain")

#: After a round, the candidates whose estimate is at most this fraction above the fastest
#: run again (the spread of ten-step estimates of one composition on this project's 2-core
#: machine is about this large).
ROUND_MARGIN = 0.05


def kind_shares(factor_interval: int, inverse_interval: int) -> dict[str, float]:
    """The share of steps of each kind: inverse steps (which are also factor steps when
    ``factor_interval`` divides ``inverse_interval``), other factor steps, plain steps."""
    inverse = 1.0 / inverse_interval
    factor = max(0.0, 1.0 / factor_interval - inverse)
    return {"inverse": inverse, "factor": factor, "plain": max(0.0, 1.0 - inverse - factor)}


def amortized_seconds(
    samples: Mapping[str, Sequence[float]], probe: float | None, shares: Mapping[str, float]
) -> float | None:
    """Mean iteration time with every kind of step in its share (each kind's median: one
    slow outlier must not decide); None while some kind with a share has no estimate. An
    inverse step not seen is a factor step plus the ``probe``'d inverse phase."""
    means = {kind: statistics.median(times) for kind, times in samples.items() if times}
    if "inverse" not in means and probe is not None and "factor" in means:
        means["inverse"] = means["factor"] + probe
    if any(share > 0 and kind not in means for kind, share in shares.items()):
        return None
    return sum(share * means[kind] for kind, share in shares.items() if share > 0)


@dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` measured and chose (identical on every rank).

    Attributes:
        chosen: Name of the kept composition (a row of :data:`~spdkfac.strategies.STRATEGIES`).
        seconds: Candidate name → amortized iteration time on the slowest rank.
        window: Most steps timed for one candidate.
        decided_at: The step after which the choice holds.
        finalists: The candidates of the last round (the others were dropped after an
            earlier one).
        rounds: Rounds of trials run.
    """

    chosen: str
    seconds: dict[str, float]
    window: int
    decided_at: int
    finalists: tuple[str, ...] = ()
    rounds: int = 1

    @property
    def dropped(self) -> tuple[str, ...]:
        """The candidates left out of the last round."""
        if not self.finalists:
            return ()
        return tuple(name for name in self.seconds if name not in self.finalists)

    def describe(self) -> str:
        """One line per candidate, fastest first, the chosen one marked."""
        lines = [
            f"strategy='auto' chose {self.chosen!r} at step {self.decided_at} (amortized "
            f"iteration time on the slowest rank, up to {self.window} steps timed each, "
            f"{self.rounds} round(s)):"
        ]
        for name, seconds in sorted(self.seconds.items(), key=lambda item: item[1]):
            mark = " <- chosen" if name == self.chosen else ""
            if name in self.dropped:
                mark = " (dropped after a round)"
            lines.append(f"  {name:<18} {seconds * 1e3:10.1f} ms{mark}")
        return "\n".join(lines)


@dataclass
class _Window:
    strategy: Strategy
    timing: bool = False  # its warm-up is over
    samples: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    probe: float | None = None
    estimate: float | None = None
    before: int = 0  # steps timed in earlier rounds

    @property
    def steps(self) -> int:
        return sum(len(times) for times in self.samples.values())


class AutoTuner:
    """The trial schedule and the decision of ``strategy="auto"`` (module docstring).

    Args:
        candidates: The compositions to try, in trial order (the first runs first).
        communicator: The group the decision is agreed over.
        min_steps: Fewest timed steps per candidate and round.
        rounds: Most rounds of trials (module docstring); 1 tries each candidate once.
        clock: Seconds of this rank's clock (a test may skew it per rank).
    """

    def __init__(
        self,
        candidates: Sequence[Strategy],
        communicator: Communicator,
        *,
        min_steps: int,
        rounds: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not candidates:
            raise ValueError("auto_candidates must name at least one strategy")
        self._windows = [_Window(strategy) for strategy in candidates]
        self._communicator = communicator
        self._min_steps = min_steps
        self._rounds = rounds
        self._round = 1
        self._clock = clock
        self._order = list(range(len(candidates)))  # window indices of this round, in turn
        self._position = 0
        self._mark: float | None = None
        self.choice: AutoChoice | None = None
        if communicator.world_size == 1 or len(candidates) == 1:
            # Nothing is exchanged with one rank: every composition is the same.
            self.choice = AutoChoice(candidates[0].name, {}, 0, 0)

    @classmethod
    def of(cls, config: KFACConfig, communicator: Communicator) -> AutoTuner | None:
        """The tuner of ``config`` (None unless ``strategy="auto"``)."""
        selection = config.selection
        if not isinstance(selection, AutoStrategy):
            return None
        return cls(
            list(selection.candidates),
            communicator,
            min_steps=config.auto_trial_steps,
            rounds=config.auto_rounds,
        )

    @property
    def candidates(self) -> list[Strategy]:
        """The compositions tried, in order."""
        return [window.strategy for window in self._windows]

    @property
    def current(self) -> Strategy:
        """The composition in use."""
        if self.choice is not None:
            return next(w.strategy for w in self._windows if w.strategy.name == self.choice.chosen)
        return self._window.strategy

    @property
    def _window(self) -> _Window:
        return self._windows[self._order[self._position]]

    @property
    def decided(self) -> bool:
        """Whether the trials are over."""
        return self.choice is not None

    def adopt(self, name: str, step: int) -> None:
        """Keep ``name`` without trials (a choice restored from a state dict)."""
        if self.choice is None or self.choice.chosen != name:
            if name not in {candidate.name for candidate in self.candidates}:
                return  # not a candidate of this configuration: trials decide
            self.choice = AutoChoice(name, {}, 0, step)

    def started(self) -> None:
        """Mark the start of the next iteration (after a step, and after any switch)."""
        self._mark = self._clock()

    def after_config_step(self, step: int, config: KFACConfig, *, settled: bool) -> Strategy | None:
        """:meth:`after_step` with the step's kind and intervals read from ``config``."""
        factor_interval, inverse_interval = config.intervals_at(step)
        kind = (
            "inverse"
            if config.is_inverse_step(step)
            else "factor"
            if config.is_factor_step(step)
            else "plain"
        )
        return self.after_step(
            step,
            kind=kind,
            settled=settled,
            factor_interval=factor_interval,
            inverse_interval=inverse_interval,
        )

    def after_step(
        self,
        step: int,
        *,
        kind: str,
        settled: bool,
        factor_interval: int,
        inverse_interval: int,
    ) -> Strategy | None:
        """Account for completed ``step``; the composition to switch to, if any.

        Collective on the step that ends a round (every rank reaches it at the same step).

        Args:
            step: The step just completed (0-based).
            kind: ``"inverse"``, ``"factor"`` or ``"plain"``.
            settled: Whether the current candidate's fusion plan is final (replicated).
            factor_interval: The factor refresh interval at this step.
            inverse_interval: The inverse refresh interval at this step.
        """
        if self.choice is not None:
            return None
        window = self._window
        first = self._round == 1 and self._position == 0
        if window.timing and self._mark is not None:
            window.samples[kind].append(self._clock() - self._mark)
        elif settled and (not first or step + 1 >= self._min_steps):
            # Timed from the next step on; the first candidate also waits out the
            # training's own first steps (allocator and caches warming up).
            window.timing = True
            return None
        else:
            return None
        shares = kind_shares(factor_interval, inverse_interval)
        window.estimate = amortized_seconds(window.samples, window.probe, shares)
        if window.estimate is None or window.steps - window.before < self._min_steps:
            return None
        if self._position + 1 < len(self._order):
            self._position += 1
            return self._enter()
        return self._end_round(step)

    def _enter(self) -> Strategy:
        """Start the current window's turn in this round (its warm-up comes first)."""
        window = self._window
        window.timing = False
        window.before = window.steps
        return window.strategy

    def _end_round(self, step: int) -> Strategy | None:
        """Agree on the estimates; run the close candidates again or decide."""
        slowest = self._agreed()
        if self._round < self._rounds:
            best = min(slowest[i] for i in self._order)
            close = [i for i in self._order if slowest[i] <= best * (1.0 + ROUND_MARGIN)]
            if len(close) > 1:
                self._round += 1
                going_on = self._order[self._position]
                self._order, self._position = close[::-1], 0
                if self._order[0] == going_on:  # no switch: it goes on timing
                    self._window.before = self._window.steps
                    return None
                return self._enter()
        return self._decide(step, slowest)

    def wants_probe(self, inverse_interval: int) -> bool:
        """Whether to time one inverse phase now: the current window is timing, has none,
        and will likely see no inverse step (the interval exceeds the trial length)."""
        if self.choice is not None:
            return False
        window = self._window
        return (
            window.timing
            and window.probe is None
            and not window.samples["inverse"]
            and inverse_interval > self._min_steps
        )

    def probe(self, inverse_phase: Callable[[], None]) -> None:
        """Time ``inverse_phase`` (an inverse phase whose results are discarded) for
        :meth:`wants_probe`, on this tuner's clock."""
        began = self._clock()
        inverse_phase()
        self._window.probe = self._clock() - began

    def _agreed(self) -> list[float]:
        """Every candidate's estimate on the slowest rank (one all-reduce; a candidate not
        timed yet counts as infinitely slow)."""
        estimates = [math.inf if w.estimate is None else w.estimate for w in self._windows]
        means = torch.tensor(estimates, dtype=torch.float64).to(self._communicator.device)
        return self._communicator.all_reduce_max(means).wait().cpu().tolist()

    def _decide(self, step: int, slowest: Sequence[float]) -> Strategy:
        local_pick = min(self._order, key=lambda i: (slowest[i], i))
        pick = torch.tensor([float(local_pick)], dtype=torch.float64)
        agreed = self._communicator.broadcast(pick.to(self._communicator.device), src=0)
        chosen = self._windows[round(float(agreed.wait().cpu()[0]))].strategy
        self.choice = AutoChoice(
            chosen.name,
            {w.strategy.name: float(t) for w, t in zip(self._windows, slowest, strict=True)},
            max(w.steps for w in self._windows),
            step + 1,
            tuple(self._windows[i].strategy.name for i in self._order),
            self._round,
        )
        return chosen
