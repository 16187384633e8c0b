"""The public API under misuse and unusual inputs: a correct result or a clear error."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac import KFACPreconditioner


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _backward(model: nn.Module, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(8, 4, generator=generator)
    targets = torch.randint(0, 3, (8,), generator=generator)
    F.cross_entropy(model(inputs), targets).backward()


def _grads(model: nn.Module) -> list[Tensor]:
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def test_a_second_step_without_backward_raises_and_changes_nothing() -> None:
    model = _model()
    precond = KFACPreconditioner(model, lr=0.1)
    _backward(model)
    assert precond.step()
    once = _grads(model)
    with pytest.raises(RuntimeError, match="without a new backward"):
        precond.step()
    for before, after in zip(once, _grads(model), strict=True):
        assert torch.equal(before, after)
    assert precond.steps == 1
    model.zero_grad()
    _backward(model, seed=2)
    assert precond.step()  # a new backward: fine again


def test_the_kl_clip_uses_the_optimizers_current_learning_rate() -> None:
    results = {}
    for label in ("optimizer", "explicit"):
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
        if label == "optimizer":
            precond = KFACPreconditioner(model, optimizer=optimizer, kl_clip=1e-12)
        else:  # the same rates given by hand: 1e-3 at step 0, 1e-4 at step 1
            precond = KFACPreconditioner(model, lr=lambda s: 1e-3 * 0.1**s, kl_clip=1e-12)
        for step in range(2):
            optimizer.zero_grad()
            _backward(model, seed=step)
            precond.step()
            optimizer.step()
            scheduler.step()
        results[label] = _grads(model)
    for a, b in zip(results["optimizer"], results["explicit"], strict=True):
        torch.testing.assert_close(a, b)


def test_no_learning_rate_for_the_kl_clip_is_reported() -> None:
    with pytest.warns(UserWarning, match="KL clip needs the learning rate"):
        KFACPreconditioner(_model())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KFACPreconditioner(_model(), kl_clip=None)
    with pytest.raises(ValueError, match="optimizer"):
        KFACPreconditioner(_model(), optimizer=torch.optim.SGD(_model().parameters(), lr=0.1))


def test_hyperparameters_change_through_update_config_and_assignments_raise() -> None:
    model = _model()
    precond = KFACPreconditioner(model, lr=0.1, damping=0.01)
    with pytest.raises(AttributeError, match=r"update_config\(damping="):
        precond.damping = 1.0  # type: ignore[attr-defined]
    precond.update_config(damping=1.0, factor_decay=lambda s: 0.5, kl_clip=lambda s: 1e-2)
    assert precond.config.damping == 1.0
    with pytest.raises(ValueError, match="cannot change"):
        precond.update_config(strategy="d-kfac")
    with pytest.raises(ValueError, match="damping"):
        precond.update_config(damping=-1.0)
    # Same result as a preconditioner built with those values.
    fresh_model = copy.deepcopy(model)
    fresh = KFACPreconditioner(
        fresh_model, lr=0.1, damping=1.0, factor_decay=lambda s: 0.5, kl_clip=lambda s: 1e-2
    )
    for net, kfac in ((model, precond), (fresh_model, fresh)):
        _backward(net)
        kfac.step()
    for a, b in zip(_grads(model), _grads(fresh_model), strict=True):
        torch.testing.assert_close(a, b)


def test_callable_factor_decay_is_validated_when_evaluated() -> None:
    model = _model()
    precond = KFACPreconditioner(model, lr=0.1, factor_decay=lambda s: 1.5)
    _backward(model)
    with pytest.raises(ValueError, match="factor_decay"):
        precond.step()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters_are_preconditioned_in_float32(dtype: torch.dtype) -> None:
    model = _model()
    low = copy.deepcopy(model).to(dtype)
    kfac = KFACPreconditioner(model, lr=0.1, damping=0.1)
    low_kfac = KFACPreconditioner(low, lr=0.1, damping=0.1)
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(8, 4, generator=generator)
    targets = torch.randint(0, 3, (8,), generator=generator)
    F.cross_entropy(model(inputs), targets).backward()
    F.cross_entropy(low(inputs.to(dtype)).float(), targets).backward()
    assert kfac.step() and low_kfac.step()
    assert all(p.grad.dtype == dtype for p in low.parameters())  # type: ignore[union-attr]
    a_factor, _ = low_kfac.factors("0")
    assert a_factor is not None and a_factor.dtype == torch.float32
    for high, reduced in zip(_grads(model), _grads(low), strict=True):
        torch.testing.assert_close(reduced.float(), high, rtol=0.1, atol=2e-2)


def test_an_empty_batch_contributes_nothing() -> None:
    model = _model()
    reference = copy.deepcopy(model)
    precond = KFACPreconditioner(model, lr=0.1)
    ref_precond = KFACPreconditioner(reference, lr=0.1)
    _backward(model)
    model(torch.randn(0, 4)).sum().backward()  # an empty micro-batch adds zero gradient
    _backward(reference)
    assert precond.step() and ref_precond.step()
    for name in ("0", "2"):
        for mine, theirs in zip(precond.factors(name), ref_precond.factors(name), strict=True):
            torch.testing.assert_close(mine, theirs)


def test_parametrized_weights_are_not_registered_but_listed() -> None:
    model = nn.Sequential(
        nn.utils.parametrizations.weight_norm(nn.Linear(4, 5)), nn.Tanh(), nn.Linear(5, 3)
    )
    with pytest.warns(UserWarning, match=r"ParametrizedLinear \(1\)$"):
        precond = KFACPreconditioner(model, lr=0.1)
    assert precond.layers == ["2"]


class _Bypass(nn.Module):
    """A registered layer whose weight is used without calling its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 3)
        self.bypassed = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.used(torch.tanh(F.linear(x, self.bypassed.weight, self.bypassed.bias)))


def test_a_layer_whose_factors_are_never_captured_is_named() -> None:
    model = _Bypass()
    precond = KFACPreconditioner(model, lr=0.1)
    _backward(model)
    with pytest.warns(RuntimeWarning, match=r"no factors were captured for \['bypassed'\]"):
        precond.step()
    assert math.isfinite(float(model.bypassed.weight.grad.sum()))  # type: ignore[union-attr]


def test_skip_layers_by_regex_and_class_name() -> None:
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    first = KFACPreconditioner(model, lr=0.1, skip_layers=["Embedding"])
    assert first.layers == ["1", "3"]
    first.remove()  # one preconditioner per model at a time
    second = KFACPreconditioner(model, lr=0.1, skip_layers=["re:[01]"])
    assert second.layers == ["3"]
    second.remove()
    with pytest.raises(ValueError, match="matches no module"):
        KFACPreconditioner(model, lr=0.1, skip_layers=["re:head.*"])
    with pytest.raises(ValueError, match="not a regex"):
        KFACPreconditioner(model, lr=0.1, skip_layers=["re:("])


def test_a_state_dict_without_inverses_recomputes_them_at_the_next_step() -> None:
    from spdkfac.linalg import damped_inverse

    model = _model()
    precond = KFACPreconditioner(model, lr=0.1, damping=0.1, inv_update_steps=10)
    for step in range(3):
        model.zero_grad()
        _backward(model, seed=step)
        precond.step()
    slim = precond.state_dict(inverses=False)
    assert slim["layers"]["0"]["a_inverse"] is None and slim["layers"]["0"]["a_factor"] is not None
    memory = precond.memory_bytes()
    assert memory["factors"] == 4 * (5 * 5 + 5 * 5 + 6 * 6 + 3 * 3)  # float32 A and G
    assert memory["inverses"] == memory["factors"]

    precond.remove()  # one preconditioner per model at a time
    restored = KFACPreconditioner(model, lr=0.1, damping=0.1, inv_update_steps=10)
    restored.load_state_dict(slim)
    assert restored.inverses("0") == (None, None)
    model.zero_grad()
    _backward(model, seed=3)
    restored.step()  # step 3 is no inverse step, but the inverses were left out
    a_factor, g_factor = restored.factors("0")
    a_inverse, g_inverse = restored.inverses("0")
    torch.testing.assert_close(a_inverse, damped_inverse(a_factor, 0.1))  # type: ignore[arg-type]
    torch.testing.assert_close(g_inverse, damped_inverse(g_factor, 0.1))  # type: ignore[arg-type]
