"""Damped inverses, their fallbacks and every inverse form on each device, against float64
CPU references (explicit inverses and explicit Kronecker solves)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from kfac_reference import eigenbasis_precondition, kronecker_precondition
from spdkfac.forms import FORM_METHODS, inverse_form
from spdkfac.linalg import damped_inverse, damped_inverse_batch

DAMPING = 0.05

#: The stateless forms that use both factors (the one-sided and moment forms are checked
#: in tests/test_forms_moments.py, on the devices too).
KRONECKER_METHODS = tuple(
    m for m in FORM_METHODS if inverse_form(m).uses_g and not inverse_form(m).moments
)


def _spd(dim: int, seed: int, rank: int | None = None) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(rank or 2 * dim, dim, generator=generator, dtype=torch.float64)
    product = rows.T @ rows / rows.shape[0]
    return (product + product.T) / 2


def _explicit(factor: Tensor, damping: float) -> Tensor:
    eye = torch.eye(factor.shape[0], dtype=torch.float64)
    return torch.linalg.inv(factor.double().cpu() + damping * eye)


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
@pytest.mark.parametrize("dim", [1, 7, 64, 300])
def test_damped_inverse_matches_the_float64_inverse(
    device: torch.device, method: str, dim: int
) -> None:
    factor = _spd(dim, dim).float().to(device)
    inverse = damped_inverse(factor, DAMPING, method)  # type: ignore[arg-type]
    assert inverse.device == device and inverse.dtype == torch.float32
    assert torch.equal(inverse, inverse.T) and inverse.is_contiguous()  # exactly symmetric
    torch.testing.assert_close(inverse.double().cpu(), _explicit(factor, DAMPING),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
def test_batched_first_attempts_equal_one_call_per_factor(
    device: torch.device, method: str
) -> None:
    factors = torch.stack([_spd(9, seed) for seed in range(4)]).float().to(device)
    factors[2] = float("nan")  # never decomposed: None, on every device
    results = damped_inverse_batch(factors.clone(), DAMPING, method)  # type: ignore[arg-type]
    assert results[2] is None
    for index in (0, 1, 3):
        result = results[index]
        assert result is not None and result.device == device
        assert torch.equal(result, result.T)
        alone = damped_inverse(factors[index], DAMPING, method)  # type: ignore[arg-type]
        torch.testing.assert_close(result, alone, rtol=1e-4, atol=1e-5)  # float32 rounding


def test_cholesky_falls_back_with_more_damping(device: torch.device) -> None:
    factor = -torch.eye(4, device=device)  # not positive definite until 100x the damping
    with pytest.warns(RuntimeWarning, match="100x the damping"):
        inverse = damped_inverse(factor, 0.1, "cholesky")
    assert inverse.device == device
    torch.testing.assert_close(inverse.cpu(), torch.eye(4) / 9)


def test_a_failing_batch_member_falls_back_alone(device: torch.device) -> None:
    factors = torch.stack([_spd(4, 0), -torch.eye(4, dtype=torch.float64)]).float().to(device)
    form = inverse_form("cholesky")
    with pytest.warns(RuntimeWarning, match="100x the damping"):
        results = form.compute_all(factors, 0.1)
    torch.testing.assert_close(results[0].double().cpu(), _explicit(factors[0], 0.1),
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    torch.testing.assert_close(results[1].cpu(), torch.eye(4) / 9)


def test_rank_deficient_factor_with_tiny_damping_stays_finite(device: torch.device) -> None:
    factor = torch.ones(6, 6, device=device)  # rank one
    for method in ("cholesky", "eigen"):
        assert torch.isfinite(damped_inverse(factor, 1e-12, method)).all()  # type: ignore[arg-type]


def test_non_finite_factor_is_refused(device: torch.device) -> None:
    factor = torch.eye(3, device=device)
    factor[1, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        damped_inverse(factor, 0.1)


@pytest.mark.parametrize("method", KRONECKER_METHODS)
def test_each_form_preconditions_as_the_explicit_kronecker_solve(
    device: torch.device, method: str
) -> None:
    a, g = _spd(6, 0, rank=4), _spd(5, 1)  # A rank-deficient: eigenvalues clamp at 0
    generator = torch.Generator().manual_seed(2)
    gradient = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    reference = eigenbasis_precondition if method == "eigen-basis" else kronecker_precondition
    expected = reference(gradient, a, g, DAMPING)
    form = inverse_form(method)
    a_dev, g_dev, gradient_dev = (
        a.float().to(device),
        g.float().to(device),
        gradient.float().to(device),
    )
    results = form.compute_all(torch.stack([a_dev, a_dev]), DAMPING)
    g_result = form.compute(g_dev, DAMPING)
    preconditioned = form.kronecker(gradient_dev, results[0], g_result, DAMPING, {})
    assert preconditioned.device == device
    torch.testing.assert_close(preconditioned.double().cpu(), expected, rtol=1e-3, atol=1e-4)
    for factor, result in ((a_dev, results[1]), (g_dev, g_result)):  # the wire format
        packed = form.pack(result)
        assert packed.device == device and packed.numel() == form.wire_size(factor.shape[0])
        assert torch.equal(form.unpack(packed, factor.shape[0]), result)


@pytest.mark.parametrize("method", KRONECKER_METHODS)
def test_each_form_of_a_diagonal_factor(device: torch.device, method: str) -> None:
    a = torch.tensor([0.0, 0.5, 2.0, 1.0], dtype=torch.float64)  # an unused embedding row
    g = _spd(3, 4)
    gradient = torch.randn(3, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    if method == "eigen-basis":
        expected = eigenbasis_precondition(gradient, a, g, 0.1)
    else:
        expected = kronecker_precondition(gradient, torch.diag(a), g, 0.1)
    form = inverse_form(method)
    a_dev, g_dev = a.float().to(device), g.float().to(device)
    result = form.kronecker_diagonal(
        gradient.float().to(device), form.diagonal(a_dev, 0.1), form.compute(g_dev, 0.1), 0.1, {}
    )
    torch.testing.assert_close(result.double().cpu(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["one-sided", "eigen-adam"])
def test_transformer_forms_on_the_device_equal_float64_on_the_cpu(
    device: torch.device, method: str
) -> None:
    """Three steps of each transformer form (its moments on the device) against the same
    form in float64 on the CPU (itself checked against explicit SOAP steps and solves in
    tests/test_forms_moments.py)."""
    a, g = _spd(6, 0), _spd(5, 1)  # distinct eigenvalues: a unique basis
    generator = torch.Generator().manual_seed(3)
    gradients = [torch.randn(5, 6, generator=generator, dtype=torch.float64) for _ in range(3)]
    form = inverse_form(method)
    moments_cpu: dict[str, Tensor | None] = dict.fromkeys(form.moments)
    moments_dev: dict[str, Tensor | None] = dict.fromkeys(form.moments)
    a_cpu, g_cpu = form.compute(a, DAMPING), form.compute(g, DAMPING) if form.uses_g else None
    a_dev = form.compute(a.float().to(device), DAMPING)
    g_dev = form.compute(g.float().to(device), DAMPING) if form.uses_g else None
    for gradient in gradients:
        expected = form.kronecker(gradient, a_cpu, g_cpu, DAMPING, moments_cpu)
        got = form.kronecker(gradient.float().to(device), a_dev, g_dev, DAMPING, moments_dev)
        assert got.device == device and got.dtype == torch.float32
        torch.testing.assert_close(got.double().cpu(), expected, rtol=1e-3, atol=1e-4)
    for name, value in moments_dev.items():
        assert value is not None and value.device == device, name
