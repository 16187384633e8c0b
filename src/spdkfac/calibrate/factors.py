"""Timing every K-FAC layer's A and G factor products on one captured batch."""

from __future__ import annotations

import functools
import time
import warnings
from typing import NamedTuple

import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac.calibrate.timing import Budget, median_seconds
from spdkfac.costmodel import FactorSample, factor_flops
from spdkfac.curvature import ActivationCapture, discover_layers
from spdkfac.layers import KFACLayer
from spdkfac.support.checks import check_int

__all__ = ["measure_factors"]


class _Captured(NamedTuple):
    module: nn.Module
    adapter: KFACLayer
    layer_input: Tensor
    grad_output: Tensor


def _capture(model: nn.Module, inputs: Tensor, targets: Tensor) -> dict[str, _Captured]:
    """Input and output gradient of every K-FAC layer of ``model`` for one batch."""
    with warnings.catch_warnings():
        # "these layers are not preconditioned" (BatchNorm, ...) is not news here.
        warnings.simplefilter("ignore", UserWarning)
        layers = discover_layers(model, ())
    inputs_seen: dict[str, list[Tensor]] = {name: [] for name in layers}
    grads_seen: dict[str, list[Tensor]] = {name: [] for name in layers}
    capture = ActivationCapture(
        {name: state.module for name, state in layers.items()},
        on_input=lambda name, _module, tensor: inputs_seen[name].append(tensor),
        on_grad_output=lambda name, _module, _inputs, grad: grads_seen[name].append(grad),
        enabled=lambda: True,
    )
    try:
        model.train()
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(inputs), targets).backward()
    finally:
        capture.remove()
    # A layer called twice per forward is timed on its first call: its first input and the
    # last gradient (backward runs in reverse).
    return {
        name: _Captured(state.module, state.adapter, inputs_seen[name][0], grads_seen[name][-1])
        for name, state in layers.items()
        if inputs_seen[name] and grads_seen[name]
    }


def measure_factors(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    repeats: int,
    *,
    budget: Budget | None = None,
) -> list[FactorSample]:
    """Median seconds of every K-FAC layer's A and G factor on one captured batch.

    The layer adapters' ``a_factor`` / ``g_factor`` run on the inputs and output
    gradients captured from one forward/backward pass of ``model`` with a cross-entropy
    loss, in ``named_modules`` order; layers left when ``budget`` runs out are skipped.
    """
    check_int("repeats", repeats)
    captured = _capture(model, inputs, targets)
    samples: list[FactorSample] = []
    names = list(captured)
    last = 0.0
    for index, name in enumerate(names):
        if samples and budget is not None and not budget.allows(last):
            budget.skip("factor layers", names[index:], last)
            break
        start = time.perf_counter()
        layer = captured[name]
        g_dim = layer.adapter.g_dim(layer.module)
        rows = layer.grad_output.numel() // g_dim  # one patch row per output position
        for kind, compute, tensor, dim in (
            ("A", layer.adapter.a_factor, layer.layer_input, layer.adapter.a_dim(layer.module)),
            ("G", layer.adapter.g_factor, layer.grad_output, g_dim),
        ):
            seconds = median_seconds(
                functools.partial(compute, layer.module, tensor), repeats, inputs.device
            )
            samples.append(FactorSample(name, kind, factor_flops(rows, dim), seconds))  # type: ignore[arg-type]
        last = time.perf_counter() - start
    return samples
