"""Kronecker factors against an external implementation, ``curvlinops``.

Its KFACLinearOperator (empirical Fisher, bias as an input column), K-FAC-expand and
K-FAC-reduce, for Linear layers shared over a sequence dimension and for Conv2d (a dev
extra; skipped without it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac import KFACPreconditioner

curvlinops = pytest.importorskip("curvlinops")


class _ClassesFirst(nn.Module):
    """``[B, T, C]`` logits → ``[B, C, T]``, the layout ``nn.CrossEntropyLoss`` takes."""

    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2)


def _sequence_model() -> tuple[nn.Module, Tensor, Tensor]:
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3), _ClassesFirst()).double()
    return model, torch.randn(3, 6, 5, dtype=torch.float64), torch.randint(0, 3, (3, 6))


def _conv_model() -> tuple[nn.Module, Tensor, Tensor]:
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1, stride=2), nn.Tanh(), nn.Flatten(), nn.Linear(27, 4)
    ).double()
    return model, torch.randn(3, 2, 5, 6, dtype=torch.float64), torch.randint(0, 4, (3,))


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
@pytest.mark.parametrize("build", [_sequence_model, _conv_model], ids=["sequence-linear", "conv2d"])
def test_factors_agree_with_curvlinops(build: object, sharing: str) -> None:
    torch.manual_seed(0)
    model, inputs, targets = build()  # type: ignore[operator]
    operator = curvlinops.KFACLinearOperator(
        model,
        nn.CrossEntropyLoss(),
        [p for p in model.parameters()],
        [(inputs, targets)],
        fisher_type="empirical",
        kfac_approx=sharing,
        separate_weight_and_bias=False,
        check_deterministic=False,
    )
    operator.compute_kronecker_factors()
    precond = KFACPreconditioner(model, weight_sharing=sharing, kl_clip=None)
    F.cross_entropy(model(inputs), targets).backward()
    precond.step()
    for name in precond.layers:
        a_factor, g_factor = precond.factors(name)
        theirs_a = operator._input_covariances[name]
        theirs_g = operator._gradient_covariances[name]
        # As Kronecker products (a scale may move between the factors).
        torch.testing.assert_close(
            torch.kron(a_factor, g_factor),  # type: ignore[arg-type]
            torch.kron(theirs_a, theirs_g),
            rtol=1e-10,
            atol=1e-13,
        )
