"""Every factor method, in float32 and bf16 compute, on each device against the float64
CPU reference (``FactorOptions(method="reference")``)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import get_args

import pytest
import torch
from torch import Tensor, nn

from spdkfac.layers import FactorOptions, KFACLayer, lookup
from spdkfac.layers.options import FactorMethod
from spdkfac.types import WeightSharing

METHODS: tuple[FactorMethod, ...] = get_args(FactorMethod)
#: Relative Frobenius error allowed against the float64 reference, per compute dtype
#: (bf16 products round each input to 8 bits: about 2e-3 per factor, see FactorOptions).
TOLERANCE = {None: 1e-5, torch.bfloat16: 1.5e-2}


def _case(name: str) -> tuple[nn.Module, Tensor]:
    """A layer and an input with more rows than the factor's side (bf16 applies)."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "linear":
        return nn.Linear(12, 7), torch.randn(64, 12, generator=generator)
    if name == "linear-sequence":
        return nn.Linear(10, 6), torch.randn(24, 5, 10, generator=generator)
    if name == "conv2d":  # stride 1, 3x3: correlation applies
        return nn.Conv2d(3, 5, 3, padding=1), torch.randn(6, 3, 10, 10, generator=generator)
    if name == "conv2d-stride2":
        return nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.randn(8, 3, 9, 9, generator=generator)
    if name == "conv2d-1x1":
        return nn.Conv2d(6, 4, 1, bias=False), torch.randn(4, 6, 5, 5, generator=generator)
    if name == "conv1d":
        return nn.Conv1d(3, 5, 3, padding=1), torch.randn(6, 3, 16, generator=generator)
    assert name == "embedding"
    return nn.Embedding(9, 6), torch.randint(0, 9, (40, 3), generator=generator)


#: (case, weight sharing): reduce differs from expand only where weights are shared.
CASES = [(case, "expand") for case in ("linear", "linear-sequence", "conv2d", "conv2d-stride2",
                                       "conv2d-1x1", "conv1d", "embedding")]  # fmt: skip
CASES += [("linear-sequence", "reduce"), ("conv2d", "reduce")]


def _factors(
    adapter: KFACLayer, module: nn.Module, inputs: Tensor
) -> tuple[tuple[Tensor, int], tuple[Tensor, int]]:
    """The layer's (A, rows) and (G, rows) for ``inputs`` and a seeded output gradient."""
    with torch.no_grad():
        output = module(inputs)
    generator = torch.Generator().manual_seed(1)
    grad = torch.randn(output.shape, generator=generator, dtype=torch.float64)
    grad = grad.to(device=output.device, dtype=output.dtype)
    return adapter.a_factor(module, inputs), adapter.g_factor(module, grad)


def _relative_error(value: Tensor, reference: Tensor) -> float:
    difference = torch.linalg.norm(value.double().cpu() - reference)
    return float(difference / torch.linalg.norm(reference).clamp_min(1e-300))


def _check(
    factors: Callable[[], tuple[tuple[Tensor, int], tuple[Tensor, int]]],
    reference: tuple[tuple[Tensor, int], tuple[Tensor, int]],
    device: torch.device,
    tolerance: float,
) -> None:
    for (value, rows), (expected, expected_rows) in zip(factors(), reference, strict=True):
        assert value.device == device
        assert value.dtype == torch.float32  # the input's dtype, whatever the compute dtype
        assert rows == expected_rows
        assert value.shape == expected.shape
        assert _relative_error(value, expected) < tolerance


@pytest.mark.parametrize(("case", "sharing"), CASES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("compute_dtype", [None, torch.bfloat16], ids=["float32", "bf16"])
def test_factor_methods_match_the_float64_cpu_reference(
    device: torch.device,
    case: str,
    method: FactorMethod,
    compute_dtype: torch.dtype | None,
    sharing: WeightSharing,
) -> None:
    module, inputs = _case(case)
    base = lookup(module)
    assert base is not None
    reference_adapter = base.with_options(FactorOptions(method="reference"), weight_sharing=sharing)
    reference_module = copy.deepcopy(module).double()
    reference_inputs = inputs if not inputs.is_floating_point() else inputs.double()
    reference = tuple(
        (factor.double(), rows)
        for factor, rows in _factors(reference_adapter, reference_module, reference_inputs)
    )
    options = FactorOptions(method=method, compute_dtype=compute_dtype)
    adapter = base.with_options(options, weight_sharing=sharing)
    module, inputs = module.to(device), inputs.to(device)
    tolerance = TOLERANCE[compute_dtype]
    _check(lambda: _factors(adapter, module, inputs), reference, device, tolerance)  # type: ignore[arg-type]
    if method == "auto":  # the measured selection times each candidate on this device
        measured = base.with_options(
            FactorOptions(method="auto", selection="measure", compute_dtype=compute_dtype),
            weight_sharing=sharing,
        )
        _check(lambda: _factors(measured, module, inputs), reference, device, tolerance)  # type: ignore[arg-type]
