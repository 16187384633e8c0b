"""Inverse forms (``inverse_method``) and storage dtypes, against explicit float64 Kronecker
matrices: damped inverses and eigen-bases, in one process and through the broadcast path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_reference import eigenbasis_precondition, kronecker_precondition
from spdkfac import KFACPreconditioner
from spdkfac.forms import FORM_METHODS, EigenBasis, inverse_form
from spdkfac.layers import gradient_matrix

#: The stateless forms that use both factors (the explicit references below); the others
#: are tested in tests/test_forms_moments.py.
KRONECKER_METHODS = tuple(
    m for m in FORM_METHODS if inverse_form(m).uses_g and not inverse_form(m).moments
)


def _spd(dim: int, seed: int, rank: int | None = None) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(rank or 2 * dim, dim, generator=generator, dtype=torch.float64)
    return rows.T @ rows / rows.shape[0]


@pytest.mark.parametrize("method", KRONECKER_METHODS)
def test_each_form_preconditions_as_its_explicit_kronecker_solve(method: str) -> None:
    a, g = _spd(5, 0, rank=3), _spd(4, 1)  # A rank-deficient: eigenvalues clamp at 0
    gradient = torch.randn(4, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    form, damping = inverse_form(method), 0.05
    a_result, g_result = form.compute(a, damping), form.compute(g, damping)
    reference = eigenbasis_precondition if method == "eigen-basis" else kronecker_precondition
    expected = reference(gradient, a, g, damping)
    torch.testing.assert_close(form.kronecker(gradient, a_result, g_result, damping, {}), expected)
    # The wire format round-trips, and batched results equal single ones.
    for factor, result in ((a, a_result), (g, g_result)):
        packed = form.pack(result)
        assert packed.numel() == form.wire_size(factor.shape[0])
        assert torch.equal(form.unpack(packed, factor.shape[0]), result)
        assert result.shape == form.shape(factor.shape[0])
    stacked = form.compute_all(torch.stack([a, _spd(5, 3)]), damping)
    torch.testing.assert_close(
        form.kronecker(gradient, stacked[0], g_result, damping, {}), expected, rtol=1e-9, atol=1e-12
    )


@pytest.mark.parametrize("method", KRONECKER_METHODS)
def test_a_diagonal_a_factor_preconditions_as_its_explicit_solve(method: str) -> None:
    a = torch.tensor([0.0, 0.5, 2.0, 1.0], dtype=torch.float64)  # an unused embedding row
    g = _spd(3, 4)
    gradient = torch.randn(3, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    form, damping = inverse_form(method), 0.1
    result = form.kronecker_diagonal(
        gradient, form.diagonal(a, damping), form.compute(g, damping), damping, {}
    )
    if method == "eigen-basis":
        expected = eigenbasis_precondition(gradient, a, g, damping)
    else:
        expected = kronecker_precondition(gradient, torch.diag(a), g, damping)
    torch.testing.assert_close(result, expected)


def test_eigen_basis_of_a_non_finite_factor_fails_and_others_do_not() -> None:
    stack = torch.stack([_spd(3, 0), torch.full((3, 3), float("nan"), dtype=torch.float64)])
    first, second = EigenBasis().compute_batch(stack.clone(), 0.1)
    assert first is not None and second is None
    with pytest.raises(ValueError, match="NaN"):
        EigenBasis().compute(stack[1], 0.1)
    with pytest.raises(ValueError, match="damping"):
        EigenBasis().compute_batch(stack.clone(), 0.0)


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Embedding(7, 6),
        nn.Flatten(),
        nn.Linear(12, 5),
        nn.Tanh(),
        nn.Unflatten(1, (5, 1)),
        nn.Conv1d(5, 4, 1, groups=1),
        nn.Conv1d(4, 4, 1, groups=2),
        nn.Flatten(),
        nn.Linear(4, 3, bias=False),
    )


def _batch(seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 7, (9, 2), generator=generator), torch.randint(
        0, 3, (9,), generator=generator
    )


def _gradients(model: nn.Module) -> dict[str, Tensor]:
    """Each layer's gradient as K-FAC's ``[out, in]`` matrix (an embedding's weight is
    ``[in, out]``)."""
    return {
        name: module.weight.grad.t().clone()
        if isinstance(module, nn.Embedding)
        else gradient_matrix(
            module.weight.grad,
            module.bias.grad if getattr(module, "bias", None) is not None else None,
        ).clone()
        for name, module in model.named_modules()
        if getattr(module, "weight", None) is not None
    }


def _step(method: str, dtype: torch.dtype = torch.float64, **options: object):
    model = _model().to(dtype)
    precond = KFACPreconditioner(
        model, damping=0.05, kl_clip=None, lr=0.1, inverse_method=method, **options
    )
    inputs, targets = _batch(0)
    F.cross_entropy(model(inputs), targets).backward()
    raw = _gradients(model)
    assert precond.step()
    return model, precond, raw, _gradients(model)


def test_eigen_basis_preconditioner_equals_the_explicit_solve_per_layer() -> None:
    model, precond, raw, after = _step("eigen-basis")
    assert precond.layers == ["0", "2", "5", "6", "8"]
    for name in ("0", "2", "5", "8"):  # the embedding's A is diagonal
        a_factor, g_factor = precond.factors(name)
        assert a_factor is not None and g_factor is not None
        expected = eigenbasis_precondition(raw[name], a_factor, g_factor, 0.05)
        torch.testing.assert_close(after[name], expected, rtol=1e-8, atol=1e-10)
    grouped = dict(model.named_modules())["6"]
    a_factor, g_factor = precond.factors("6")
    assert a_factor is not None and g_factor is not None
    per_group = raw["6"].reshape(2, 2, -1)
    expected = torch.stack(
        [eigenbasis_precondition(per_group[i], a_factor[i], g_factor[i], 0.05) for i in range(2)]
    )
    torch.testing.assert_close(after["6"], expected.reshape(raw["6"].shape))
    assert grouped.weight.grad is not None


@pytest.mark.parametrize("option", ["inverse_dtype", "factor_dtype"])
def test_low_precision_storage_stays_close_to_float32(option: str) -> None:
    _, reference, _, expected = _step("cholesky", torch.float32)
    _, precond, _, after = _step("cholesky", torch.float32, **{option: torch.bfloat16})
    stored = precond.state_dict()["layers"]["2"]
    kept = "a_inverse" if option == "inverse_dtype" else "a_factor"
    assert stored[kept].dtype == torch.bfloat16
    assert (
        precond.memory_bytes()[kept.split("_")[1] + "s"]
        < reference.memory_bytes()[kept.split("_")[1] + "s"]
    )
    for name, gradient in expected.items():
        assert after[name].dtype == torch.float32
        # bfloat16 keeps 8 significant bits: the update moves by a few percent of its norm.
        error = torch.linalg.norm(after[name] - gradient) / torch.linalg.norm(gradient)
        assert error < 0.05, (name, float(error))


def test_a_checkpoint_of_another_form_loads_and_recomputes_its_inverses() -> None:
    _, cholesky, _, _ = _step("cholesky")
    _, eigen, _, _ = _step("eigen-basis")
    results = []
    for saved in (cholesky.state_dict(), cholesky.state_dict(inverses=False)):
        model = _model().double()
        fresh = KFACPreconditioner(
            model,
            damping=0.05,
            kl_clip=None,
            lr=0.1,
            inverse_method="eigen-basis",
            inv_update_steps=5,
        )
        fresh.load_state_dict(saved)  # step 1: not an inverse step, but stale inverses
        inputs, targets = _batch(1)
        F.cross_entropy(model(inputs), targets).backward()
        assert fresh.step()
        for name in fresh.layers:
            assert fresh.inverses(name)[1].shape == eigen.inverses(name)[1].shape
        results.append(_gradients(model))
    for name, gradient in results[1].items():
        assert torch.equal(results[0][name], gradient)
    with pytest.raises(ValueError, match="inverse_method"):
        KFACPreconditioner(_model(), inverse_method="eigenbasis")
    with pytest.raises(ValueError, match="inverse_dtype"):
        KFACPreconditioner(_model(), inverse_dtype=torch.int32)


@pytest.mark.parametrize("method", KRONECKER_METHODS)
def test_registered_blocks_describe_their_factors_in_their_form(method: str) -> None:
    """What placement prices: each placed factor's wire elements and compute scale are
    its block's form's (an embedding's diagonal A is not placed)."""
    model = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 3))
    precond = KFACPreconditioner(model, inverse_method=method)
    specs = list(precond.plan.factors)
    assert [(s.key, s.dim) for s in specs] == [("0/G", 4), ("1/A", 5), ("1/G", 3)]
    form = inverse_form(method)
    for spec in specs:
        assert spec.wire_elements == form.wire_size(spec.dim)
        assert spec.compute_scale == form.compute_scale
    sizes = {"cholesky": 15, "eigen": 15, "eigen-basis": 30}  # d = 5: d(d+1)/2 or d² + d
    assert specs[1].wire_elements == sizes[method]
    assert (form.compute_scale == 1.0) == (method == "cholesky")
