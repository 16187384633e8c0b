"""Method selection, options, low-precision compute and the adapters' option plumbing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spdkfac.layers import Conv2dLayer, FactorOptions, LinearLayer, lookup
from spdkfac.layers.conv2d import conv2d_a_factor, conv2d_g_factor
from spdkfac.layers.factor_costs import Conv2dGeometry, estimate_conv2d_a_seconds
from spdkfac.layers.linear import linear_a_factor
from spdkfac.layers.methods import (
    conv2d_a_factor_fast,
    conv2d_a_methods,
    select_conv2d_a_method,
)


def _geometry(
    stride: int = 1, kernel: int = 3, padding: int = 1, dtype: torch.dtype = torch.float32
) -> Conv2dGeometry:
    return Conv2dGeometry(
        batch=32,
        channels=16,
        size=(32, 32),
        kernel_size=(kernel, kernel),
        stride=(stride, stride),
        padding=(padding, padding),
        dilation=(1, 1),
        bias=False,
        compute_dtype=dtype,
        device_type="cpu",
    )


def test_candidates() -> None:
    assert conv2d_a_methods(_geometry()) == ("im2col", "correlation")
    assert conv2d_a_methods(_geometry(stride=2)) == ("im2col",)
    assert conv2d_a_methods(_geometry(kernel=1, padding=0)) == ("im2col",)
    # In bf16 the correlation's cancellation needs windows covering most of the image.
    assert "correlation" in conv2d_a_methods(_geometry(dtype=torch.bfloat16))
    narrow = Conv2dGeometry(**{**_geometry(dtype=torch.bfloat16).__dict__, "size": (6, 6)})
    narrow = Conv2dGeometry(**{**narrow.__dict__, "kernel_size": (5, 5), "padding": (0, 0)})
    assert conv2d_a_methods(narrow) == ("im2col",)


def test_model_prefers_correlation_for_large_images_and_is_deterministic() -> None:
    geometry = _geometry()
    costs = {m: estimate_conv2d_a_seconds(geometry, m) for m in ("im2col", "correlation")}
    assert costs["correlation"] < costs["im2col"]
    assert all(cost > 0 for cost in costs.values())
    assert select_conv2d_a_method(geometry) == "correlation"
    assert select_conv2d_a_method(geometry) == select_conv2d_a_method(geometry)
    with pytest.raises(ValueError, match="does not apply"):
        estimate_conv2d_a_seconds(_geometry(stride=2), "correlation")
    off_cpu = Conv2dGeometry(**{**geometry.__dict__, "device_type": "cuda"})
    assert select_conv2d_a_method(off_cpu) == "im2col"


def test_measured_choice_is_cached_per_geometry() -> None:
    geometry = Conv2dGeometry(**{**_geometry().__dict__, "batch": 3, "size": (9, 7)})
    calls: list[str] = []

    def measure(method: str) -> float:
        calls.append(method)
        return {"im2col": 2.0, "correlation": 1.0}[method]

    assert select_conv2d_a_method(geometry, policy="measure", measure=measure) == "correlation"
    assert sorted(calls) == ["correlation", "im2col"]
    assert select_conv2d_a_method(geometry, policy="measure", measure=measure) == "correlation"
    assert len(calls) == 2  # no second measurement
    unseen = Conv2dGeometry(**{**geometry.__dict__, "batch": 5})
    with pytest.raises(ValueError, match="measure"):
        select_conv2d_a_method(unseen, policy="measure")


def test_measure_policy_end_to_end() -> None:
    inputs = torch.randn(2, 3, 9, 8, dtype=torch.float64)
    options = FactorOptions(selection="measure")
    geometry = Conv2dGeometry.of(inputs, (3, 3), (1, 1), (1, 1), (1, 1), bias=True)
    result = conv2d_a_factor_fast(inputs, geometry, options=options)
    expected = conv2d_a_factor(inputs, geometry)
    torch.testing.assert_close(result, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"method": "fastest"}, "method"),
        ({"selection": "guess"}, "selection"),
        ({"compute_dtype": torch.int8}, "compute_dtype"),
        ({"compute_dtype": "bfloat16"}, "compute_dtype"),
    ],
)
def test_options_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FactorOptions(**kwargs)  # type: ignore[arg-type]


def test_fast_entry_point_refuses_the_reference_method() -> None:
    inputs = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="reference"):
        conv2d_a_factor_fast(
            inputs, Conv2dGeometry.of(inputs, (3, 3), (1, 1), (1, 1), (1, 1), bias=False),
            options=FactorOptions(method="reference"),
        )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("stride", [1, 2])
def test_low_precision_compute(dtype: torch.dtype, stride: int) -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 6, 3, stride=stride, padding=1)
    # Large activations and many positions: float16 needs its input scaling here.
    inputs = 50.0 * torch.randn(8, 8, 20, 20).relu()
    grads = torch.randn(8, 6, 20 // stride, 20 // stride) * 1e-4
    adapter = Conv2dLayer(options=FactorOptions(compute_dtype=dtype))
    factor, _ = adapter.a_factor(conv, inputs)
    g_factor, _ = adapter.g_factor(conv, grads)
    assert factor.dtype == g_factor.dtype == torch.float32
    wide = inputs.double()
    exact = conv2d_a_factor(
        wide, Conv2dGeometry.of(wide, (3, 3), (stride,) * 2, (1, 1), (1, 1), bias=True)
    )
    g_exact = conv2d_g_factor(grads.double())
    for value, reference in ((factor, exact), (g_factor, g_exact)):
        assert torch.isfinite(value).all()
        error = (value.double() - reference).norm() / reference.norm()
        assert error < 1e-2
    layer = LinearLayer(options=FactorOptions(compute_dtype=dtype))
    rows = 30.0 * torch.randn(500, 7)
    linear, _ = layer.a_factor(nn.Linear(7, 2), rows)
    error = (linear.double() - linear_a_factor(rows.double(), True)).norm()
    assert error / linear_a_factor(rows.double(), True).norm() < 1e-2


def test_adapters_carry_options() -> None:
    conv, linear = nn.Conv2d(2, 2, 3), nn.Linear(2, 2)
    default = lookup(conv)
    assert isinstance(default, Conv2dLayer) and default.options == FactorOptions()
    options = FactorOptions(method="im2col", compute_dtype=torch.bfloat16)
    configured = default.with_options(options)
    assert isinstance(configured, Conv2dLayer) and configured.options is options
    assert default.options == FactorOptions()  # the registered adapter is unchanged
    linear_adapter = lookup(linear)
    assert isinstance(linear_adapter, LinearLayer)
    assert linear_adapter.with_options(options).options is options


def test_rank_deficient_factors_ignore_low_precision() -> None:
    # Fewer rows than the side: rounding the output would push the zero eigenvalues of
    # the factor far below -γ, so the product is computed in the input's dtype instead.
    rows = torch.randn(8, 64)
    layer = LinearLayer(options=FactorOptions(compute_dtype=torch.bfloat16))
    exact_dtype = LinearLayer().a_factor(nn.Linear(64, 3), rows)[0]
    low, _ = layer.a_factor(nn.Linear(64, 3), rows)
    torch.testing.assert_close(low, exact_dtype, rtol=0, atol=0)
    damped = low.double() + 1e-3 * torch.eye(65, dtype=torch.float64)
    assert torch.linalg.cholesky_ex(damped).info == 0


def test_an_enclosing_autocast_does_not_lower_the_precision() -> None:
    # Hooks run inside the model's forward, possibly under autocast.
    torch.manual_seed(2)
    conv, inputs = nn.Conv2d(8, 4, 3, padding=1), torch.randn(4, 8, 12, 12)
    grads = torch.randn(4, 4, 12, 12)
    wide = inputs.double()
    exact = conv2d_a_factor(
        wide, Conv2dGeometry.of(wide, (3, 3), (1, 1), (1, 1), (1, 1), bias=True)
    )
    for method in ("im2col", "correlation"):
        adapter = Conv2dLayer(options=FactorOptions(method=method))  # type: ignore[arg-type]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            factor, _ = adapter.a_factor(conv, inputs)
            g_factor, _ = adapter.g_factor(conv, grads)
        assert factor.dtype == g_factor.dtype == torch.float32
        torch.testing.assert_close(factor.double(), exact, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            g_factor.double(), conv2d_g_factor(grads.double()), rtol=1e-5, atol=1e-6
        )
