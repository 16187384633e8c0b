"""BatchNorm curvature state: captured blocks, one all-reduce, replicated closed-form inverses.

The per-channel blocks of :mod:`spdkfac.layers.batchnorm` are tiny (3 numbers per channel),
so they take none of the factor machinery: no fusion bucket, no placement, no broadcast.
On a factor step every rank adds its example-weighted blocks of all BatchNorm layers into
one buffer and issues **one** extra all-reduce (sum) after the Kronecker-factor exchange,
in a fixed layer order, so the collectives never depend on local data. Every rank then
holds the global example-weighted average (the same as one process on the concatenated
batch), folds it into the running average, and inverts every block itself: a closed-form
2×2 inverse per channel costs less than any message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from spdkfac.comm import Communicator
from spdkfac.curvature import FactorAccumulator, running_average
from spdkfac.layers.batchnorm import (
    batchnorm_fisher,
    batchnorm_gradient,
    normalized_input,
    precondition_units,
    unit_inverses,
    write_batchnorm_gradient,
)
from spdkfac.linalg import is_finite

__all__ = ["BatchNormCurvature", "BatchNormState"]


@dataclass
class BatchNormState:
    """What is kept for one BatchNorm layer: ``[C, 3]`` block entries and their inverses."""

    name: str
    module: nn.Module
    pending: FactorAccumulator = field(default_factory=FactorAccumulator)
    fisher: Tensor | None = None
    inverse: Tensor | None = None

    @property
    def channels(self) -> int:
        """Number of channels C."""
        weight = self.module.weight
        assert isinstance(weight, Tensor)
        return weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """Blocks are kept in at least float32 whatever the parameter dtype."""
        weight = self.module.weight
        assert isinstance(weight, Tensor)
        return torch.float64 if weight.dtype == torch.float64 else torch.float32


class BatchNormCurvature:
    """The unit-wise (or diagonal) Fisher of the BatchNorm layers of a model.

    Args:
        modules: BatchNorm layers by name, in a fixed order (the same on every rank).
        mode: ``"diagonal"`` or ``"unit-wise"`` (see :mod:`spdkfac.layers.batchnorm`).
    """

    def __init__(self, modules: Mapping[str, nn.Module], *, mode: str) -> None:
        self.mode = mode
        self._layers = {name: BatchNormState(name, module) for name, module in modules.items()}

    @property
    def names(self) -> list[str]:
        """Layer names, in exchange order."""
        return list(self._layers)

    @property
    def modules(self) -> dict[str, nn.Module]:
        """Name → module."""
        return {name: state.module for name, state in self._layers.items()}

    def describe(self) -> str:
        """A text equal on two ranks iff they hold the same layers (for the agreement check)."""
        return ";".join(f"{name}:bn{state.channels}" for name, state in self._layers.items())

    def blocks(self, name: str) -> tuple[Tensor | None, Tensor | None]:
        """The running-average ``[C, 3]`` blocks and their damped inverses (None before any)."""
        state = self._layers[name]
        return state.fisher, state.inverse

    # ------------------------------------------------------------------ factor steps
    def capture(
        self, name: str, module: nn.Module, inputs: Tensor, grad_output: Tensor, scale: float
    ) -> None:
        """Add one forward/backward call's blocks; ``scale`` corrects the loss scaling of g²."""
        state = self._layers[name]
        normalized = normalized_input(inputs.to(state.dtype), float(getattr(module, "eps", 1e-5)))
        blocks = batchnorm_fisher(
            normalized, grad_output.to(state.dtype), diagonal=self.mode == "diagonal"
        )
        if scale != 1.0:
            blocks.mul_(scale)
        state.pending.add(blocks, grad_output.shape[0])

    def pending_finite(self) -> bool:
        """Whether every block captured this step is finite."""
        return all(
            is_finite(state.pending.total)
            for state in self._layers.values()
            if state.pending.total is not None
        )

    def reduce_pending(self, communicator: Communicator) -> dict[str, Tensor | None]:
        """This step's blocks averaged over all ranks, weighted by examples; clears them.

        Collective with more than one rank: one all-reduce of every layer's weighted blocks
        and weights, issued on every factor step whatever was captured.
        """
        if not self._layers:
            return {}
        if communicator.world_size == 1:
            means = {name: state.pending.mean() for name, state in self._layers.items()}
            self.clear_pending()
            return {name: None if mean is None else mean.clone() for name, mean in means.items()}
        wide = any(state.dtype == torch.float64 for state in self._layers.values())
        dtype = torch.float64 if wide else torch.float32
        parts: list[Tensor] = []
        weights: list[float] = []
        for state in self._layers.values():
            total = state.pending.total
            parts.append(
                torch.zeros(3 * state.channels, dtype=dtype, device=communicator.device)
                if total is None
                else total.reshape(-1).to(device=communicator.device, dtype=dtype)
            )
            weights.append(float(state.pending.weight))
        buffer = torch.cat([*parts, torch.tensor(weights, dtype=dtype, device=parts[0].device)])
        self.clear_pending()
        reduced = communicator.all_reduce_sum(buffer).wait()
        totals = reduced[: -len(weights)].split([3 * s.channels for s in self._layers.values()])
        result: dict[str, Tensor | None] = {}
        for (name, state), total, weight in zip(
            self._layers.items(), totals, reduced[-len(weights) :].tolist(), strict=True
        ):
            result[name] = (
                None if weight <= 0 else (total / weight).reshape(state.channels, 3).to(state.dtype)
            )
        return result

    def absorb(self, blocks: Mapping[str, Tensor | None], decay: float) -> None:
        """Fold a step's global blocks into the running averages (``ξ`` = ``decay``)."""
        for name, state in self._layers.items():
            new = blocks.get(name)
            if new is not None:
                weight = state.module.weight
                assert isinstance(weight, Tensor)
                state.fisher = running_average(state.fisher, new.to(weight.device), decay)

    def clear_pending(self) -> None:
        """Drop blocks captured since the last factor update."""
        for state in self._layers.values():
            state.pending.clear()

    # ------------------------------------------------------------------ inverse and step
    def update_inverses(self, damping: float) -> None:
        """``(F_c + λI)⁻¹`` of every block, on every rank; a non-finite one keeps the last."""
        for state in self._layers.values():
            if state.fisher is None:
                continue
            inverse = unit_inverses(state.fisher, damping)
            if is_finite(inverse):
                state.inverse = inverse

    def gradients(self) -> dict[str, Tensor]:
        """``[C, 2]`` gradient matrices ``[∇γ, ∇β]`` of the layers that have a gradient."""
        return {
            name: grad
            for name, state in self._layers.items()
            if (grad := batchnorm_gradient(state.module)) is not None
        }

    def precondition(self, gradients: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Each channel's block inverse applied to its gradient (plain where no inverse yet)."""
        result = {}
        for name, grad in gradients.items():
            inverse = self._layers[name].inverse
            result[name] = grad.clone() if inverse is None else precondition_units(grad, inverse)
        return result

    def set_gradient(self, name: str, matrix: Tensor) -> None:
        """Write a preconditioned ``[C, 2]`` matrix back into the layer's parameters."""
        write_batchnorm_gradient(self._layers[name].module, matrix)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The mode and copies of every layer's blocks and inverses."""
        return {
            "mode": self.mode,
            "layers": {
                name: {
                    "fisher": None if state.fisher is None else state.fisher.detach().clone(),
                    "inverse": None if state.inverse is None else state.inverse.detach().clone(),
                }
                for name, state in self._layers.items()
            },
        }

    def check_state(self, saved: Mapping[str, Any]) -> dict[str, dict[str, Tensor | None]]:
        """Validate :meth:`state_dict`'s output; returns what :meth:`restore` writes.

        Raises:
            ValueError: When the mode, the layer names or a tensor's shape differ.
        """
        if saved.get("mode") != self.mode:
            raise ValueError(
                f"state_dict BatchNorm curvature mode {saved.get('mode')!r} is not {self.mode!r}"
            )
        layers = saved.get("layers", {})
        if set(layers) != set(self._layers):
            missing = sorted(set(self._layers) - set(layers))
            extra = sorted(set(layers) - set(self._layers))
            raise ValueError(
                f"state_dict BatchNorm layers differ from the registered ones: missing "
                f"{missing}, unexpected {extra}"
            )
        restored: dict[str, dict[str, Tensor | None]] = {}
        for name, state in self._layers.items():
            weight = state.module.weight
            assert isinstance(weight, Tensor)
            entry: dict[str, Tensor | None] = {}
            for key in ("fisher", "inverse"):
                value = layers[name][key]
                if value is not None and tuple(value.shape) != (state.channels, 3):
                    raise ValueError(
                        f"state_dict BatchNorm {key} of layer {name!r} has shape "
                        f"{tuple(value.shape)}, expected {(state.channels, 3)}"
                    )
                entry[key] = None if value is None else value.to(weight.device).clone()
            restored[name] = entry
        return restored

    def restore(self, restored: Mapping[str, Mapping[str, Tensor | None]]) -> None:
        """Write what :meth:`check_state` validated; clears pending blocks."""
        for name, entry in restored.items():
            state = self._layers[name]
            state.fisher, state.inverse = entry["fisher"], entry["inverse"]
        self.clear_pending()
