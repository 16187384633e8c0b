"""``"eigen-adam"`` where factors are rank-deficient (a batch smaller than a layer's inputs;
the output head's G, since softmax gradients sum to zero): its update does not depend on
the basis ``eigh`` picks inside the null space — a permuted batch gives the same update,
bf16 factors give float64's — against explicit float64 computations."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac import KFACPreconditioner
from spdkfac.forms import EigenAdam, inverse_form
from test_forms_moments import explicit_adam, seen

INPUTS, BATCH = 16, 6  # A of the first layer: rank 6 of 17


def _relative(got: Tensor, want: Tensor) -> float:
    return float(torch.linalg.norm(got.double() - want.double()) / torch.linalg.norm(want))


def _rank_deficient(seed: int) -> tuple[Tensor, Tensor, list[Tensor]]:
    """A (6 x 6, rank 3) and G (4 x 4, rank 2, rows summing to zero as a softmax head's)
    from 3 examples, and two steps' gradients ``Σ g aᵀ`` of such examples."""
    generator = torch.Generator().manual_seed(seed)

    def examples() -> tuple[Tensor, Tensor]:
        a = torch.randn(3, 6, generator=generator, dtype=torch.float64)
        g = torch.randn(3, 4, generator=generator, dtype=torch.float64)
        return a, g - g.mean(dim=1, keepdim=True)

    a, g = examples()
    gradients = [g.T @ a / 3]
    a2, g2 = examples()
    gradients.append(g2.T @ (a2 @ torch.linalg.pinv(a) @ a))  # inside A's range
    return a.T @ a / 3, g.T @ g / 3, gradients


def test_rank_deficient_factors_give_the_explicit_float64_update_in_bf16_and_float64() -> None:
    """The form on rank-deficient float64 factors equals the explicit step (null spaces
    divided by the layer's mean second moment); the same factors stored in bf16 land
    within bf16's rounding of it (before: tens of times off)."""
    a, g, gradients = _rank_deficient(0)
    bases = [(_eigen(a), _eigen(g))] * 2
    expected = explicit_adam(gradients, bases)
    for factor_dtype, tolerance in ((torch.float64, 1e-9), (torch.bfloat16, 0.03)):
        form = inverse_form("eigen-adam", factor_dtype=factor_dtype)
        assert isinstance(form, EigenAdam)
        a_result = form.compute(a.to(factor_dtype), 0.1)
        g_result = form.compute(g.to(factor_dtype), 0.1)
        moments: dict[str, Tensor | None] = dict.fromkeys(form.moments)
        for gradient, want in zip(gradients, expected, strict=True):
            got = form.kronecker(gradient.float(), a_result, g_result, 0.1, moments)
            assert _relative(got, want) < max(tolerance, 1e-6), (factor_dtype, _relative(got, want))


def _eigen(factor: Tensor) -> tuple[Tensor, Tensor]:
    eigenvalues, eigenvectors = torch.linalg.eigh(factor)
    return eigenvectors, seen(eigenvalues)


def test_resolution_follows_the_coarsest_stored_precision() -> None:
    assert EigenAdam().precision == torch.finfo(torch.float32).eps
    assert EigenAdam(torch.bfloat16).precision == torch.finfo(torch.bfloat16).eps
    assert EigenAdam(None, torch.float16).precision == torch.finfo(torch.float16).eps
    assert EigenAdam(torch.float64, torch.float64).resolution(4) == 2 * EigenAdam().precision


# ---------------------------------------------------------------------- preconditioner
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(INPUTS, 8), nn.Tanh(), nn.Linear(8, 5))


def _updates(order: Tensor, steps: int = 3) -> list[Tensor]:
    """Each step's preconditioned gradient of both layers, batches in ``order``."""
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        precond = KFACPreconditioner(
            model, damping=0.1, kl_clip=None, lr=0.1, inverse_method="eigen-adam",
            inv_update_steps=2,
        )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(step)
        inputs = torch.randn(BATCH, INPUTS, generator=generator)
        targets = torch.randint(0, 5, (BATCH,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs[order]), targets[order]).backward()
        assert precond.step()
        out += [p.grad.detach().clone() for p in model.parameters()]
        optimizer.step()
    return out


def test_a_permuted_batch_gives_the_same_update() -> None:
    """The same K-FAC problem (examples in another order: factors and gradient equal to
    rounding) gives the same update to rounding; before, 77 % apart on the first layer."""
    reference = _updates(torch.arange(BATCH))
    for seed in (1, 2):
        order = torch.randperm(BATCH, generator=torch.Generator().manual_seed(seed))
        for got, want in zip(_updates(order), reference, strict=True):
            assert _relative(got, want) < 1e-4, _relative(got, want)
