"""Damped inverses and triangle packing."""

from __future__ import annotations

import pytest
import torch

from spdkfac import linalg
from spdkfac.forms import DampedInverse
from spdkfac.forms import inverses as forms
from spdkfac.linalg import InversionError, damped_inverse, pack_triu, packed_size, unpack_triu


def _spd(dim: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(dim * 2, dim, generator=generator, dtype=dtype)
    product = x.T @ x / (dim * 2)
    # BLAS does not promise a bitwise symmetric XᵀX (it depends on the CPU's code path);
    # P + Pᵀ is exactly symmetric (IEEE addition commutes) and halving it is exact.
    return (product + product.T) / 2


def _solve_triangles_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """Emulate cuSOLVER on the CPU: its cholesky_inverse solves against the identity, so
    its two triangles are rounded apart (here the lower one is one ulp off)."""
    real_cholesky_inverse = torch.cholesky_inverse

    def two_solves(factor: torch.Tensor) -> torch.Tensor:
        inverse = real_cholesky_inverse(factor)
        lower = torch.ones_like(inverse, dtype=torch.bool).tril_(-1)  # (of each matrix)
        up = torch.tensor(float("inf"), dtype=inverse.dtype)
        inverse[lower] = inverse[lower].nextafter(up)
        return inverse

    monkeypatch.setattr(torch, "cholesky_inverse", two_solves)
    monkeypatch.setattr(linalg, "_CHOLESKY_INVERSE_REFLECTS", frozenset())


@pytest.mark.parametrize("dim", [1, 2, 5, 17, 64, 577])
def test_exact_symmetry_of_cholesky_inverses(dim: int) -> None:
    inverse = damped_inverse(_spd(dim, dim, torch.float32), 1e-3)
    assert torch.equal(inverse, inverse.T) and inverse.is_contiguous()
    assert torch.equal(unpack_triu(pack_triu(inverse), dim), inverse)


def test_cholesky_inverse_without_reflection_is_made_exactly_symmetric(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _solve_triangles_apart(monkeypatch)
    factor = _spd(17, 4)
    inverse = damped_inverse(factor, 1e-3)
    assert torch.equal(inverse, inverse.T) and inverse.is_contiguous()
    expected = torch.linalg.inv(factor + 1e-3 * torch.eye(17, dtype=torch.float64))
    torch.testing.assert_close(inverse, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dim", [1, 2, 5, 17])
def test_pack_unpack_round_trip(dim: int) -> None:
    matrix = _spd(dim, dim)
    packed = pack_triu(matrix)
    assert packed.shape == (packed_size(dim),)
    torch.testing.assert_close(unpack_triu(packed, dim), matrix, rtol=0, atol=0)


def test_unpack_rejects_wrong_size() -> None:
    with pytest.raises(ValueError, match="expected 6"):
        unpack_triu(torch.zeros(5), 3)


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_damped_inverse_matches_float64_inverse(method: str, dtype: torch.dtype) -> None:
    factor = _spd(12, 0, dtype)
    original = factor.clone()
    inverse = damped_inverse(factor, 0.05, method)  # type: ignore[arg-type]
    expected = torch.linalg.inv(factor.double() + 0.05 * torch.eye(12, dtype=torch.float64))
    assert inverse.dtype == dtype
    tolerance = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(inverse.double(), expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(factor, original, rtol=0, atol=0)  # damping went to a copy
    # Exactly symmetric and row-major: a broadcast upper triangle rebuilds it bit for bit.
    assert torch.equal(inverse, inverse.T) and inverse.is_contiguous()


@pytest.mark.parametrize(
    "factor",
    [-torch.eye(4), torch.zeros(4, 4), torch.ones(4, 4)],
    ids=["negative-definite", "zero", "rank-one"],
)
def test_cholesky_falls_back_on_non_pd_factors(factor: torch.Tensor) -> None:
    if factor.min() < 0:
        with pytest.warns(RuntimeWarning, match="100x the damping"):
            inverse = damped_inverse(factor, 0.1, "cholesky")
        # float64 and 10x damping fail (-1 + 1 = 0); 100x succeeds: (-1 + 10)⁻¹ = 1/9.
        torch.testing.assert_close(inverse, torch.eye(4) / 9)
    else:
        inverse = damped_inverse(factor, 0.1, "cholesky")
        expected = torch.linalg.inv(factor.double() + 0.1 * torch.eye(4, dtype=torch.float64))
        torch.testing.assert_close(inverse.double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.isfinite(inverse).all()


def test_tiny_damping_rank_deficient_is_finite() -> None:
    factor = torch.ones(6, 6)  # rank one
    for method in ("cholesky", "eigen"):
        inverse = damped_inverse(factor, 1e-12, method)  # type: ignore[arg-type]
        assert torch.isfinite(inverse).all()


def test_eigendecomposition_is_the_last_resort(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_pd(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return matrix, torch.tensor(1)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", not_pd)
    factor = _spd(5, 1)
    with pytest.warns(RuntimeWarning, match="clamped eigendecomposition"):
        inverse = damped_inverse(factor, 0.1)
    expected = torch.linalg.inv(factor + 0.1 * torch.eye(5, dtype=torch.float64))
    torch.testing.assert_close(inverse, expected)


def test_every_fallback_failing_raises_inversion_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> object:
        raise torch.linalg.LinAlgError("injected")

    monkeypatch.setattr(torch.linalg, "cholesky_ex", lambda m: (m, torch.tensor(1)))
    monkeypatch.setattr(torch.linalg, "eigh", broken)
    with pytest.warns(RuntimeWarning), pytest.raises(InversionError):
        damped_inverse(torch.eye(3), 0.1)


def test_bfloat16_factor_is_decomposed_in_float32() -> None:
    factor = _spd(8, 3, torch.float32).to(torch.bfloat16)
    inverse = damped_inverse(factor, 0.1)
    assert inverse.dtype == torch.float32
    expected = torch.linalg.inv(factor.double() + 0.1 * torch.eye(8, dtype=torch.float64))
    torch.testing.assert_close(inverse.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_factor_is_refused(bad: float) -> None:
    factor = torch.eye(3)
    factor[1, 1] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        damped_inverse(factor, 0.1)


@pytest.mark.parametrize("damping", [0.0, -1.0, float("nan")])
def test_bad_damping(damping: float) -> None:
    with pytest.raises(ValueError, match="damping"):
        damped_inverse(torch.eye(2), damping)


def test_bad_method() -> None:
    with pytest.raises(ValueError, match="inverse_method"):
        damped_inverse(torch.eye(2), 0.1, "lu")  # type: ignore[arg-type]


@pytest.mark.parametrize("dim", [1, 2, 3, 8, 33])
def test_unpack_mirrors_the_triangle_exactly(dim: int) -> None:
    # Any triangle, not only one packed from a symmetric matrix: both halves are copies.
    packed = torch.randn(packed_size(dim), generator=torch.Generator().manual_seed(dim))
    rows, cols = torch.triu_indices(dim, dim)
    expected = torch.zeros(dim, dim)
    expected[rows, cols] = packed
    expected[cols, rows] = packed
    assert torch.equal(unpack_triu(packed, dim), expected)
    batch = torch.full((3, dim, dim), float("nan"))
    assert unpack_triu(packed, dim, out=batch[1]).data_ptr() == batch[1].data_ptr()
    assert torch.equal(batch[1], expected) and batch[0].isnan().all()
    assert linalg.packed_dim(packed.numel()) == dim


def test_packed_dim_rejects_sizes_of_no_triangle() -> None:
    with pytest.raises(ValueError, match="not the packed upper triangle"):
        linalg.packed_dim(5)


def _stack(dim: int, count: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.stack([_spd(dim, seed, dtype) for seed in range(count)])


@pytest.mark.parametrize("method", ["cholesky", "eigen"])
@pytest.mark.parametrize("dim", [1, 4, 17])
def test_batched_inverse_equals_one_call_per_factor(method: str, dim: int) -> None:
    factors = _stack(dim, 5)
    original = factors.clone()
    batched = DampedInverse(method).compute_all(factors, 0.01)  # type: ignore[arg-type]
    torch.testing.assert_close(factors, original, rtol=0, atol=0)  # workspace was a copy
    for factor, inverse in zip(factors, batched, strict=True):
        alone = damped_inverse(factor, 0.01, method)  # type: ignore[arg-type]
        torch.testing.assert_close(inverse, alone, rtol=1e-12, atol=1e-12)
        assert inverse.dtype == torch.float64
        assert torch.equal(inverse, inverse.T) and inverse.is_contiguous()


def test_failing_members_of_a_batch_fall_back_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    factors = _stack(4, 4, torch.float32)
    factors[1] = -torch.eye(4)  # not positive definite: 100x the damping, with a warning
    factors[2, 0, 0] = float("nan")  # never handed to LAPACK
    decomposed: list[torch.Tensor] = []
    real_cholesky_ex = torch.linalg.cholesky_ex

    def recording(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        decomposed.append(matrix.clone())
        return real_cholesky_ex(matrix)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", recording)
    first = linalg.damped_inverse_batch(factors.clone(), 0.1)
    assert first[1] is None and first[2] is None
    assert all(torch.isfinite(matrix).all() for matrix in decomposed)
    for index in (0, 3):
        inverse = first[index]
        assert inverse is not None
        torch.testing.assert_close(inverse, damped_inverse(factors[index], 0.1))
    with pytest.warns(RuntimeWarning, match="100x the damping"):
        inverses = DampedInverse("cholesky").compute_all(factors[:2], 0.1)
    torch.testing.assert_close(inverses[1], torch.eye(4) / 9)
    with pytest.raises(ValueError, match="NaN or Inf"):
        DampedInverse("cholesky").compute_all(factors[2:], 0.1)


def test_finiteness_survives_a_sum_that_overflows() -> None:
    huge = torch.full((4, 4), 3e38)  # finite, but its float32 sum is inf
    assert linalg.is_finite(huge) and linalg.is_finite(huge.bfloat16())
    assert not linalg.is_finite(torch.tensor([1.0, float("nan")]))
    assert not linalg.is_finite(torch.tensor([float("inf"), -float("inf")]))
    batch = torch.stack([huge, torch.eye(4), torch.eye(4)])
    batch[2, 1, 3] = float("-inf")
    assert linalg.finite_members(batch) == [True, True, False]
    assert linalg.finite_members(batch.mT) == [True, True, False]  # column-major members
    assert linalg.all_finite([]) and linalg.all_finite([huge, torch.eye(2).double()])
    assert not linalg.all_finite([huge, batch[2]])


def test_large_batches_are_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linalg, "BATCH_BYTES", 2 * 5 * 5 * 8)  # two float64 5x5 matrices
    assert linalg.batch_capacity(5, torch.float64) == 2
    assert linalg.batch_capacity(50, torch.float64) == 1
    sizes: list[int] = []
    real = forms.damped_inverse_batch

    def recording(stack: torch.Tensor, *args: object) -> list[torch.Tensor | None]:
        sizes.append(stack.shape[0])
        return real(stack, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(forms, "damped_inverse_batch", recording)
    factors = _stack(5, 5)
    inverses = DampedInverse("cholesky").compute_all(factors, 0.01)
    assert sizes == [2, 2, 1]
    for factor, inverse in zip(factors, inverses, strict=True):
        torch.testing.assert_close(inverse, damped_inverse(factor, 0.01), rtol=1e-12, atol=1e-12)


def test_batched_cholesky_inverse_without_reflection_is_made_exactly_symmetric(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _solve_triangles_apart(monkeypatch)
    factors = _stack(9, 3)
    for factor, inverse in zip(
        factors, DampedInverse("cholesky").compute_all(factors, 1e-3), strict=True
    ):
        assert torch.equal(inverse, inverse.T) and inverse.is_contiguous()
        expected = torch.linalg.inv(factor + 1e-3 * torch.eye(9, dtype=torch.float64))
        torch.testing.assert_close(inverse, expected, rtol=1e-10, atol=1e-10)
