"""The transformer forms: ``"eigen-adam"`` (Adam's moments in K-FAC's eigen-bases) and
``"one-sided"`` (A's damped inverse alone), against explicit float64 computations: the
rotation as an explicit Kronecker matrix, the moments and bias corrections step by step,
a refresh of the bases keeping the moments, the relative damping; through the
preconditioner, and state dicts across a refresh."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac import KFACPreconditioner
from spdkfac.forms import EigenAdam, OneSided, inverse_form
from spdkfac.layers import gradient_matrix

BETA1, BETA2, EPS = 0.95, 0.95, 1e-8


def _spd(dim: int, seed: int, rank: int | None = None) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(rank or 2 * dim, dim, generator=generator, dtype=torch.float64)
    return rows.T @ rows / rows.shape[0]


def seen(eigenvalues: Tensor, epsilon: float = torch.finfo(torch.float32).eps) -> Tensor:
    """The eigenvalues above ``√d · ε`` times the largest (the form's resolution)."""
    return eigenvalues > eigenvalues.max() * len(eigenvalues) ** 0.5 * epsilon


def _basis(factor: Tensor) -> tuple[Tensor, Tensor]:
    """The eigenvectors, ``eigh`` in float64, and which eigenvalues are resolved (the
    resolved ones here are distinct, so that part of the basis is unique up to signs,
    which the step does not see; the rest is the null space, where any basis does)."""
    eigenvalues, eigenvectors = torch.linalg.eigh(factor)
    return eigenvectors.contiguous(), seen(eigenvalues)


def explicit_adam(
    gradients: list[Tensor], bases: list[tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]]
) -> list[Tensor]:
    """SOAP's step with K-FAC's bases, written on vec(∇) with the explicit Kronecker
    rotation ``R = Q_A ⊗ Q_G`` (column-major vec): m in the parameters' space, v in the
    rotated one, both bias-corrected; a coordinate one of the factors does not resolve is
    divided by the root of the mean of v̂ instead of its own, and keeps in v the mean of
    all such coordinates."""
    out, g_dim, a_dim = [], *gradients[0].shape
    m = torch.zeros(g_dim * a_dim, dtype=torch.float64)
    v = torch.zeros(g_dim * a_dim, dtype=torch.float64)
    for t, (gradient, ((qa, sa), (qg, sg))) in enumerate(zip(gradients, bases, strict=True), 1):
        rotation = torch.kron(qa, qg)  # vec(Q_Gᵀ X Q_A) = (Q_A ⊗ Q_G)ᵀ vec(X)
        resolved = torch.kron(sa.double(), sg.double()) > 0
        vec = gradient.T.reshape(-1)
        m = BETA1 * m + (1 - BETA1) * vec
        v = BETA2 * v + (1 - BETA2) * (rotation.T @ vec) ** 2
        if not resolved.all():  # the unresolved coordinates share their mean
            v = torch.where(resolved, v, v[~resolved].mean())
        m_hat, v_hat = m / (1 - BETA1**t), v / (1 - BETA2**t)
        scale = torch.where(resolved, v_hat, v_hat.mean()).sqrt() + EPS
        direction = rotation @ ((rotation.T @ m_hat) / scale)
        out.append(direction.reshape(a_dim, g_dim).T)
    return out


def test_eigen_adam_is_soap_step_with_k_facs_bases_across_a_refresh() -> None:
    form = inverse_form("eigen-adam")
    assert isinstance(form, EigenAdam) and form.betas == (BETA1, BETA2) and form.eps == EPS
    factors = [(_spd(5, 0), _spd(4, 1)), (_spd(5, 2), _spd(4, 3))]
    generator = torch.Generator().manual_seed(4)
    gradients = [torch.randn(4, 5, generator=generator, dtype=torch.float64) for _ in range(4)]
    moments: dict[str, Tensor | None] = dict.fromkeys(form.moments)
    results, bases = [], []
    for step, gradient in enumerate(gradients):
        a, g = factors[0] if step < 2 else factors[1]  # a refresh after two steps
        a_result, g_result = form.compute(a, 0.1), form.compute(g, 0.1)
        results.append(form.kronecker(gradient, a_result, g_result, 0.1, moments))
        bases.append((_basis(a), _basis(g)))
    expected = explicit_adam(gradients, bases)
    for result, reference in zip(results, expected, strict=True):
        torch.testing.assert_close(result, reference, rtol=1e-7, atol=1e-9)
    assert moments["steps"] is not None and float(moments["steps"]) == 4.0
    assert form.moment_shapes((4, 5)) == {"exp_avg": (4, 5), "exp_avg_sq": (4, 5), "steps": ()}
    assert form.wire_size(5) == 30 and form.kind == "eigen-basis"  # [Q | λ], as eigen-basis


def test_eigen_adam_of_a_diagonal_a_rotates_by_g_only() -> None:
    form = inverse_form("eigen-adam")
    a, g = torch.tensor([0.0, 0.5, 2.0, 1.0], dtype=torch.float64), _spd(3, 4)
    gradient = torch.randn(3, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    moments: dict[str, Tensor | None] = dict.fromkeys(form.moments)
    result = form.kronecker_diagonal(
        gradient, form.diagonal(a, 0.1), form.compute(g, 0.1), 0.1, moments
    )
    identity = (torch.eye(4, dtype=torch.float64), seen(a))  # the unseen column 0 included
    expected = explicit_adam([gradient], [(identity, _basis(g))])
    torch.testing.assert_close(result, expected[0], rtol=1e-7, atol=1e-9)


def test_one_sided_is_the_relatively_damped_inverse_of_a_on_the_right() -> None:
    form = inverse_form("one-sided")
    assert isinstance(form, OneSided) and not form.uses_g and form.kind == "one-sided"
    a = 40.0 * _spd(5, 0, rank=3)  # scaled: the damping follows A's mean eigenvalue
    gradient = torch.randn(4, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    damping = 0.1
    gamma = damping * torch.trace(a) / 5
    expected = torch.linalg.solve(a + gamma * torch.eye(5, dtype=torch.float64), gradient.T).T
    single = form.compute(a, damping)
    torch.testing.assert_close(form.kronecker(gradient, single, None, damping, {}), expected)
    batched = form.compute_all(torch.stack([a, _spd(5, 3)]), damping)
    torch.testing.assert_close(batched[0], single, rtol=1e-9, atol=1e-12)
    assert form.wire_size(5) == 15  # a packed triangle, as every damped inverse
    diagonal = torch.tensor([0.0, 1.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(form.diagonal(diagonal, 0.5), 1 / (diagonal + 0.5 * 4 / 3))


# ---------------------------------------------------------------------- preconditioner
def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Embedding(7, 6), nn.Flatten(), nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 3)
    ).double()


def _batch(seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # 32 examples: every A has full rank (distinct eigenvalues, a unique basis).
    inputs = torch.randint(0, 7, (32, 2), generator=generator)
    return inputs, torch.randint(0, 3, (32,), generator=generator)


def _matrix(layer: nn.Module) -> Tensor:
    bias = layer.bias.grad if layer.bias is not None else None
    return gradient_matrix(layer.weight.grad, bias).clone()


def _run(method: str, steps: int, precond: KFACPreconditioner, model: nn.Module, start: int = 0):
    """``steps`` steps of the preconditioner and SGD; each layer's raw and preconditioned
    gradient matrices and A, G at each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    records = []
    for step in range(start, start + steps):
        optimizer.zero_grad()
        inputs, targets = _batch(step)
        F.cross_entropy(model(inputs), targets).backward()
        raw = {name: _matrix(model[int(name)]) for name in ("2", "4")}
        assert precond.step()
        factors = {  # copies: the running averages are updated in place
            name: tuple(None if f is None else f.clone() for f in precond.factors(name))
            for name in ("2", "4")
        }
        after = {name: _matrix(model[int(name)]) for name in ("2", "4")}
        records.append((raw, after, factors))
        optimizer.step()
    return records


def test_one_sided_preconditioner_takes_dense_layers_and_captures_no_g() -> None:
    model = _model()
    with pytest.warns(UserWarning, match="Embedding"):
        precond = KFACPreconditioner(
            model,
            damping=0.1,
            kl_clip=None,
            lr=0.05,
            inverse_method="one-sided",
            inv_update_steps=1,
        )
    assert precond.layers == ["2", "4"]
    assert [spec.key for spec in precond.plan.factors] == ["2/A", "4/A"]
    for raw, after, factors in _run("one-sided", 3, precond, model):
        for name in ("2", "4"):
            a, g = factors[name]
            assert a is not None and g is None
            gamma = 0.1 * torch.trace(a) / a.shape[0]
            eye = torch.eye(a.shape[0], dtype=torch.float64)
            expected = torch.linalg.solve(a + gamma * eye, raw[name].T).T
            torch.testing.assert_close(after[name], expected, rtol=1e-8, atol=1e-10)


def test_eigen_adam_preconditioner_over_refreshes_and_its_state_dict() -> None:
    """Three steps with the bases refreshed every second step equal the explicit SOAP
    steps on the running factors; a state dict saved after them, loaded into a fresh
    preconditioner, continues exactly as the uninterrupted one."""
    options = dict(
        damping=0.1, kl_clip=None, lr=0.05, inverse_method="eigen-adam", inv_update_steps=2
    )
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        precond = KFACPreconditioner(model, **options)
    assert precond.layers == ["0", "2", "4"]
    records = _run("eigen-adam", 3, precond, model)
    for name in ("2", "4"):
        bases = []
        for step in range(len(records)):
            refreshed = records[step - step % 2][2][name]  # the factors at the last refresh
            bases.append((_basis(refreshed[0]), _basis(refreshed[1])))
        expected = explicit_adam([raw[name] for raw, _, _ in records], bases)
        for (_, after, _), reference in zip(records, expected, strict=True):
            torch.testing.assert_close(after[name], reference, rtol=1e-6, atol=1e-8)
    saved = precond.state_dict()
    assert saved["layers"]["2"]["exp_avg"].shape == (5, 13)
    assert float(saved["layers"]["2"]["steps"]) == 3.0
    twin = _model()
    twin.load_state_dict(model.state_dict())
    fresh = KFACPreconditioner(twin, **options)
    fresh.load_state_dict(saved)
    continued = _run("eigen-adam", 2, precond, model, start=3)
    resumed = _run("eigen-adam", 2, fresh, twin, start=3)
    for (_, after, _), (_, again, _) in zip(continued, resumed, strict=True):
        for name in ("0", "2", "4")[1:]:
            torch.testing.assert_close(again[name], after[name], rtol=1e-10, atol=1e-12)


def test_eigen_adam_refuses_the_kl_clip_by_name() -> None:
    with pytest.raises(ValueError, match="kl_clip must be None with inverse_method='eigen-adam'"):
        KFACPreconditioner(_model(), inverse_method="eigen-adam")  # the default kl_clip 0.001


@pytest.mark.parametrize("grafting", [None, "adam"])
def test_a_fresh_running_state_saves_as_zeros_and_loads_as_fresh(grafting: str | None) -> None:
    """Before any step (as on a rank that never preconditioned a layer) the state dict
    holds each moment as zeros with step count 0, shaped as after a step; loading it
    leaves the moments fresh (None), and training then equals the uninterrupted run."""
    options = dict(
        damping=0.1, kl_clip=None, lr=0.05, inverse_method="eigen-adam", inv_update_steps=2
    )
    if grafting:
        options["grafting"] = grafting
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        precond = KFACPreconditioner(model, **options)
        twin = _model()
        fresh = KFACPreconditioner(twin, **options)
    names = precond.state_dict()["layers"]["2"].keys() - {"a_factor", "g_factor"}
    saved = precond.state_dict()["layers"]["2"]
    moments = [name for name in names if not name.endswith("inverse")]
    assert moments and all(saved[name] is not None and not saved[name].any() for name in moments)
    assert saved["exp_avg"].shape == (5, 13) and saved["exp_avg"].dtype == torch.float64
    fresh.load_state_dict(precond.state_dict())
    first = _run("eigen-adam", 3, precond, model)
    second = _run("eigen-adam", 3, fresh, twin)
    after_steps = precond.state_dict()["layers"]["2"]
    assert all(after_steps[name].shape == saved[name].shape for name in moments)
    assert float(after_steps["steps"]) == 3.0
    for (_, after, _), (_, again, _) in zip(first, second, strict=True):
        for name in ("2", "4"):
            torch.testing.assert_close(again[name], after[name], rtol=1e-10, atol=1e-12)
