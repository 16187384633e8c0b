"""Layer-wise grafting (:mod:`spdkfac.forms.graft`) against explicit float64 computations:
the Kronecker direction as an explicit matrix on vec(∇), rescaled to SGD's or Adam's step
norm (Adam's second moment and bias correction step by step); through the preconditioner
with the plain form's direction; a state dict continuing as the uninterrupted run."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac import KFACConfig, KFACPreconditioner
from spdkfac.forms import Grafted, inverse_form
from spdkfac.layers import gradient_matrix


def _spd(dim: int, seed: int) -> Tensor:
    rows = torch.randn(2 * dim, dim, generator=torch.Generator().manual_seed(seed))
    return (rows.T @ rows / rows.shape[0]).double()


def _gradients(count: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(9)
    # Steps of different sizes: Adam's running second moment then differs from ∇².
    return [(1 + step) * torch.randn(4, 5, generator=generator).double() for step in range(count)]


def _explicit_direction(gradient: Tensor, a: Tensor, g: Tensor, damping: float) -> Tensor:
    """``(A + γI)⁻¹ ⊗ (G + γI)⁻¹`` as one explicit matrix on column-major vec(∇)."""
    a_inv = torch.linalg.inv(a + damping * torch.eye(a.shape[0], dtype=torch.float64))
    g_inv = torch.linalg.inv(g + damping * torch.eye(g.shape[0], dtype=torch.float64))
    vec = torch.kron(a_inv, g_inv) @ gradient.T.reshape(-1)
    return vec.reshape(a.shape[0], g.shape[0]).T


def test_sgd_grafting_keeps_the_direction_at_the_gradients_norm() -> None:
    form = inverse_form("cholesky", grafting="sgd")
    assert isinstance(form, Grafted) and form.moments == () and form.kind == "inverse"
    a, g, damping = _spd(5, 0), _spd(4, 1), 0.1
    a_result, g_result = form.compute(a, damping), form.compute(g, damping)
    for gradient in _gradients(2):
        direction = _explicit_direction(gradient, a, g, damping)
        expected = direction * torch.linalg.norm(gradient) / torch.linalg.norm(direction)
        got = form.kronecker(gradient, a_result, g_result, damping, {})
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    assert form.wire_size(5) == inverse_form("cholesky").wire_size(5)  # sends the same


def test_adam_grafting_takes_adams_step_norm_with_its_bias_correction() -> None:
    form = inverse_form("cholesky", grafting="adam")
    assert form.moments == ("graft_exp_avg_sq", "graft_steps")
    assert form.moment_shapes((4, 5)) == {"graft_exp_avg_sq": (4, 5), "graft_steps": ()}
    a, g, damping = _spd(5, 2), _spd(4, 3), 0.05
    a_result, g_result = form.compute(a, damping), form.compute(g, damping)
    moments: dict[str, Tensor | None] = dict.fromkeys(form.moments)
    v = torch.zeros(4, 5, dtype=torch.float64)
    for t, gradient in enumerate(_gradients(3), start=1):
        v = 0.999 * v + 0.001 * gradient**2
        adam = gradient / ((v / (1 - 0.999**t)).sqrt() + 1e-8)
        direction = _explicit_direction(gradient, a, g, damping)
        expected = direction * torch.linalg.norm(adam) / torch.linalg.norm(direction)
        got = form.kronecker(gradient, a_result, g_result, damping, moments)
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    assert moments["graft_steps"] is not None and float(moments["graft_steps"]) == 3.0


def test_grafting_a_stateful_form_keeps_both_states_and_a_zero_direction() -> None:
    form = inverse_form("eigen-adam", grafting="adam")
    assert form.moments == ("exp_avg", "exp_avg_sq", "steps", "graft_exp_avg_sq", "graft_steps")
    plain = inverse_form("eigen-adam")
    a, g = _spd(5, 4), _spd(4, 5)
    results = (plain.compute(a, 0.1), plain.compute(g, 0.1))
    grafted_moments: dict[str, Tensor | None] = dict.fromkeys(form.moments)
    plain_moments: dict[str, Tensor | None] = dict.fromkeys(plain.moments)
    gradient = _gradients(1)[0]
    got = form.kronecker(gradient, *results, 0.1, grafted_moments)
    direction = plain.kronecker(gradient, *results, 0.1, plain_moments)
    # Adam's first step is ∇/(|∇| + ε): norm √(entries) up to ε.
    size = torch.linalg.norm(gradient / (gradient.abs() + 1e-8))
    torch.testing.assert_close(got, direction * size / torch.linalg.norm(direction))
    zero = torch.zeros(4, 5, dtype=torch.float64)
    sgd = inverse_form("cholesky", grafting="sgd")
    out = sgd.kronecker(zero, sgd.compute(a, 0.1), sgd.compute(g, 0.1), 0.1, {})
    assert torch.equal(out, zero)  # no 0/0


def test_grafting_is_checked_by_name() -> None:
    with pytest.raises(ValueError, match=r"grafting must be one of .* got 'rms'"):
        KFACConfig(grafting="rms")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- preconditioner
def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Embedding(7, 6), nn.Flatten(), nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 3)
    ).double()


def _matrix(layer: nn.Module) -> Tensor:
    bias = getattr(layer, "bias", None)
    return gradient_matrix(layer.weight.grad, None if bias is None else bias.grad).clone()


def _steps(precond: KFACPreconditioner, model: nn.Sequential, steps: range) -> list[dict]:
    """Each step's raw and preconditioned gradient matrices of every K-FAC layer."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    layers = {"0": model[0], "2": model[2], "4": model[4]}
    records = []
    for step in steps:
        optimizer.zero_grad()
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randint(0, 7, (32, 2), generator=generator)
        F.cross_entropy(model(inputs), torch.randint(0, 3, (32,), generator=generator)).backward()
        raw = {n: _matrix(m) for n, m in layers.items()}
        assert precond.step()
        after = {n: _matrix(m) for n, m in layers.items()}
        records.append((raw, after))
        optimizer.step()
    return records


def _precond(model: nn.Module, **options: object) -> KFACPreconditioner:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return KFACPreconditioner(
            model, damping=0.1, kl_clip=None, lr=0.05, inv_update_steps=2, **options
        )  # type: ignore[arg-type]


def test_sgd_grafting_through_the_preconditioner_is_the_plain_direction_rescaled() -> None:
    """Over refreshes and every block kind here (an embedding's diagonal A, Linear):
    each layer's update is the ungrafted update at the raw gradient's norm."""
    plain_model, grafted_model = _model(), _model()
    plain = _steps(_precond(plain_model), plain_model, range(3))
    grafted = _steps(_precond(grafted_model, grafting="sgd"), grafted_model, range(3))
    for raw, after in grafted:  # (after step 0 each run has its own parameters)
        for name in ("0", "2", "4"):
            scale = torch.linalg.norm(raw[name]) / torch.linalg.norm(after[name])
            torch.testing.assert_close(scale, torch.ones((), dtype=torch.float64))
    first_raw, first_plain = plain[0]
    for name in ("0", "2", "4"):
        expected = first_plain[name] * (
            torch.linalg.norm(first_raw[name]) / torch.linalg.norm(first_plain[name])
        )
        torch.testing.assert_close(grafted[0][1][name], expected)


def test_adam_grafting_state_dict_continues_as_the_uninterrupted_run() -> None:
    model = _model()
    precond = _precond(model, grafting="adam")
    _steps(precond, model, range(3))
    saved = precond.state_dict()
    assert float(saved["layers"]["2"]["graft_steps"]) == 3.0
    assert saved["layers"]["2"]["graft_exp_avg_sq"].shape == (5, 13)
    twin = _model()
    twin.load_state_dict(model.state_dict())
    fresh = _precond(twin, grafting="adam")
    fresh.load_state_dict(saved)
    continued = _steps(precond, model, range(3, 5))  # a refresh at step 4
    resumed = _steps(fresh, twin, range(3, 5))
    for (_, after), (_, again) in zip(continued, resumed, strict=True):
        for name in ("0", "2", "4"):
            torch.testing.assert_close(again[name], after[name], rtol=1e-10, atol=1e-12)
