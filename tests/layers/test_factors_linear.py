"""Linear A and G factors against explicit per-example float64 loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kfac_reference import outer_mean, output_grad, with_one
from spdkfac import KFACPreconditioner

CLASSES = 3


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(6,), (3, 4)], ids=["2d", "3d"])
def test_linear_factors_match_reference(bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(5, 4, bias=bias).double()
    head = nn.Linear(4, CLASSES).double()
    model = nn.Sequential(layer, nn.Tanh(), head)
    inputs = torch.randn(*shape, 5, dtype=torch.float64)
    targets = torch.randint(0, CLASSES, shape)
    precond = KFACPreconditioner(model, kl_clip=None)

    logits = model(inputs)
    F.cross_entropy(logits.reshape(-1, CLASSES), targets.reshape(-1)).backward()
    precond.step()
    a_factor, g_factor = precond.factors("0")

    # Leading dims fold into the batch: every row is one example of the mean loss.
    rows = inputs.reshape(-1, 5)
    row_targets = targets.reshape(-1)
    a_rows = [with_one(r) if bias else r for r in rows]
    deltas = [
        output_grad(
            layer(rows[i]),
            lambda y, t=row_targets[i]: F.cross_entropy(head(torch.tanh(y))[None], t[None]),
        )
        for i in range(rows.shape[0])
    ]
    assert a_factor is not None and g_factor is not None
    torch.testing.assert_close(a_factor, outer_mean(a_rows), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_factor, outer_mean(deltas), rtol=1e-10, atol=1e-12)


def test_linear_factor_dims_and_symmetry() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(7, 3), nn.ReLU(), nn.Linear(3, 2, bias=False))
    precond = KFACPreconditioner(model)
    model(torch.randn(8, 7)).sum().backward()
    precond.step()
    a0, g0 = precond.factors("0")
    a2, g2 = precond.factors("2")
    assert a0 is not None and g0 is not None and a2 is not None and g2 is not None
    assert a0.shape == (8, 8) and g0.shape == (3, 3)
    assert a2.shape == (3, 3) and g2.shape == (2, 2)
    for factor in (a0, g0, a2, g2):
        torch.testing.assert_close(factor, factor.T)
