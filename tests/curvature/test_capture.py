"""Hooks capture only training forwards with autograd on, and leave no trace when removed."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spdkfac import KFACPreconditioner


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(inplace=True), nn.Linear(5, 3))


def _train_step(model: nn.Module, precond: KFACPreconditioner, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(8, 6, generator=generator)
    targets = torch.randint(0, 3, (8,), generator=generator)
    model.zero_grad()
    F.cross_entropy(model(inputs), targets).backward()
    precond.step()


def _pending(precond: KFACPreconditioner) -> list[object]:
    pending = precond._stages.collector._pending.values()
    return [p.total for p in pending if p.total is not None]


def test_eval_and_no_grad_forwards_are_not_captured() -> None:
    model = _model()
    reference = copy.deepcopy(model)
    precond = KFACPreconditioner(model)
    reference_precond = KFACPreconditioner(reference)
    for step in range(3):
        # Interleave forwards that must be invisible: eval mode, and no_grad in train mode.
        model.eval()
        model(torch.randn(4, 6)).sum()
        model.train()
        with torch.no_grad():
            model(torch.randn(4, 6))
        assert _pending(precond) == []
        _train_step(model, precond, step)
        _train_step(reference, reference_precond, step)
    for name in precond.layers:
        for ours, theirs in zip(
            precond.factors(name), reference_precond.factors(name), strict=True
        ):
            assert ours is not None and theirs is not None
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert precond.steps == reference_precond.steps == 3


def test_remove_leaves_the_model_as_it_was() -> None:
    model = _model()
    plain = copy.deepcopy(model)
    hooks_before = [
        (len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks))
        for m in model.modules()
    ]
    precond = KFACPreconditioner(model)
    assert any(len(m._forward_pre_hooks) for m in model.modules())
    _train_step(model, precond, 0)
    precond.remove()
    hooks_after = [
        (len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks))
        for m in model.modules()
    ]
    assert hooks_after == hooks_before
    # No capture after removal, and the model computes exactly what a plain copy does.
    plain.load_state_dict(model.state_dict())
    inputs = torch.randn(4, 6)
    out = model(inputs)
    out.sum().backward()
    assert _pending(precond) == []
    torch.testing.assert_close(out, plain(inputs), rtol=0, atol=0)


def test_gradient_accumulation_averages_micro_batches() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 3))
    full = copy.deepcopy(model)
    precond = KFACPreconditioner(model, kl_clip=None, accumulation_steps=2)
    reference = KFACPreconditioner(full, kl_clip=None)
    inputs = torch.randn(8, 4)
    for half in (inputs[:4], inputs[4:]):
        (model(half).pow(2).mean() / 2).backward()
    precond.step()
    full(inputs).pow(2).mean().backward()
    reference.step()
    a_factor, g_factor = precond.factors("0")
    augmented = torch.cat([inputs, torch.ones(8, 1)], dim=1)
    torch.testing.assert_close(a_factor, augmented.T @ augmented / 8)
    # The usual recipe (loss / k per pass) gives the full batch's G, not k² times less.
    torch.testing.assert_close(g_factor, reference.factors("0")[1])


def test_forgotten_accumulation_steps_is_reported() -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    precond = KFACPreconditioner(model, kl_clip=None)
    for _ in range(3):
        (model(torch.randn(4, 4)).pow(2).mean() / 3).backward()
    with pytest.warns(RuntimeWarning, match="set accumulation_steps=3"):
        precond.step()


def test_a_layer_called_several_times_in_one_pass_is_not_forgotten_accumulation() -> None:
    """An unrolled cell (the only registered layer, 3 calls in one backward pass) is not
    three accumulation passes: no warning blaming ``accumulation_steps``."""
    torch.manual_seed(0)
    cell = nn.Linear(4, 4)
    precond = KFACPreconditioner(cell, kl_clip=None)
    h = torch.randn(5, 4)
    for _ in range(3):
        h = torch.tanh(cell(h))
    h.pow(2).mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert precond.step()
