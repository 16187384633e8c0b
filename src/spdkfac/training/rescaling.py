"""Osawa et al.'s weight rescaling, applied after each optimizer update."""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["rescale_weights_"]

_NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.GroupNorm,
    nn.LayerNorm,
)


def rescale_weights_(
    model: nn.Module,
    *,
    layer_types: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d),
) -> int:
    """Osawa et al.'s weight rescaling (``NormalizeWeightUR``), applied after an update.

    For each weight ``W`` of a module of ``layer_types``, ``s = √(2·d_out)/(‖W‖_F + ε)``
    with ``d_out`` the output features or channels and ``ε = 1e-9`` (from the paper), and
    ``W ← s·W`` **only if** ``s < 1``: norms are capped, never raised. Biases and
    normalization layers are left alone. Each distinct weight tensor is visited once.

    Args:
        model: Module whose submodules are rescaled in place.
        layer_types: Module types to rescale; normalization layers are refused.

    Returns:
        How many weights were rescaled.

    Raises:
        ValueError: If ``layer_types`` is empty, holds a non-module type or a
            normalization layer type.
    """
    if not isinstance(layer_types, tuple) or not layer_types:
        raise ValueError(f"layer_types must be a non-empty tuple of types, got {layer_types!r}")
    for kind in layer_types:
        if not (isinstance(kind, type) and issubclass(kind, nn.Module)):
            raise ValueError(f"layer_types entries must be nn.Module types, got {kind!r}")
        if issubclass(kind, _NORM_LAYERS):
            raise ValueError(f"layer_types must not hold normalization layers, got {kind!r}")
    seen: set[int] = set()
    flags: list[torch.Tensor] = []
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, layer_types) or not isinstance(weight, torch.Tensor):
                continue
            if id(weight) in seen:
                continue
            seen.add(id(weight))
            d_out = getattr(module, "out_features", getattr(module, "out_channels", None))
            if not isinstance(d_out, int):
                d_out = weight.shape[0]
            norm_dtype = torch.promote_types(weight.dtype, torch.float32)
            norm = torch.linalg.vector_norm(weight, dtype=norm_dtype)
            scale = math.sqrt(2.0 * d_out) / (norm + 1e-9)
            # Multiplying by exactly 1 when s >= 1 keeps W bit-for-bit and avoids a
            # device sync per layer; the flags are read once at the end.
            weight.mul_(scale.clamp(max=1.0).to(weight.dtype))
            flags.append(scale < 1.0)
    return sum(int(flag) for flag in flags)
