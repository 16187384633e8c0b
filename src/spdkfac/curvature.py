"""Per-layer curvature state: captured contributions, running-average factors, inverses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from spdkfac.layers import KFACLayer

__all__ = [
    "FactorAccumulator",
    "LayerState",
    "layer_states_to_dict",
    "load_layer_states",
    "running_average",
]


@dataclass
class FactorAccumulator:
    """Weighted mean of the factor contributions captured during one step.

    Several forward/backward calls before one ``step()`` (gradient accumulation, a layer
    used twice) each add their factor, weighted by the number of examples it averages.
    """

    total: Tensor | None = None
    weight: int = 0
    calls: int = 0

    def add(self, factor: Tensor, weight: int) -> None:
        """Add one call's factor, which averages ``weight`` examples."""
        if self.total is None:
            self.total = factor if weight == 1 else factor.mul(weight)
        else:
            self.total.add_(factor, alpha=weight)
        self.weight += weight
        self.calls += 1

    def mean(self) -> Tensor | None:
        """The weighted mean of what was added, or None when nothing was."""
        if self.total is None:
            return None
        return self.total if self.weight == 1 else self.total.div(self.weight)

    def clear(self) -> None:
        """Forget every contribution."""
        self.total = None
        self.weight = 0
        self.calls = 0


def running_average(current: Tensor | None, new: Tensor, decay: float) -> Tensor:
    """``ξ·current + (1−ξ)·new``; the first update (``current is None``) sets the factor."""
    if current is None:
        return new.clone()
    if decay == 1.0:
        return current
    return current.mul_(decay).add_(new, alpha=1.0 - decay)


@dataclass
class LayerState:
    """Everything K-FAC keeps for one registered layer."""

    name: str
    module: nn.Module
    adapter: KFACLayer
    a_pending: FactorAccumulator = field(default_factory=FactorAccumulator)
    g_pending: FactorAccumulator = field(default_factory=FactorAccumulator)
    a_factor: Tensor | None = None
    g_factor: Tensor | None = None
    a_inverse: Tensor | None = None
    g_inverse: Tensor | None = None

    @property
    def a_dim(self) -> int:
        """Side of the A factor."""
        return self.adapter.a_dim(self.module)

    @property
    def g_dim(self) -> int:
        """Side of the G factor."""
        return self.adapter.g_dim(self.module)

    @property
    def factor_dtype(self) -> torch.dtype:
        """Factors are kept in at least float32 whatever the parameter dtype."""
        weight = self.module.weight
        assert isinstance(weight, Tensor)
        return torch.float64 if weight.dtype == torch.float64 else torch.float32

    def clear_pending(self) -> None:
        """Drop contributions captured since the last factor update."""
        self.a_pending.clear()
        self.g_pending.clear()


_STATE_KEYS = ("a_factor", "g_factor", "a_inverse", "g_inverse")


def layer_states_to_dict(layers: Mapping[str, LayerState]) -> dict[str, dict[str, Tensor | None]]:
    """Copies of every layer's factors and inverses, keyed by layer name."""
    return {
        name: {
            key: None if (value := getattr(state, key)) is None else value.detach().clone()
            for key in _STATE_KEYS
        }
        for name, state in layers.items()
    }


def load_layer_states(
    layers: Mapping[str, LayerState], saved: Mapping[str, Mapping[str, Tensor | None]]
) -> None:
    """Restore :func:`layer_states_to_dict`'s output; validates everything before writing.

    Raises:
        ValueError: When the layer names or a tensor's shape differ.
    """
    if set(saved) != set(layers):
        missing = sorted(set(layers) - set(saved))
        extra = sorted(set(saved) - set(layers))
        raise ValueError(
            f"state_dict layers differ from the registered ones: missing {missing}, "
            f"unexpected {extra}"
        )
    restored: dict[str, dict[str, Tensor | None]] = {}
    for name, state in layers.items():
        weight = state.module.weight
        assert isinstance(weight, Tensor)
        entry: dict[str, Tensor | None] = {}
        for key in _STATE_KEYS:
            value = saved[name][key]
            dim = state.a_dim if key.startswith("a_") else state.g_dim
            if value is not None and tuple(value.shape) != (dim, dim):
                raise ValueError(
                    f"state_dict {key} of layer {name!r} has shape {tuple(value.shape)}, "
                    f"expected {(dim, dim)}"
                )
            entry[key] = None if value is None else value.to(weight.device).clone()
        restored[name] = entry
    for name, entry in restored.items():
        for key, value in entry.items():
            setattr(layers[name], key, value)
        layers[name].clear_pending()
