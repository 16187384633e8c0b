"""What one training iteration of a model computes, traced op by op on the ``meta`` device.

A :class:`Workload` is the sequence of ATen operations of one forward and backward pass
(cross-entropy loss), interleaved with the moments the real preconditioner acts: a K-FAC
layer's forward pre-hook (where A is computed, before the layer runs), its output-gradient
hook (where G is computed, before the layer's own backward) and each parameter's gradient
becoming final (what DDP buckets wait for). Operations carry FLOPs, bytes moved and their
smallest GEMM side; a :class:`~spdkfac.sim.presets.DeviceModel` turns them into seconds.
On ``meta`` the trace allocates nothing, so ResNet-50-sized models cost no memory; on a real
device :func:`trace_workload` can also time every operation (``repeats`` > 0).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spdkfac.costmodel import factor_flops
from spdkfac.curvature import discover_layers
from spdkfac.sim.items import FactorHook, GradReady, Op, TraceItem
from spdkfac.sim.tracer import median_times, normalised, one_pass, plain_seconds

__all__ = [
    "FactorHook",
    "GradReady",
    "LayerSpec",
    "Op",
    "TraceItem",
    "Workload",
    "trace_workload",
]


@dataclass(frozen=True)
class LayerSpec:
    """One K-FAC layer as the preconditioner registers it.

    Attributes:
        name: Module name (``named_modules`` key).
        kind: ``"conv2d"`` or ``"linear"``.
        a_dim: Side of A (inputs per output unit, +1 with a bias).
        g_dim: Side of G (output units).
        rows: Rows of the factor products per call (B·S for Conv2d, B for Linear).
    """

    name: str
    kind: str
    a_dim: int
    g_dim: int
    rows: int

    @property
    def a_flops(self) -> float:
        """FLOPs of the A product (the calibration's convention, 2·rows·d²)."""
        return factor_flops(self.rows, self.a_dim)

    @property
    def g_flops(self) -> float:
        """FLOPs of the G product."""
        return factor_flops(self.rows, self.g_dim)

    @property
    def precondition_flops(self) -> float:
        """FLOPs of ``Ĝ ∇ Â`` with ∇ of shape [g, a]."""
        return 2.0 * self.g_dim * self.a_dim * (self.g_dim + self.a_dim)


@dataclass(frozen=True)
class Workload:
    """One iteration of a model at a batch size, as a trace (see the module docstring).

    Attributes:
        model: Model name.
        batch_size: Examples per rank.
        input_shape: Shape of one example (C, H, W) or (features,).
        layers: K-FAC layers in forward (pre-hook) order.
        forward: Ops and A hooks of the forward pass, loss included.
        backward: Ops, G hooks and gradient-ready marks of the backward pass.
        parameters: ``(name, numel)`` of every trainable parameter, in registration order.
        buffer_bytes: Bytes of the model's buffers (batch-norm statistics), which DDP
            broadcasts from rank 0 before every forward.
    """

    model: str
    batch_size: int
    input_shape: tuple[int, ...]
    layers: tuple[LayerSpec, ...]
    forward: tuple[TraceItem, ...]
    backward: tuple[TraceItem, ...]
    parameters: tuple[tuple[str, int], ...]
    buffer_bytes: int = 0

    def __post_init__(self) -> None:
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError("layer names must be unique")
        known = set(names)
        for item in (*self.forward, *self.backward):
            if isinstance(item, FactorHook) and item.layer not in known:
                raise ValueError(f"hook of unknown layer {item.layer!r}")

    def layer(self, name: str) -> LayerSpec:
        """The layer called ``name``."""
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    @property
    def g_order(self) -> tuple[str, ...]:
        """Layers in the order their G hooks fire (last firing of each)."""
        seen: dict[str, None] = {}
        for item in self.backward:
            if isinstance(item, FactorHook) and item.kind == "G":
                seen.pop(item.layer, None)
                seen[item.layer] = None
        rest = [layer.name for layer in reversed(self.layers) if layer.name not in seen]
        return (*seen, *rest)

    @property
    def parameter_count(self) -> int:
        """Trainable parameters (elements)."""
        return sum(numel for _, numel in self.parameters)

    def ops(self) -> list[Op]:
        """Every op of the forward and backward pass."""
        return [item for item in (*self.forward, *self.backward) if isinstance(item, Op)]


def _discovered(model: nn.Module) -> dict[str, Any]:
    """The preconditioner's layers of ``model`` (name → block with ``a_dim``/``g_dim``);
    discovery needs only shapes, so a ``meta`` model works."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not preconditioned": BatchNorm
        return dict(discover_layers(model, ()))


def trace_workload(
    model: nn.Module | Callable[[], nn.Module],
    input_shape: Sequence[int],
    *,
    batch_size: int,
    name: str = "model",
    device: torch.device | str = "meta",
    repeats: int = 0,
    vocab_size: int | None = None,
) -> Workload:
    """Trace one training iteration of ``model`` on ``batch_size`` examples.

    Args:
        model: The model, or a function building it (called under ``device``, so a
            builder costs no memory on ``meta``).
        input_shape: Shape of one example, e.g. ``(3, 224, 224)``.
        batch_size: Examples per rank.
        name: Model name recorded in the workload.
        device: ``"meta"`` (shapes only) or a real device to time ops on.
        repeats: With a real device, passes to time (the median per op is kept, then
            all are scaled so a pass adds up to the median untraced pass); the first pass
            is a warm-up and not counted.
        vocab_size: For a language model: inputs are token ids in ``[0, vocab_size)`` of
            shape ``input_shape`` per example, and every position has a target.

    Raises:
        ValueError: A bad size, or a model without K-FAC layers.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not input_shape or any(size < 1 for size in input_shape):
        raise ValueError(f"input_shape must be positive sizes, got {tuple(input_shape)}")
    device = torch.device(device)
    timed = device.type != "meta" and repeats > 0
    if isinstance(model, nn.Module):
        built = model.to(device)
    else:
        with device:
            built = model()
    states = _discovered(built)
    by_name = dict(built.named_modules())
    modules = {layer_name: by_name[layer_name] for layer_name in states}
    if vocab_size is None:
        inputs = torch.randn(batch_size, *input_shape, device=device)
        targets = torch.zeros(batch_size, dtype=torch.long, device=device)
    else:
        inputs = torch.randint(0, vocab_size, (batch_size, *input_shape), device=device)
        targets = torch.zeros_like(inputs)
    passes = [one_pass(built, modules, inputs, targets, timed=timed)]
    if timed:
        passes = [one_pass(built, modules, inputs, targets, timed=True) for _ in range(repeats)]
    forward, backward, rows = passes[0]
    if timed:
        forward = median_times([run[0] for run in passes])
        backward = median_times([run[1] for run in passes])
        forward, backward = normalised(
            forward, backward, plain_seconds(built, inputs, targets, repeats)
        )
    order = list(dict.fromkeys(i.layer for i in forward if isinstance(i, FactorHook)))
    layers = tuple(
        LayerSpec(
            name=layer_name,
            kind="conv2d" if isinstance(modules[layer_name], nn.Conv2d) else "linear",
            a_dim=states[layer_name].a_dim,
            g_dim=states[layer_name].g_dim,
            rows=rows[layer_name],
        )
        for layer_name in order
    )
    parameters = tuple(
        (param_name, parameter.numel())
        for param_name, parameter in built.named_parameters()
        if parameter.requires_grad
    )
    return Workload(
        model=name,
        batch_size=batch_size,
        input_shape=tuple(input_shape),
        layers=layers,
        forward=tuple(forward),
        backward=tuple(backward),
        parameters=parameters,
        buffer_bytes=sum(b.numel() * b.element_size() for b in built.buffers()),
    )
