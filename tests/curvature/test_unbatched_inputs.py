"""Unbatched inputs torch accepts (a 0-d embedding index, a ``[C, H, W]`` image, a 1-d
Linear input, a ``[C, L]`` sequence, a LayerNorm over one vector) are captured as a batch
of one: the forward works as without spdkfac, with the factors and preconditioned
gradients of the same input given a batch dim of one (issue 39, item 6)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from spdkfac import KFACPreconditioner
from spdkfac.layers import FactorOptions

CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], Tensor]]] = {
    "embedding-0d": (lambda: nn.Embedding(6, 3), lambda: torch.tensor(4)),
    "linear-1d": (lambda: nn.Linear(5, 3), lambda: torch.randn(5, dtype=torch.float64)),
    "conv1d-CL": (lambda: nn.Conv1d(2, 3, 3), lambda: torch.randn(2, 7, dtype=torch.float64)),
    "depthwise-conv1d-CL": (
        lambda: nn.Conv1d(2, 4, 3, groups=2),
        lambda: torch.randn(2, 7, dtype=torch.float64),
    ),
    "conv2d-CHW": (lambda: nn.Conv2d(2, 3, 3), lambda: torch.randn(2, 5, 6, dtype=torch.float64)),
    "grouped-conv2d-CHW": (
        lambda: nn.Conv2d(2, 4, 3, groups=2),
        lambda: torch.randn(2, 5, 6, dtype=torch.float64),
    ),
    "layernorm-1d": (lambda: nn.LayerNorm(5), lambda: torch.randn(5, dtype=torch.float64)),
    "rmsnorm-1d": (lambda: nn.RMSNorm(5), lambda: torch.randn(5, dtype=torch.float64)),
}


class _Net(nn.Module):
    """The layer under test followed by a fixed Linear head, so every case has a Kronecker
    layer (a norm layer alone would not register)."""

    def __init__(self, layer: nn.Module, example: Tensor) -> None:
        super().__init__()
        self.layer = layer.double()
        width = self.layer(example).numel()
        self.head = nn.Linear(width, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.layer(x)).reshape(-1))


def _run(case: str, batch_of_one: bool, **options: object) -> dict[str, Tensor]:
    make_layer, make_input = CASES[case]
    torch.manual_seed(0)
    example = make_input()
    model = _Net(make_layer(), example).double()
    precond = KFACPreconditioner(model, kl_clip=None, normalization="unit-wise", **options)  # type: ignore[arg-type]
    out: dict[str, Tensor] = {}
    for step in range(2):
        model.zero_grad()
        x = example + step if example.is_floating_point() else example
        y = model(x[None] if batch_of_one else x)
        (y * torch.tensor([0.7, -1.3], dtype=torch.float64)).sum().backward()
        assert precond.step()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None
        out[name] = parameter.grad.clone()
    for name in precond.layers:
        for label, factor in zip("AG", precond.factors(name), strict=True):
            assert factor is not None, f"{name} {label} never captured"
            out[f"{name}.{label}"] = factor
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_unbatched_input_is_a_batch_of_one(case: str) -> None:
    expected = _run(case, batch_of_one=True)
    got = _run(case, batch_of_one=False)
    assert set(got) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-10, atol=1e-13, msg=key)


@pytest.mark.parametrize("case", ["linear-1d", "conv1d-CL", "embedding-0d"])
def test_example_subsampling_never_cuts_an_unbatched_input(case: str) -> None:
    expected = _run(case, batch_of_one=True, factor_options=FactorOptions(examples=1))
    got = _run(case, batch_of_one=False, factor_options=FactorOptions(examples=1))
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-10, atol=1e-13, msg=key)
