"""A state_dict round trip continues training bit-identically."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spdkfac import KFACPreconditioner


def _setup(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, KFACPreconditioner]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    precond = KFACPreconditioner(model, factor_update_steps=2, inv_update_steps=3, lr=0.05)
    return model, optimizer, precond


def _run(
    model: nn.Module, optimizer: torch.optim.Optimizer, precond: KFACPreconditioner, steps: range
) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(1000 + step)
        inputs = torch.randn(8, 1, 6, 6, generator=generator)
        targets = torch.randint(0, 3, (8,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        if precond.step():
            optimizer.step()


def test_round_trip_continues_bit_identically() -> None:
    model, optimizer, precond = _setup()
    _run(model, optimizer, precond, range(5))  # ends mid-interval for both refreshes
    buffer = io.BytesIO()
    torch.save(
        {
            "model": model.state_dict(),
            "optim": optimizer.state_dict(),
            "kfac": precond.state_dict(),
        },
        buffer,
    )
    _run(model, optimizer, precond, range(5, 12))

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed_model, resumed_optimizer, resumed_precond = _setup(seed=123)  # different init
    resumed_model.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optim"])
    resumed_precond.load_state_dict(saved["kfac"])
    assert resumed_precond.steps == 5
    _run(resumed_model, resumed_optimizer, resumed_precond, range(5, 12))

    for ours, theirs in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    for name in precond.layers:
        for ours, theirs in zip(
            precond.factors(name) + precond.inverses(name),
            resumed_precond.factors(name) + resumed_precond.inverses(name),
            strict=True,
        ):
            assert ours is not None and theirs is not None and torch.equal(ours, theirs)


def test_load_rejects_other_layers_and_shapes() -> None:
    _, _, precond = _setup()
    model2 = nn.Sequential(nn.Linear(3, 3))
    other = KFACPreconditioner(model2)
    with pytest.raises(ValueError, match="layers differ"):
        precond.load_state_dict(other.state_dict())
    state = precond.state_dict()
    state["layers"]["3"]["a_factor"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="a_factor of layer '3' has shape"):
        precond.load_state_dict(state)
    state["format"] = 99
    with pytest.raises(ValueError, match="format"):
        precond.load_state_dict(state)
