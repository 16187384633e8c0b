"""Frozen parameters inside a registered layer are absent from its curvature block: the
weight's update is K-FAC of the trainable parameters only (explicit float64 references in
:mod:`frozen_cases`), fully frozen layers are not registered and are named once, and the
state dict holds the trainable-only factors."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from frozen_cases import (
    OPTIONS,
    check_against_reference,
    explicit_reference,
    frozen_batch,
    frozen_net,
)
from spdkfac import KFACPreconditioner


def _grads(model: nn.Module) -> dict[str, Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_frozen_biases_and_shift_are_left_out_of_the_blocks() -> None:
    inputs, targets = frozen_batch()
    expected = explicit_reference(frozen_net(), inputs, targets)
    model = frozen_net()
    with pytest.warns(UserWarning, match=r"frozen.*conv\.bias, fc\.bias, ln\.bias"):
        precond = KFACPreconditioner(model, **OPTIONS)  # type: ignore[arg-type]
    F.cross_entropy(model(inputs), targets).backward()
    assert precond.step()
    for name in ("conv", "fc", "head"):
        a_factor, g_factor = precond.factors(name)
        torch.testing.assert_close(a_factor, expected[f"{name}/A"], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(g_factor, expected[f"{name}/G"], rtol=1e-9, atol=1e-12)
    blocks, _ = precond.batchnorm_blocks("ln")
    assert blocks is not None
    torch.testing.assert_close(blocks[:, 0], expected["ln/F"], rtol=1e-9, atol=1e-12)
    assert torch.count_nonzero(blocks[:, 1:]) == 0  # no γ–β coupling, no F_ββ
    check_against_reference(_grads(model), expected)


def test_the_state_dict_holds_the_trainable_only_factors() -> None:
    inputs, targets = frozen_batch()
    model = frozen_net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        precond = KFACPreconditioner(model, **OPTIONS)  # type: ignore[arg-type]
        F.cross_entropy(model(inputs), targets).backward()
        precond.step()
        state = precond.state_dict()
        assert state["layers"]["fc"]["a_factor"].shape == (48, 48)
        assert state["layers"]["conv"]["a_factor"].shape == (18, 18)
        again = KFACPreconditioner(frozen_net(), **OPTIONS)  # type: ignore[arg-type]
        again.load_state_dict(state)
        torch.testing.assert_close(again.factors("fc")[0], precond.factors("fc")[0])
        trainable = frozen_net()
        trainable.fc.bias.requires_grad_(True)
        other = KFACPreconditioner(trainable, **OPTIONS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fc"):
        other.load_state_dict(state)


def test_a_fully_frozen_layer_is_not_registered_and_is_named_once() -> None:
    model = frozen_net()
    model.fc.requires_grad_(False)
    with pytest.warns(
        UserWarning, match=r"never preconditioned.*unfrozen later.*: conv\.bias, fc, ln\.bias"
    ):
        precond = KFACPreconditioner(model, **OPTIONS)  # type: ignore[arg-type]
    assert precond.layers == ["conv", "head"]
    # Gradual unfreezing: the layer unfrozen later keeps its plain gradient (the
    # documented choice), and the registered layers' shapes never change.
    model.fc.requires_grad_(True)
    inputs, targets = frozen_batch()
    F.cross_entropy(model(inputs), targets).backward()
    plain = {n: p.grad.clone() for n, p in model.fc.named_parameters()}
    assert precond.step()
    for name, parameter in model.fc.named_parameters():
        torch.testing.assert_close(parameter.grad, plain[name], rtol=0, atol=0)
    assert precond.factors("conv")[0].shape == (18, 18)  # type: ignore[union-attr]


def test_a_bias_unfrozen_later_keeps_its_plain_gradient() -> None:
    model = frozen_net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        precond = KFACPreconditioner(model, **OPTIONS)  # type: ignore[arg-type]
    model.fc.bias.requires_grad_(True)
    inputs, targets = frozen_batch()
    F.cross_entropy(model(inputs), targets).backward()
    plain = model.fc.bias.grad.clone()  # type: ignore[union-attr]
    assert precond.step()
    torch.testing.assert_close(model.fc.bias.grad, plain, rtol=0, atol=0)
    assert precond.factors("fc")[0].shape == (48, 48)  # type: ignore[union-attr]
