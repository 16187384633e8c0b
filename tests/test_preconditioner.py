"""The preconditioned gradient, the KL clip, refresh intervals and the step's bookkeeping."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_reference import kronecker_precondition
from spdkfac import KFACPreconditioner
from spdkfac.layers import gradient_matrix


def _tiny_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 4, bias=False),
    ).double()


def _batch(seed: int, batch: int = 5) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(batch, 2, 4, 4, generator=generator, dtype=torch.float64)
    return inputs, torch.randint(0, 4, (batch,), generator=generator)


def _raw_gradients(model: nn.Module, names: list[str]) -> dict[str, Tensor]:
    modules = dict(model.named_modules())
    out = {}
    for name in names:
        module = modules[name]
        bias = module.bias.grad if getattr(module, "bias", None) is not None else None
        out[name] = gradient_matrix(module.weight.grad, bias).clone()
    return out


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
def test_preconditioned_gradient_equals_explicit_kronecker_solve(method: str) -> None:
    model = _tiny_model()
    damping = 0.07
    precond = KFACPreconditioner(model, damping=damping, kl_clip=None, inverse_method=method)
    inputs, targets = _batch(0)
    F.cross_entropy(model(inputs), targets).backward()
    raw = _raw_gradients(model, precond.layers)
    assert precond.step() is True
    after = _raw_gradients(model, precond.layers)
    for name in precond.layers:
        a_factor, g_factor = precond.factors(name)
        assert a_factor is not None and g_factor is not None
        expected = kronecker_precondition(raw[name], a_factor, g_factor, damping)
        torch.testing.assert_close(after[name], expected, rtol=1e-9, atol=1e-11)


def test_kl_clip_scales_to_the_bound() -> None:
    model = _tiny_model()
    kl_clip, lr = 1e-6, 0.5
    unclipped = KFACPreconditioner(_tiny_model(), kl_clip=None)
    precond = KFACPreconditioner(model, kl_clip=kl_clip, lr=lr)
    inputs, targets = _batch(1)
    reference_model = unclipped._model  # same weights: same seed
    for net in (model, reference_model):
        F.cross_entropy(net(inputs), targets).backward()
    raw = _raw_gradients(model, precond.layers)
    precond.step()
    unclipped.step()
    v = _raw_gradients(reference_model, precond.layers)
    vg = sum(float((v[n] * raw[n]).sum()) for n in precond.layers) * lr * lr
    nu = min(1.0, math.sqrt(kl_clip / abs(vg)))
    assert nu < 1.0  # the bound is active in this set-up
    clipped = _raw_gradients(model, precond.layers)
    for name in precond.layers:
        torch.testing.assert_close(clipped[name], nu * v[name], rtol=1e-9, atol=1e-12)
    # Quadratic KL estimate of the scaled step: η²⟨νV, F·νV⟩ = ν²·η²⟨V, ∇⟩ (F·V = ∇).
    kl_after = sum(float((clipped[n] * raw[n]).sum()) for n in precond.layers) * lr * lr * nu
    assert kl_after == pytest.approx(kl_clip, rel=1e-9)


def test_callable_damping_and_lr_are_evaluated_at_the_step() -> None:
    model = _tiny_model()
    seen: list[int] = []

    def damping(step: int) -> float:
        seen.append(step)
        return 0.1 / (step + 1)

    precond = KFACPreconditioner(
        model, damping=damping, lr=lambda s: 0.1, kl_clip=None, inv_update_steps=1
    )
    for step in range(3):
        model.zero_grad()
        inputs, targets = _batch(step)
        F.cross_entropy(model(inputs), targets).backward()
        precond.step()
    assert seen == [0, 1, 2]
    a_factor, _ = precond.factors("0")
    a_inverse, _ = precond.inverses("0")
    assert a_factor is not None and a_inverse is not None
    expected = torch.linalg.inv(a_factor + (0.1 / 3) * torch.eye(a_factor.shape[0]).double())
    torch.testing.assert_close(a_inverse, expected, rtol=1e-8, atol=1e-10)


def test_bad_schedule_value_names_the_option() -> None:
    model = _tiny_model()
    precond = KFACPreconditioner(model, damping=lambda s: -1.0)
    F.cross_entropy(model(_batch(0)[0]), _batch(0)[1]).backward()
    with pytest.raises(ValueError, match=r"damping.*-1\.0.*step 0"):
        precond.step()


def _train_recording(
    factor_steps: int | object, inv_steps: int | object, steps: int
) -> tuple[list[bool], list[bool]]:
    """Run ``steps`` steps; record whether A and Â of layer '0' changed at each step."""
    model = _tiny_model()
    precond = KFACPreconditioner(
        model,
        factor_update_steps=factor_steps,  # type: ignore[arg-type]
        inv_update_steps=inv_steps,  # type: ignore[arg-type]
        factor_decay=0.5,
        kl_clip=None,
    )
    factor_changed, inverse_changed = [], []
    previous_a: Tensor | None = None
    previous_inv: Tensor | None = None
    for step in range(steps):
        model.zero_grad()
        inputs, targets = _batch(100 + step)
        F.cross_entropy(model(inputs), targets).backward()
        raw = _raw_gradients(model, ["0"])["0"]
        precond.step()
        a_factor, _ = precond.factors("0")
        a_inverse, g_inverse = precond.inverses("0")
        assert a_factor is not None and a_inverse is not None and g_inverse is not None
        factor_changed.append(previous_a is None or not torch.equal(a_factor, previous_a))
        inverse_changed.append(previous_inv is None or not torch.equal(a_inverse, previous_inv))
        # Between refreshes the stored (stale) inverses are the ones applied.
        applied = _raw_gradients(model, ["0"])["0"]
        torch.testing.assert_close(applied, g_inverse @ raw @ a_inverse, rtol=1e-9, atol=1e-12)
        previous_a, previous_inv = a_factor.clone(), a_inverse.clone()
    return factor_changed, inverse_changed


def test_integer_intervals_fire_on_the_right_steps() -> None:
    # Inverses are recomputed only after the factors moved, so each refresh is visible.
    factor_changed, inverse_changed = _train_recording(2, 3, 10)
    assert factor_changed == [s % 2 == 0 for s in range(10)]
    assert inverse_changed == [s % 3 == 0 for s in range(10)]


def test_callable_intervals_fire_on_the_right_steps() -> None:
    def factor_interval(step: int) -> int:
        return 1 if step < 4 else 3

    def inverse_interval(step: int) -> int:
        return 2 if step < 4 else 5

    factor_changed, inverse_changed = _train_recording(factor_interval, inverse_interval, 12)
    assert factor_changed == [s % factor_interval(s) == 0 for s in range(12)]
    assert inverse_changed == [s % inverse_interval(s) == 0 for s in range(12)]
    assert factor_changed.count(True) == 4 + 2 and inverse_changed.count(True) == 2 + 2


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.late = nn.Linear(4, 4)
        self.use_late = False

    def forward(self, x: Tensor) -> Tensor:
        x = self.trunk(x)
        return self.late(x) if self.use_late else x


def test_gradient_is_plain_before_the_first_inverse() -> None:
    torch.manual_seed(0)
    model = _Branchy()
    precond = KFACPreconditioner(model, inv_update_steps=10, kl_clip=None)
    model(torch.randn(3, 4)).pow(2).mean().backward()
    precond.step()  # step 0: inverses for 'trunk' only; 'late' was not used
    assert precond.inverses("late") == (None, None)
    model.use_late = True
    model.zero_grad()
    model(torch.randn(3, 4)).pow(2).mean().backward()
    raw = model.late.weight.grad.clone()
    precond.step()  # step 1: 'late' has factors but no inverse until step 10
    assert precond.factors("late")[0] is not None
    torch.testing.assert_close(model.late.weight.grad, raw, rtol=0, atol=0)
    assert torch.isfinite(model.late.weight.grad).all()


def test_non_finite_gradient_skips_the_step_and_keeps_factors() -> None:
    model = _tiny_model()
    precond = KFACPreconditioner(model)
    inputs, targets = _batch(0)
    F.cross_entropy(model(inputs), targets).backward()
    assert precond.step()
    before = precond.factors("0")[0].clone()
    model.zero_grad()
    F.cross_entropy(model(inputs * 2), targets).backward()
    model[0].weight.grad[0, 0, 0, 0] = float("nan")
    assert precond.step() is False
    assert precond.skipped_steps == 1 and precond.steps == 2
    torch.testing.assert_close(precond.factors("0")[0], before, rtol=0, atol=0)


def test_layers_are_in_forward_order() -> None:
    class Reversed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.second = nn.Linear(3, 2)
            self.first = nn.Linear(4, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.second(self.first(x))

    model = Reversed()
    precond = KFACPreconditioner(model)
    assert precond.layers == ["second", "first"]  # before any forward: definition order
    model(torch.randn(2, 4)).sum().backward()
    precond.step()
    assert precond.layers == ["first", "second"]
