"""Choosing how to compute a Conv2d A factor: candidates, a modelled or measured choice."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch
from torch import Tensor

from spdkfac.layers.correlation import conv2d_a_factor_correlation, correlation_supported
from spdkfac.layers.correlation_plan import window_coverage
from spdkfac.layers.factor_costs import ConcreteMethod, estimate_conv2d_a_seconds
from spdkfac.layers.geometry import Conv2dGeometry
from spdkfac.layers.im2col import conv2d_a_factor_im2col
from spdkfac.layers.kernels import LOW_PRECISION_DTYPES
from spdkfac.layers.options import FactorMethod, FactorOptions, SelectionPolicy

__all__ = [
    "LOW_PRECISION_MIN_COVERAGE",
    "ConcreteMethod",
    "Conv2dGeometry",
    "conv2d_a_factor_fast",
    "conv2d_a_methods",
    "estimate_conv2d_a_seconds",
    "select_conv2d_a_method",
]

#: In bf16/fp16, correlation is a candidate only when every window of first positions
#: covers at least this fraction of the image (its rounding error grows as 1/coverage).
LOW_PRECISION_MIN_COVERAGE = 0.5


def conv2d_a_methods(geometry: Conv2dGeometry) -> tuple[ConcreteMethod, ...]:
    """The fast methods for this geometry: im2col always, correlation at stride 1 (k > 1).

    In bf16/fp16, correlation also needs windows covering most of the image (see
    :data:`LOW_PRECISION_MIN_COVERAGE`), so that its error stays that of im2col.
    """
    g = geometry
    if not correlation_supported(g.stride) or g.kernel_size == (1, 1):
        return ("im2col",)
    if g.compute_dtype in LOW_PRECISION_DTYPES:
        coverage = window_coverage(g)
        if coverage < LOW_PRECISION_MIN_COVERAGE:
            return ("im2col",)
    return ("im2col", "correlation")


_MEASURED: dict[Conv2dGeometry, ConcreteMethod] = {}


def select_conv2d_a_method(
    geometry: Conv2dGeometry,
    *,
    policy: SelectionPolicy = "model",
    measure: Callable[[ConcreteMethod], float] | None = None,
) -> ConcreteMethod:
    """The method to use for this geometry.

    Args:
        geometry: The call's geometry.
        policy: ``"model"``: the cheapest by :func:`estimate_conv2d_a_seconds` on CPUs,
            im2col elsewhere. ``"measure"``: the fastest by ``measure`` (seconds of one
            run of a method), cached per geometry for the life of the process.
        measure: Times one method; required for ``"measure"`` on a geometry not seen yet.
    """
    candidates = conv2d_a_methods(geometry)
    if len(candidates) == 1:
        return candidates[0]
    if policy == "measure":
        if geometry not in _MEASURED:
            if measure is None:
                raise ValueError("selection 'measure' needs a measure callable for a new geometry")
            _MEASURED[geometry] = min(candidates, key=measure)
        return _MEASURED[geometry]
    if geometry.device_type != "cpu":
        return "im2col"
    return min(candidates, key=lambda m: estimate_conv2d_a_seconds(geometry, m))


_KERNELS: Mapping[ConcreteMethod, Callable[[Tensor, Conv2dGeometry], Tensor]] = MappingProxyType(
    {
        "im2col": conv2d_a_factor_im2col,
        "correlation": conv2d_a_factor_correlation,
    }
)

#: How a ``method=`` option picks the kernel of one call from its input, geometry and options.
MethodChooser = Callable[[Tensor, Conv2dGeometry, FactorOptions], ConcreteMethod]


def _choose_by_selection(
    inputs: Tensor, geometry: Conv2dGeometry, options: FactorOptions
) -> ConcreteMethod:
    """The candidate :func:`select_conv2d_a_method` picks by ``options.selection``,
    timing candidates on ``inputs`` when it measures."""

    def measure(candidate: ConcreteMethod) -> float:
        return _time_once(lambda: _KERNELS[candidate](inputs, geometry), inputs.device)

    return select_conv2d_a_method(geometry, policy=options.selection, measure=measure)


def _im2col(inputs: Tensor, geometry: Conv2dGeometry, options: FactorOptions) -> ConcreteMethod:
    """im2col, which handles every geometry."""
    return "im2col"


def _correlation_where_supported(
    inputs: Tensor, geometry: Conv2dGeometry, options: FactorOptions
) -> ConcreteMethod:
    """Correlation where it is a candidate for the geometry, im2col elsewhere."""
    return "correlation" if "correlation" in conv2d_a_methods(geometry) else "im2col"


def _no_fast_reference(
    inputs: Tensor, geometry: Conv2dGeometry, options: FactorOptions
) -> ConcreteMethod:
    """Refuses: the reference is not a fast method."""
    raise ValueError("conv2d_a_factor_fast runs the fast methods; the reference is conv2d_a_factor")


#: The chooser of every ``FactorOptions.method``: ``"auto"`` selects per geometry (by the
#: cost model or by measuring), the named fast methods are forced where they apply.
_CHOOSERS: Mapping[FactorMethod, MethodChooser] = MappingProxyType(
    {
        "auto": _choose_by_selection,
        "reference": _no_fast_reference,
        "im2col": _im2col,
        "correlation": _correlation_where_supported,
    }
)


def conv2d_a_factor_fast(
    inputs: Tensor, geometry: Conv2dGeometry, *, options: FactorOptions | None = None
) -> Tensor:
    """The Conv2d A factor of :func:`~spdkfac.layers.conv2d.conv2d_a_factor` by the chosen method.

    Args:
        inputs: ``[B, C, H, W]`` layer input, already padded for non-zero padding modes.
        geometry: Its geometry (:meth:`Conv2dGeometry.of`, given ``options.compute_dtype``):
            the convolution, the bias row and column, and the dtype the products run in.
        options: Method and selection policy; None means the defaults. The compute dtype
            is the geometry's.

    Returns:
        New ``[C·kh·kw(+1), C·kh·kw(+1)]`` symmetric factor of the input's dtype.

    Raises:
        ValueError: For ``method="reference"``, which is
            :func:`~spdkfac.layers.conv2d.conv2d_a_factor` itself.
    """
    options = FactorOptions() if options is None else options
    method = _CHOOSERS[options.method](inputs, geometry, options)
    return _KERNELS[method](inputs, geometry)


def _time_once(run: Callable[[], Tensor], device: torch.device) -> float:
    """Seconds of one run after a warm-up run (which also fills the workspaces)."""
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
