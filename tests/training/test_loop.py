"""The shared training step: accumulation, skipped updates, hook order, evaluation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac.comm import LocalCommunicator
from spdkfac.training.loop import (
    StepHooks,
    cross_entropy_pass,
    evaluate_accuracy,
    train_step,
)

__all__: list[str] = []


def _data() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 5, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


class _Skipping:
    """Stands in for K-FAC: records its calls and skips every update."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def step(self) -> bool:
        self.calls.append("precondition")
        return False


def test_one_pass_matches_the_hand_written_step() -> None:
    inputs, targets = _data()
    ours, theirs = _model(), _model()
    sgd_ours = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    sgd_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        outcome = train_step(ours, sgd_ours, None, [cross_entropy_pass(ours, inputs, targets)])
        sgd_theirs.zero_grad(set_to_none=True)
        loss = F.cross_entropy(theirs(inputs), targets)
        loss.backward()
        sgd_theirs.step()
        assert outcome.applied
        assert outcome.mean_loss == float(loss.detach())
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)


def test_micro_batches_accumulate_the_mean_gradient() -> None:
    inputs, targets = _data()
    whole, split = _model(), _model()
    halves = [
        cross_entropy_pass(split, inputs[:4], targets[:4]),
        cross_entropy_pass(split, inputs[4:], targets[4:]),
    ]
    outcome = train_step(split, torch.optim.SGD(split.parameters(), lr=0.0), None, halves)
    train_step(
        whole,
        torch.optim.SGD(whole.parameters(), lr=0.0),
        None,
        [cross_entropy_pass(whole, inputs, targets)],
    )
    assert len(outcome.losses) == 2
    expected = float(outcome.losses[0]) / 2 + float(outcome.losses[1]) / 2
    assert outcome.mean_loss == expected
    for a, b in zip(whole.parameters(), split.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_hooks_run_in_order_and_a_skipped_step_leaves_the_weights() -> None:
    inputs, targets = _data()
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    calls: list[str] = []

    def loss_pass() -> Tensor:
        calls.append("forward")
        return F.cross_entropy(model(inputs), targets)

    hooks = StepHooks(
        before_forward=lambda: calls.append("before_forward"),
        before_update=lambda: calls.append("before_update"),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outcome = train_step(model, optimizer, _Skipping(calls), [loss_pass], hooks=hooks)  # type: ignore[arg-type]
    assert calls == ["before_forward", "forward", "before_update", "precondition"]
    assert not outcome.applied
    for old, new in zip(before, model.parameters(), strict=True):
        assert torch.equal(old, new)


def test_no_passes_is_refused() -> None:
    model = _model()
    with pytest.raises(ValueError, match="passes"):
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), None, [])


def test_evaluate_accuracy_counts_every_example_and_restores_training_mode() -> None:
    inputs, _ = _data()
    model = _model()
    predicted = model(inputs).argmax(1)
    labels = torch.where(torch.arange(8) < 6, predicted, (predicted + 1) % 3)
    assert evaluate_accuracy(model, inputs, labels, LocalCommunicator()) == 6 / 8
    assert model.training
