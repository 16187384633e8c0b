"""Same state keys on every rank (M21): a layer that gets no gradient on some step or on
some rank (an unused branch) leaves the preconditioner's ``state_dict()`` with identical
keys and shapes on every rank under every strategy (``dcp_state_dict()`` too where every
rank holds every block; the owner strategies save their own); ``load_state_dict(state_dict=...)``
works by keyword (as DCP calls it); with a stateful form too (eigen-Adam, with and without
Adam grafting), whose moments a rank that never preconditioned a layer saves fresh."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from distributed_helper import run_distributed
from parallel_cases import Branchy
from spdkfac import KFACPreconditioner

STRATEGIES = ("d-kfac", "spd-kfac", "osawa", "layer-paths")


def _shape(value: Any) -> Any:
    return tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__


def _keys(value: Any, path: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_keys(item, f"{path}/{key}"))
        return out
    return {path: _shape(value)}


def _worker(rank: int, world_size: int, form: dict[str, Any]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        model = Branchy().double()
        precond = KFACPreconditioner(
            model, strategy=strategy, factor_update_steps=1, inv_update_steps=1, **form
        )
        for step in range(3):  # side: unused, used on rank 0 only, used everywhere
            model.zero_grad(set_to_none=True)
            use = step == 2 or (step == 1 and rank == 0)
            x = torch.randn(
                3,
                4,
                dtype=torch.float64,
                generator=torch.Generator().manual_seed(step + 10 * rank),
            )
            model(x, use).square().sum().backward()
            precond.step()
            label = f"{strategy} {form} {step}"
            seen[label] = (_keys(precond.state_dict()), _keys(precond.dcp_state_dict()))
        precond.load_state_dict(state_dict=precond.state_dict())  # by keyword
    return seen


def _check(form: dict[str, Any]) -> None:
    first, second = run_distributed(_worker, 2, form, timeout=180)
    assert first.keys() == second.keys()
    for label, (plain, dcp) in first.items():
        assert plain == second[label][0], label
        if not label.startswith(("osawa", "layer-paths")):  # owners save their own blocks
            assert dcp == second[label][1], label


def test_unused_branches_leave_the_same_state_keys_on_every_rank() -> None:
    _check({})


def test_unused_branches_with_a_stateful_form() -> None:
    # Without DDP a replicated strategy preconditions local gradients, so eigen-Adam's
    # moments of a layer only some ranks reached exist on those ranks only: the others
    # save them fresh (zeros, step count 0), and read them back as fresh.
    _check({"inverse_method": "eigen-adam", "kl_clip": None})
    _check({"inverse_method": "eigen-adam", "kl_clip": None, "grafting": "adam"})
