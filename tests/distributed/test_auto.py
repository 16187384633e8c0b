"""``strategy="auto"``: ranks agree on one candidate whatever their clocks say, training
matches the chosen composition run from the start, and a resume keeps (or, on another world
size, re-runs) the choice."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed_helper import run_distributed
from spdkfac import KFACPreconditioner
from spdkfac.engine.autotune import ROUND_MARGIN
from tiny_models import conv_net

CANDIDATES = ("d-kfac", "spd-kfac", "osawa")
#: Seconds per iteration each rank's fake clock reports for each candidate: alone, rank 0
#: would pick d-kfac and rank 1 spd-kfac; on the slowest rank's times spd-kfac and osawa
#: are within ROUND_MARGIN, run again (a second round), and osawa is chosen.
SKEWED = {0: (1.0, 2.0 * (1 + ROUND_MARGIN / 2), 2.0), 1: (5.0, 1.0, 2.0), 2: (2.0, 2.0, 2.0)}
#: Enough for two rounds of three candidates (switching back included) and a few steps more.
STEPS = 24
BATCH = 12


def _model() -> nn.Module:
    return conv_net()


def _options(strategy: str) -> dict[str, object]:
    return {
        "strategy": strategy,
        "auto_candidates": CANDIDATES,
        "auto_trial_steps": 2,
        "fusion_warmup_steps": 2,
        "damping": 0.05,
        "kl_clip": None,
        "lr": 0.1,
        "inv_update_steps": 1,  # the trials time refresh cycles of one step
    }


def _train(strategy: str, rank: int, world_size: int, clock_skew: bool = False):
    model = DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    precond = KFACPreconditioner(model, **_options(strategy))  # type: ignore[arg-type]
    now = [0.0]  # a fake clock: each iteration lasts what SKEWED says for this rank
    if clock_skew:
        auto = precond._auto  # the tuner's clock: a test may skew it per rank
        assert auto is not None
        auto._clock = lambda: now[0]
    share = BATCH // world_size
    compositions = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(BATCH, 2, 4, 4, generator=generator, dtype=torch.float64)
        targets = torch.randint(0, 3, (BATCH,), generator=generator)
        part = slice(rank * share, (rank + 1) * share)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs[part]), targets[part]).backward()
        now[0] += SKEWED[rank][CANDIDATES.index(precond.composition)]
        assert precond.step()
        optimizer.step()
        compositions.append(precond.composition)
    params = {name: p.detach().clone() for name, p in model.module.named_parameters()}
    return precond, params, compositions


def _counting_groups(run):
    """``run()``'s result and how many process groups it created."""
    created = [0]
    new_group = dist.new_group

    def counting(*args, **kwargs):
        created[0] += 1
        return new_group(*args, **kwargs)

    dist.new_group = counting
    try:
        precond, _, compositions = run()
    finally:
        dist.new_group = new_group
    return precond, compositions, created[0]


def _worker(rank: int, world_size: int, saved: dict | None) -> dict[str, object]:
    out: dict[str, object] = {}
    auto, params, compositions = _train("auto", rank, world_size)
    choice = auto.strategy_choice
    assert choice is not None
    out["chosen"], out["compositions"] = choice.chosen, compositions
    out["describe"] = choice.describe()
    _, fixed, _ = _train(choice.chosen, rank, world_size)
    out["params"], out["fixed"] = params, fixed
    skewed, _, groups = _counting_groups(lambda: _train("auto", rank, world_size, clock_skew=True))
    assert skewed.strategy_choice is not None
    # spd-kfac is tried twice: its pipelined buckets' group is created once, for all.
    out["groups"] = groups
    out["skewed"] = skewed.strategy_choice.chosen, skewed.strategy_choice.finalists
    out["state"] = auto.state_dict()
    if saved is not None:  # a state dict of another world size: the trials run again
        resumed = KFACPreconditioner(DistributedDataParallel(_model()), **_options("auto"))  # type: ignore[arg-type]
        resumed.load_state_dict(saved)
        out["resumed"] = (resumed.composition, resumed.strategy_choice)
    same = KFACPreconditioner(DistributedDataParallel(_model()), **_options("auto"))  # type: ignore[arg-type]
    same.load_state_dict(out["state"])  # type: ignore[arg-type]
    assert same.strategy_choice is not None
    out["same_world"] = (same.composition, same.strategy_choice.chosen)
    # The constructor's last collective creates a group; a rank that returned at once could
    # close its end while another still connects to it (gloo "connection closed by peer").
    dist.barrier()
    return out


def _check(results: list[dict[str, object]]) -> None:
    chosen = results[0]["chosen"]
    assert chosen in CANDIDATES
    for result in results:
        assert result["chosen"] == chosen, [r["chosen"] for r in results]
        assert result["compositions"] == results[0]["compositions"]
        # argmin of the slowest rank's means, after a second round of the two close ones
        assert result["skewed"] == ("osawa", ("osawa", "spd-kfac"))
        assert result["groups"] == 1
        assert result["same_world"] == (chosen, chosen)  # kept without new trials
        for name, value in result["params"].items():  # type: ignore[union-attr]
            torch.testing.assert_close(value, result["fixed"][name])  # type: ignore[index]
    tried = results[0]["compositions"]
    assert set(CANDIDATES) <= set(tried) and tried[-1] == chosen  # type: ignore[arg-type]
    assert str(chosen) in str(results[0]["describe"])


def test_auto_agrees_and_matches_the_chosen_composition_at_two_and_three_ranks() -> None:
    two = run_distributed(_worker, 2, None, timeout=240)
    _check(two)
    three = run_distributed(_worker, 3, two[0]["state"], timeout=300)
    _check(three)
    for result in three:
        composition, choice = result["resumed"]
        assert composition == CANDIDATES[0] and choice is None  # trials again at 3 ranks
