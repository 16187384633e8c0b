"""``strategy="auto"``'s trial schedule and decision, with a fake clock and a fake group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.futures import Future

from spdkfac import KFACPreconditioner
from spdkfac.comm import LocalCommunicator
from spdkfac.comm.base import completed
from spdkfac.engine.autotune import ROUND_MARGIN, AutoTuner, amortized_seconds, kind_shares
from spdkfac.strategies import STRATEGIES


class _TwoRanks(LocalCommunicator):
    """Rank 0 of 2 whose collectives complete at once with this rank's values."""

    @property
    def world_size(self) -> int:
        return 2

    def all_reduce_max(self, tensor: torch.Tensor) -> Future[torch.Tensor]:
        return completed(tensor)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Future[torch.Tensor]:
        return completed(tensor)


def test_kinds_are_weighted_by_their_share_of_steps() -> None:
    assert kind_shares(1, 1) == {"inverse": 1.0, "factor": 0.0, "plain": 0.0}
    shares = kind_shares(10, 100)
    assert shares == pytest.approx({"inverse": 0.01, "factor": 0.09, "plain": 0.9})
    samples = {"inverse": [], "factor": [2.0], "plain": [1.0, 1.0]}
    # An inverse step not seen costs a factor step plus the probed inverse phase.
    assert amortized_seconds(samples, 5.0, shares) == pytest.approx(0.07 + 0.18 + 0.9)
    assert amortized_seconds(samples, None, shares) is None  # no inverse estimate yet
    assert (
        amortized_seconds({"inverse": [3.0], "factor": [], "plain": []}, None, kind_shares(1, 1))
        == 3.0
    )


def _trials(seconds: dict[str, float], rounds: int) -> tuple[AutoTuner, list[tuple[str, int]], int]:
    """Run a tuner over ``seconds``' candidates (each plain step half as long as a factor
    step) until it decides: the tuner, its switches (name, step) and its probes."""
    now = [0.0]
    tuner = AutoTuner(
        [STRATEGIES[n] for n in seconds],
        _TwoRanks(),
        min_steps=3,
        rounds=rounds,
        clock=lambda: now[0],
    )
    order: list[tuple[str, int]] = []
    probes = 0
    for step in range(200):
        tuner.started()
        now[0] += seconds[tuner.current.name] * (0.5 if step % 10 else 1.0)
        kind = "factor" if step % 10 == 0 else "plain"
        # A measured fusion settles only after a few steps of its own.
        settled = tuner.current.name != "spd-kfac" or (len(order) and order[-1][1] + 4 <= step)
        following = tuner.after_step(
            step, kind=kind, settled=bool(settled), factor_interval=10, inverse_interval=100
        )
        if following is not None:
            order.append((following.name, step))
        if tuner.wants_probe(100):
            probes += 1
            tuner.probe(lambda: now.__setitem__(0, now[0] + 7.0))
        if tuner.decided:
            break
    return tuner, order, probes


@pytest.mark.parametrize("rounds", [1, 2])
def test_trials_warm_up_time_probe_and_keep_the_fastest(rounds: int) -> None:
    """No candidate within the margin of the fastest: one round, whatever ``rounds``."""
    seconds = {"d-kfac": 3.0, "spd-kfac": 1.0, "osawa": 2.0}
    tuner, order, probes = _trials(seconds, rounds)
    assert [name for name, _ in order] == ["spd-kfac", "osawa", "spd-kfac"]
    assert probes == 3  # one inverse phase timed per candidate
    choice = tuner.choice
    assert choice is not None and choice.chosen == "spd-kfac"
    # factor steps cost full time, plain ones half, the probe 7 s: 0.01·(s + 7) + 0.09·s + 0.9·s/2
    for name, value in choice.seconds.items():
        s = seconds[name]
        assert value == pytest.approx(0.01 * (s + 7.0) + 0.09 * s + 0.9 * s / 2)
    assert "spd-kfac" in choice.describe() and choice.rounds == 1


def test_close_candidates_run_again_in_reverse_order_and_pool_their_samples() -> None:
    """osawa is within ROUND_MARGIN of spd-kfac: both run again, osawa (the last) going on
    without a switch, then spd-kfac after its warm-up; d-kfac is dropped."""
    seconds = {"d-kfac": 3.0, "spd-kfac": 1.0, "osawa": 1.0 + ROUND_MARGIN / 2}
    tuner, order, probes = _trials(seconds, rounds=2)
    names = [name for name, _ in order]
    assert names == ["spd-kfac", "osawa", "spd-kfac", "spd-kfac"]
    assert probes == 3  # an inverse phase is timed once per candidate, not per round
    choice = tuner.choice
    assert choice is not None and choice.chosen == "spd-kfac"
    assert choice.rounds == 2 and choice.finalists == ("osawa", "spd-kfac")
    # Each finalist was timed in two rounds of at least 3 steps, d-kfac in one.
    assert choice.window >= 6
    assert "d-kfac" in choice.describe() and "dropped" in choice.describe()
    s = seconds["osawa"]
    assert choice.seconds["osawa"] == pytest.approx(0.01 * (s + 7.0) + 0.09 * s + 0.9 * s / 2)


def test_one_rank_decides_at_once_and_a_discarded_inverse_phase_changes_nothing() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    precond = KFACPreconditioner(model, strategy="auto", lr=0.1, inv_update_steps=50)
    assert precond.strategy_choice is not None and precond.composition == "d-kfac"
    inputs = torch.randn(8, 4, dtype=torch.float64)
    for _ in range(2):
        model.zero_grad()
        F.cross_entropy(model(inputs), torch.arange(8) % 3).backward()
        precond.step()
    before = {name: precond.inverses(name) for name in precond.layers}
    precond._state.discarded_inverse_phase(precond._stages, 0.7)  # what auto's probe runs
    for name, (a, g) in before.items():
        after_a, after_g = precond.inverses(name)
        assert after_a is a and after_g is g
    precond.remove()  # one preconditioner per model at a time
    with pytest.raises(ValueError, match="retune"):
        KFACPreconditioner(model, strategy="d-kfac", lr=0.1).retune()
    with pytest.raises(ValueError, match="auto_candidates"):
        KFACPreconditioner(model, strategy="auto", auto_candidates=("sgd",))
    with pytest.raises(ValueError, match="placement"):
        KFACPreconditioner(model, strategy="auto", placement="balanced")
