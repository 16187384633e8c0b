"""Per-layer-type K-FAC math and the registry that maps ``nn.Module`` types to it."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from spdkfac.layers.base import (
    LOCAL_GRADIENTS,
    GradientAccess,
    KFACLayer,
    LocalGradients,
    gradient_matrix,
    precondition,
    write_gradient_matrix,
)
from spdkfac.layers.conv1d import Conv1dLayer
from spdkfac.layers.conv2d import Conv2dLayer
from spdkfac.layers.embedding import EmbeddingLayer
from spdkfac.layers.linear import LinearLayer
from spdkfac.layers.options import FactorMethod, FactorOptions, SelectionPolicy
from spdkfac.layers.transposed_linear import TransposedLinearLayer, is_transposed_linear

__all__ = [
    "LOCAL_GRADIENTS",
    "Conv1dLayer",
    "Conv2dLayer",
    "EmbeddingLayer",
    "FactorMethod",
    "FactorOptions",
    "GradientAccess",
    "KFACLayer",
    "LinearLayer",
    "LocalGradients",
    "SelectionPolicy",
    "TransposedLinearLayer",
    "adapter_for_type",
    "gradient_matrix",
    "lookup",
    "precondition",
    "register_layer_type",
    "write_gradient_matrix",
]

_REGISTRY: dict[type[nn.Module], KFACLayer] = {}

#: Layers recognised by what they are rather than by a type spdkfac can import: (test,
#: adapter), tried in order after the registry (``transformers``' ``Conv1D``).
_RECOGNISED: list[tuple[Callable[[nn.Module], bool], KFACLayer]] = [
    (is_transposed_linear, TransposedLinearLayer()),
]


def register_layer_type(adapter: KFACLayer) -> None:
    """Register an adapter for the module types it lists in ``module_types``."""
    for module_type in adapter.module_types:
        _REGISTRY[module_type] = adapter


def adapter_for_type(module: nn.Module) -> KFACLayer | None:
    """The adapter registered for this module's type (or a base type whose ``forward`` it
    keeps), whatever its configuration."""
    adapter = _REGISTRY.get(type(module))
    if adapter is None:
        # A subclass inherits the math only when it keeps the registered type's forward.
        for base in type(module).__mro__[1:]:
            if base in _REGISTRY and type(module).forward is base.forward:
                return _REGISTRY[base]
        for recognises, candidate in _RECOGNISED:
            if recognises(module):
                return candidate
    return adapter


def lookup(module: nn.Module) -> KFACLayer | None:
    """The adapter for this module, or None when its type or configuration is unsupported."""
    adapter = adapter_for_type(module)
    if adapter is None or not adapter.supports(module):
        return None
    return adapter


register_layer_type(LinearLayer())
register_layer_type(Conv2dLayer())
register_layer_type(Conv1dLayer())
register_layer_type(EmbeddingLayer())
