"""Numerical safety (docs/reliability.md N1–N8): failures never hang, NaN never leaks."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from distributed_helper import run_distributed
from spdkfac import KFACPreconditioner
from spdkfac.layers import FactorOptions


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 16, 4))


def _batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 1, 6, 6, generator=generator), torch.randint(
        0, 4, (6,), generator=generator
    )


def _failing_worker(
    rank: int, world_size: int, fail_steps: list[int], tolerance: int
) -> dict[str, object]:
    """Rank 1's Cholesky and eigh raise at ``fail_steps``: it owns (and must still send) CT
    inverses, and its NCT inversions fail while rank 0's succeed."""
    model = DistributedDataParallel(_model())
    precond = KFACPreconditioner(
        model, strategy="mpd-kfac", max_inverse_failures=tolerance, inv_update_steps=1
    )  # an inversion at every step, so each of ``fail_steps`` fails one
    real_cholesky, real_eigh = torch.linalg.cholesky_ex, torch.linalg.eigh

    def broken(*args: object, **kwargs: object) -> object:
        raise torch.linalg.LinAlgError("injected failure")

    outcome: dict[str, object] = {"raised": None, "inverses": []}
    for step in range(6):
        model.zero_grad()
        inputs, targets = _batch(rank, step)
        F.cross_entropy(model(inputs), targets).backward()
        failing = rank == 1 and step in fail_steps
        torch.linalg.cholesky_ex = broken if failing else real_cholesky  # type: ignore[assignment]
        torch.linalg.eigh = broken if failing else real_eigh  # type: ignore[assignment]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                precond.step()
        except RuntimeError as error:
            outcome["raised"] = (step, str(error))
            break
        finally:
            torch.linalg.cholesky_ex, torch.linalg.eigh = real_cholesky, real_eigh
        outcome["inverses"].append(  # type: ignore[union-attr]
            [precond.inverses(n) for n in precond.layers]
        )
    return outcome


def test_failed_inversion_on_one_rank_keeps_previous_inverses_everywhere() -> None:
    results = run_distributed(_failing_worker, 2, [2], 3)
    assert results[0]["raised"] is None and results[1]["raised"] is None
    ranks = [r["inverses"] for r in results]
    for step in range(6):
        for ours, theirs in zip(ranks[0][step], ranks[1][step], strict=True):
            for a, b in zip(ours, theirs, strict=True):
                assert torch.equal(a, b), step
    # Round-robin at world size 2: rank 0 owns every A, rank 1 every G. At step 2 rank 1's
    # inversions failed, so every rank kept step 1's G inverses; the A inverses moved on.
    for before, at in zip(ranks[0][1], ranks[0][2], strict=True):
        a_before, g_before = before
        a_at, g_at = at
        assert torch.equal(g_before, g_at)
        assert not torch.equal(a_before, a_at)


def test_repeated_failures_raise_on_every_rank_together() -> None:
    results = run_distributed(_failing_worker, 2, [1, 2, 3], 1)
    for result in results:
        step, message = result["raised"]
        assert step == 2 and "consecutive" in message and "max_inverse_failures=1" in message


def _nan_worker(rank: int, world_size: int, where: str, use_ddp: bool) -> list[object]:
    base = _model()
    model = DistributedDataParallel(base) if use_ddp else base
    precond = KFACPreconditioner(model, factor_update_steps=2, inv_update_steps=2)
    log: list[object] = []
    for step in range(4):
        model.zero_grad()
        inputs, targets = _batch(rank, step)
        if where == "input" and step == 2 and rank == 0:
            inputs[0, 0, 0, 0] = float("inf")
        F.cross_entropy(model(inputs), targets).backward()
        if where == "grad" and step == 1 and rank == 1:
            base[0].weight.grad[0, 0, 0, 0] = float("nan")
        applied = precond.step()
        a_factor, _ = precond.factors("0")
        assert a_factor is not None
        log.append((applied, a_factor.clone(), precond.skipped_steps))
    return log


@pytest.mark.parametrize(
    ("where", "use_ddp", "skipped_step"),
    [("input", True, 2), ("grad", False, 1)],
    ids=["inf-input-factor-step", "nan-grad-non-factor-step-no-ddp"],
)
def test_non_finite_on_one_rank_skips_the_step_on_every_rank(
    where: str, use_ddp: bool, skipped_step: int
) -> None:
    logs = run_distributed(_nan_worker, 2, where, use_ddp)
    for step in range(4):
        applied = [log[step][0] for log in logs]
        assert applied == [step != skipped_step] * 2, (step, applied)
        # Factors are replicated and never absorb the bad step.
        assert torch.equal(logs[0][step][1], logs[1][step][1])
        assert torch.isfinite(logs[0][step][1]).all()
    if where == "input":
        assert torch.equal(logs[0][2][1], logs[0][1][1])  # step 2 did not change A


def test_grad_scaler_unscales_g() -> None:
    torch.manual_seed(0)
    inputs, targets = _batch(0, 0)
    factors = []
    for scale in (None, 1024.0):
        model = _model()
        scaler = None if scale is None else torch.amp.GradScaler("cpu", init_scale=scale)
        precond = KFACPreconditioner(model, grad_scaler=scaler)
        loss = F.cross_entropy(model(inputs), targets)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler.unscale_(optimizer)
        precond.step()
        factors.append(precond.factors("3")[1])
    torch.testing.assert_close(factors[0], factors[1], rtol=1e-5, atol=1e-8)


def test_bfloat16_factors_stay_finite_over_50_steps() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    precond = KFACPreconditioner(
        model, factor_options=FactorOptions(compute_dtype=torch.bfloat16), damping=1e-4
    )
    for step in range(50):
        optimizer.zero_grad()
        inputs, targets = _batch(0, step)
        F.cross_entropy(model(inputs), targets).backward()
        assert precond.step()
        optimizer.step()
    for name in precond.layers:
        for tensor in precond.factors(name) + precond.inverses(name):
            assert tensor is not None and tensor.dtype == torch.float32
            assert torch.isfinite(tensor).all()


def test_tiny_damping_with_rank_deficient_factors() -> None:
    model = nn.Sequential(nn.Linear(20, 8), nn.Tanh(), nn.Linear(8, 3))
    precond = KFACPreconditioner(model, damping=1e-12, kl_clip=1e-3)
    inputs = torch.randn(2, 20)  # rank 2 ≪ 21: A is rank deficient
    F.cross_entropy(model(inputs), torch.tensor([0, 1])).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert precond.step()
    for parameter in model.parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all()
