"""What one training iteration of a model computes, traced op by op on the ``meta`` device.

A :class:`Workload` is the sequence of ATen operations of one forward and backward pass
(cross-entropy loss), interleaved with the moments the real preconditioner acts: a K-FAC
layer's forward pre-hook (where A is computed, before the layer runs), its output-gradient
hook (where G is computed, before the layer's own backward) and each parameter's gradient
becoming final (what DDP buckets wait for). Operations carry FLOPs, bytes moved and their
smallest GEMM side; a :class:`~spdkfac.sim.presets.DeviceModel` turns them into seconds.
On ``meta`` the trace allocates nothing, so ResNet-50-sized models cost no memory; on a real
device :func:`trace_workload` can also time every operation (``repeats`` > 0).

The layers are the run's: :func:`~spdkfac.curvature.discover_blocks` with a
:class:`~spdkfac.config.KFACConfig`'s ``skip_layers`` and block settings registers the
blocks, as the preconditioner does, and every Kronecker block becomes a :class:`LayerSpec`;
the factors the placement places are the blocks' own
:meth:`~spdkfac.curvature.CurvatureBlock.inverse_specs` (in the config's inverse form, so
they carry its wire size and compute cost; an embedding's diagonal A is not placed).
Blocks of other families (grouped convolutions, normalization layers), whose statistics
join the dense all-reduce and whose inverses every rank computes in closed form, are
listed in :attr:`Workload.unmodelled` and not simulated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from spdkfac.config import KFACConfig
from spdkfac.costmodel import factor_flops
from spdkfac.curvature import KroneckerBlock, discover_blocks
from spdkfac.forms import DampedInverse, InverseForm
from spdkfac.planning.placement import FactorSpec
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
    """One K-FAC layer as the preconditioner registers it (a Kronecker block).

    Attributes:
        name: Module name (``named_modules`` key).
        kind: The block's layer type, lower-case (its adapter's module type:
            ``"conv2d"``, ``"linear"``, ``"conv1d"``, ``"embedding"``).
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


#: The default inverse form: damped inverses by Cholesky (``KFACConfig``'s default).
DEFAULT_FORM: InverseForm = DampedInverse("cholesky")


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
        form: The inverse form the run computes and sends (``inverse_method``); not
            compared (the factors carry its costs).
        factors: The factors the placement places, in the run's registration order, as
            the blocks describe them in ``form``; empty on construction means A and G of
            every layer, in layer order.
        unmodelled: Names of blocks the run registers that are not simulated (grouped
            convolutions, normalization layers).
    """

    model: str
    batch_size: int
    input_shape: tuple[int, ...]
    layers: tuple[LayerSpec, ...]
    forward: tuple[TraceItem, ...]
    backward: tuple[TraceItem, ...]
    parameters: tuple[tuple[str, int], ...]
    buffer_bytes: int = 0
    form: InverseForm = field(default=DEFAULT_FORM, compare=False)
    factors: tuple[FactorSpec, ...] = ()
    unmodelled: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError("layer names must be unique")
        known = set(names)
        for item in (*self.forward, *self.backward):
            if isinstance(item, FactorHook) and item.layer not in known:
                raise ValueError(f"hook of unknown layer {item.layer!r}")
        if not self.factors:
            every = tuple(
                spec
                for layer in self.layers
                for spec in (
                    FactorSpec.for_form(layer.name, "A", layer.a_dim, self.form),
                    FactorSpec.for_form(layer.name, "G", layer.g_dim, self.form),
                )
            )
            object.__setattr__(self, "factors", every)
        self._check_factors(known)

    def _check_factors(self, known: set[str]) -> None:
        keys = [spec.key for spec in self.factors]
        if len(set(keys)) != len(keys):
            raise ValueError("every placed factor must appear once")
        for spec in self.factors:
            if spec.layer not in known:
                raise ValueError(f"factor {spec.key} of unknown layer")
            if spec != FactorSpec.for_form(spec.layer, spec.kind, spec.dim, self.form):
                raise ValueError(f"factor {spec.key} is not priced as the workload's form")

    def with_form(self, form: InverseForm) -> Workload:
        """This workload with another inverse form (the same factors, priced in it)."""
        factors = tuple(FactorSpec.for_form(s.layer, s.kind, s.dim, form) for s in self.factors)
        return replace(self, form=form, factors=factors)

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


@dataclass(frozen=True)
class _Registered:
    """What a run registers on a model: its Kronecker blocks by name (``named_modules``
    order), the factors their placement places, and the blocks not simulated."""

    blocks: dict[str, KroneckerBlock]
    factors: tuple[FactorSpec, ...]
    unmodelled: tuple[str, ...]


def _registered(model: nn.Module, config: KFACConfig) -> _Registered:
    """The blocks a preconditioner of ``config`` registers on ``model`` (discovery needs
    only shapes, so a ``meta`` model works; no warning about unsupported layers)."""
    blocks = discover_blocks(model, config.skip_layers, config.block_settings, warn=False)
    kronecker = {b.name: b for b in blocks if isinstance(b, KroneckerBlock)}
    factors = tuple(spec for block in kronecker.values() for spec in block.inverse_specs())
    others = tuple(b.name for b in blocks if b.name not in kronecker)
    return _Registered(kronecker, factors, others)


def _kind(block: KroneckerBlock) -> str:
    """The block's layer type: its adapter's (first) module type, lower-case."""
    types = block.adapter.module_types
    return (types[0] if types else type(block.module)).__name__.lower()


def _built(model: nn.Module | Callable[[], nn.Module], device: torch.device) -> nn.Module:
    if isinstance(model, nn.Module):
        return model.to(device)
    with device:
        return model()


def _batch(
    input_shape: tuple[int, ...], batch_size: int, device: torch.device, vocab_size: int | None
) -> tuple[Tensor, Tensor]:
    """Inputs and targets of one batch: float examples and class 0, or token ids with a
    target at every position."""
    if vocab_size is None:
        inputs = torch.randn(batch_size, *input_shape, device=device)
        return inputs, torch.zeros(batch_size, dtype=torch.long, device=device)
    inputs = torch.randint(0, vocab_size, (batch_size, *input_shape), device=device)
    return inputs, torch.zeros_like(inputs)


def _traced(
    model: nn.Module, modules: dict[str, nn.Module], batch: tuple[Tensor, Tensor], repeats: int
) -> tuple[list[TraceItem], list[TraceItem], dict[str, int]]:
    """One pass's items and factor rows; with ``repeats`` > 0 (a real device) the median
    times of that many timed passes after a warm-up, scaled to the untraced pass."""
    inputs, targets = batch
    timed = inputs.device.type != "meta" and repeats > 0
    first = one_pass(model, modules, inputs, targets, timed=timed)
    if not timed:
        return first
    passes = [one_pass(model, modules, inputs, targets, timed=True) for _ in range(repeats)]
    forward = median_times([run[0] for run in passes])
    backward = median_times([run[1] for run in passes])
    forward, backward = normalised(
        forward, backward, plain_seconds(model, inputs, targets, repeats)
    )
    return forward, backward, passes[0][2]


def trace_workload(
    model: nn.Module | Callable[[], nn.Module],
    input_shape: Sequence[int],
    *,
    batch_size: int,
    name: str = "model",
    device: torch.device | str = "meta",
    repeats: int = 0,
    vocab_size: int | None = None,
    config: KFACConfig | None = None,
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
        config: The run's options (default ``KFACConfig()``): which blocks discovery
            registers (``skip_layers``, factor options) and their inverse form
            (``inverse_method``, ``inverse_dtype``).

    Raises:
        ValueError: A bad size, or a model without K-FAC layers.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not input_shape or any(size < 1 for size in input_shape):
        raise ValueError(f"input_shape must be positive sizes, got {tuple(input_shape)}")
    config = KFACConfig() if config is None else config
    device = torch.device(device)
    built = _built(model, device)
    registered = _registered(built, config)
    by_name = dict(built.named_modules())
    modules = {layer_name: by_name[layer_name] for layer_name in registered.blocks}
    batch = _batch(tuple(input_shape), batch_size, device, vocab_size)
    forward, backward, rows = _traced(built, modules, batch, repeats)
    order = list(dict.fromkeys(i.layer for i in forward if isinstance(i, FactorHook)))
    blocks = registered.blocks
    layers = tuple(
        LayerSpec(
            layer, _kind(blocks[layer]), blocks[layer].a_dim, blocks[layer].g_dim, rows[layer]
        )
        for layer in order
    )
    return Workload(
        model=name,
        batch_size=batch_size,
        input_shape=tuple(input_shape),
        layers=layers,
        forward=tuple(forward),
        backward=tuple(backward),
        parameters=tuple(
            (param_name, parameter.numel())
            for param_name, parameter in built.named_parameters()
            if parameter.requires_grad
        ),
        buffer_bytes=sum(b.numel() * b.element_size() for b in built.buffers()),
        form=config.inverse_form,
        factors=tuple(spec for spec in registered.factors if spec.layer in set(order)),
        unmodelled=registered.unmodelled,
    )
