"""Hooks that might not fire (M22): a model compiled and run before the preconditioner is
built (its graph traced without the hooks), and ``nn.TransformerEncoderLayer``'s fused
fast path, taken by no-grad evaluation passes, give the factors and preconditioned
gradients of the plain eager model (float64) — never silently unpreconditioned layers."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac import KFACPreconditioner


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _train(
    model: nn.Module, call: Callable[[Tensor], Tensor], between: Callable[[], None] | None = None
) -> tuple[list[Tensor], dict[str, Tensor]]:
    precond = KFACPreconditioner(model, kl_clip=None, factor_update_steps=1, inv_update_steps=1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        inputs = torch.randn(5, 4, 6, dtype=torch.float64, generator=generator)
        targets = torch.randint(0, 3, (5, 4), generator=generator)
        if between is not None:
            between()
        model.zero_grad()
        F.cross_entropy(call(inputs).reshape(-1, 3), targets.reshape(-1)).backward()
        assert precond.step()
    factors = {n: f for n in precond.layers for f in precond.factors(n) if f is not None}
    assert len(factors) == len(precond.layers), "a registered layer captured nothing"
    return [p.grad.clone() for p in model.parameters()], factors  # type: ignore[union-attr]


def _assert_same(got: tuple[list[Tensor], dict[str, Tensor]], expected: Any) -> None:
    for a, b in zip(got[0], expected[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert got[1].keys() == expected[1].keys()
    for name, value in expected[1].items():
        torch.testing.assert_close(got[1][name], value, rtol=1e-10, atol=1e-12)


def test_a_model_compiled_and_run_before_the_preconditioner_is_captured() -> None:
    eager = _mlp()
    source = copy.deepcopy(eager)
    compiled = torch.compile(source, backend="aot_eager")  # AOTAutograd traces backward too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        compiled(torch.randn(2, 6, dtype=torch.float64)).sum().backward()  # traced hookless
        got = _train(source, compiled)
    _assert_same(got, _train(eager, eager))


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(6, 2, 12, dropout=0.0, batch_first=True)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(x))


def test_transformer_encoder_fast_path_passes_leave_the_factors_alone() -> None:
    torch.manual_seed(0)
    plain = _Encoder().double()
    evaluated = copy.deepcopy(plain)

    def evaluate() -> None:  # eval + no_grad: the conditions of the fused fast path
        evaluated.eval()
        with torch.no_grad():
            evaluated(torch.randn(2, 4, 6, dtype=torch.float64))
        evaluated.train()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # attention and norms not preconditioned
        expected = _train(plain, plain)
        got = _train(evaluated, evaluated, evaluate)
    _assert_same(got, expected)
