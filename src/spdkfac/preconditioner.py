"""``KFACPreconditioner``: wires capture, curvature, inverses and preconditioning into a step."""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from spdkfac.capture import ActivationCapture
from spdkfac.config import FloatSchedule, IntSchedule, KFACConfig, SkipEntry
from spdkfac.curvature import LayerState, running_average
from spdkfac.layers import lookup, precondition
from spdkfac.linalg import InverseMethod, damped_inverse

__all__ = ["KFACPreconditioner"]

_STATE_FORMAT = 1


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a ``DistributedDataParallel`` (or similar) wrapper."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        inner = model.module
        assert isinstance(inner, nn.Module)
        return inner
    return model


def _is_skipped(name: str, module: nn.Module, skip: Iterable[SkipEntry]) -> bool:
    for entry in skip:
        if isinstance(entry, str):
            if name == entry or name.startswith(entry + "."):
                return True
        elif isinstance(module, entry):
            return True
    return False


def _discover_layers(model: nn.Module, skip: tuple[SkipEntry, ...]) -> dict[str, LayerState]:
    """Registered layers in ``named_modules`` order; warns once about unsupported ones."""
    layers: dict[str, LayerState] = {}
    unsupported: Counter[str] = Counter()
    matched: set[str] = set()
    for name, module in model.named_modules():
        for entry in skip:
            if isinstance(entry, str) and (name == entry or name.startswith(entry + ".")):
                matched.add(entry)
        if _is_skipped(name, module, skip):
            continue
        adapter = lookup(module)
        if adapter is not None:
            weight = getattr(module, "weight", None)
            if isinstance(weight, Tensor) and weight.requires_grad:
                layers[name] = LayerState(name=name, module=module, adapter=adapter)
            continue
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            unsupported[type(module).__name__] += 1
    for entry in skip:
        if isinstance(entry, str) and entry not in matched:
            raise ValueError(f"skip_layers entry {entry!r} matches no module of the model")
    if not layers:
        raise ValueError(
            "model has no layer K-FAC supports (nn.Linear, nn.Conv2d with groups=1) "
            "outside skip_layers"
        )
    if unsupported:
        listed = ", ".join(f"{kind} ({count})" for kind, count in sorted(unsupported.items()))
        warnings.warn(
            f"spdkfac: these layers are not preconditioned and keep their plain gradient: {listed}",
            UserWarning,
            stacklevel=3,
        )
    return layers


class KFACPreconditioner:
    """K-FAC preconditioner for the Linear and Conv2d layers of a model.

    Call :meth:`step` after ``loss.backward()`` and before ``optimizer.step()``: it replaces
    each registered layer's weight and bias gradient by the preconditioned gradient
    ``V = (G + γI)⁻¹ ∇ (A + γI)⁻¹`` (scaled by the KL clip) and advances its step counter.
    Works with any ``torch.optim`` optimizer. Conventions are those of ``DESIGN.md``.

    Args:
        model: The model, plain or wrapped in ``DistributedDataParallel``.
        damping: γ, a float > 0 or a callable of the step.
        factor_decay: ξ of the running average, in (0, 1].
        factor_update_steps: Factor refresh interval (int >= 1 or callable of the step).
        inv_update_steps: Inverse refresh interval (int >= 1 or callable of the step).
        kl_clip: κ of the KL clip, or None to disable it.
        lr: Learning rate used by the KL clip (float or callable of the step).
        inverse_method: ``"cholesky"`` or ``"eigen"``.
        skip_layers: Module names or ``nn.Module`` types to leave alone.

    Raises:
        ValueError: On an invalid option (naming it and its value) or a model without any
            supported layer.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        damping: FloatSchedule = 0.003,
        factor_decay: float = 0.95,
        factor_update_steps: IntSchedule = 1,
        inv_update_steps: IntSchedule = 1,
        kl_clip: float | None = 0.001,
        lr: FloatSchedule = 0.1,
        inverse_method: InverseMethod = "cholesky",
        skip_layers: Iterable[SkipEntry] = (),
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if isinstance(skip_layers, (str, type)):
            raise ValueError(f"skip_layers must be a sequence, got {skip_layers!r}")
        self.config = KFACConfig(
            damping=damping,
            factor_decay=factor_decay,
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            kl_clip=kl_clip,
            lr=lr,
            inverse_method=inverse_method,
            skip_layers=tuple(skip_layers),
        )
        self._model = _unwrap(model)
        self._layers = _discover_layers(self._model, self.config.skip_layers)
        self._forward_order: list[str] = []
        self._step = 0
        self._skipped_steps = 0
        self._capture = ActivationCapture(
            {name: state.module for name, state in self._layers.items()},
            on_input=self._capture_input,
            on_grad_output=self._capture_grad_output,
            enabled=self._capturing,
        )

    # ------------------------------------------------------------------ introspection
    @property
    def layers(self) -> list[str]:
        """Registered module names in forward order (definition order until first seen)."""
        seen = set(self._forward_order)
        return self._forward_order + [name for name in self._layers if name not in seen]

    @property
    def steps(self) -> int:
        """Number of completed :meth:`step` calls (including skipped ones)."""
        return self._step

    @property
    def skipped_steps(self) -> int:
        """Number of :meth:`step` calls that skipped the update on non-finite values."""
        return self._skipped_steps

    def factors(self, name: str) -> tuple[Tensor | None, Tensor | None]:
        """The running-average (A, G) of a registered layer (None before the first update)."""
        state = self._layers[name]
        return state.a_factor, state.g_factor

    def inverses(self, name: str) -> tuple[Tensor | None, Tensor | None]:
        """The damped inverses (Â, Ĝ) of a registered layer (None before the first one)."""
        state = self._layers[name]
        return state.a_inverse, state.g_inverse

    # ------------------------------------------------------------------ capture sinks
    def _capturing(self) -> bool:
        return self.config.is_factor_step(self._step)

    def _capture_input(self, name: str, module: nn.Module, inputs: Tensor) -> None:
        state = self._layers[name]
        if name not in self._forward_order:
            self._forward_order.append(name)
        factor, weight = state.adapter.a_factor(module, inputs.to(state.factor_dtype))
        state.a_pending.add(factor, weight)

    def _capture_grad_output(self, name: str, module: nn.Module, grad: Tensor) -> None:
        state = self._layers[name]
        factor, weight = state.adapter.g_factor(module, grad.to(state.factor_dtype))
        state.g_pending.add(factor, weight)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> bool:
        """Precondition the registered gradients in place and advance the step counter.

        Returns:
            True when the update was applied. False when it was skipped because a gradient,
            a factor or the KL-clip sum was non-finite: gradients are then left as they
            were, no factor absorbs the step, and the caller should skip
            ``optimizer.step()``.
        """
        step = self._step
        self._step += 1
        gradients = {
            name: grad
            for name, state in self._layers.items()
            if (grad := state.adapter.gradient(state.module)) is not None
        }
        if not self._all_finite(gradients.values()):
            return self._skip()
        if self.config.is_factor_step(step):
            if not self._pending_finite():
                return self._skip()
            self._update_factors()
        if self.config.is_inverse_step(step):
            self._update_inverses(self.config.damping_at(step))
        preconditioned = {
            name: precondition(grad, state.a_inverse, state.g_inverse)
            if (state := self._layers[name]).a_inverse is not None and state.g_inverse is not None
            else grad
            for name, grad in gradients.items()
        }
        scale = self._kl_clip_scale(gradients, preconditioned, step)
        if scale is None:
            return self._skip(clear_pending=False)
        for name, matrix in preconditioned.items():
            state = self._layers[name]
            state.adapter.set_gradient(state.module, matrix.mul_(scale) if scale != 1.0 else matrix)
        return True

    def _skip(self, *, clear_pending: bool = True) -> bool:
        if clear_pending:
            for state in self._layers.values():
                state.clear_pending()
        self._skipped_steps += 1
        return False

    @staticmethod
    def _all_finite(tensors: Iterable[Tensor]) -> bool:
        flags = [torch.isfinite(t).all() for t in tensors]
        return bool(torch.stack(flags).all()) if flags else True

    def _pending_finite(self) -> bool:
        pending = [
            total
            for state in self._layers.values()
            for total in (state.a_pending.total, state.g_pending.total)
            if total is not None
        ]
        return self._all_finite(pending)

    def _update_factors(self) -> None:
        decay = self.config.factor_decay
        for state in self._layers.values():
            a_new, g_new = state.a_pending.mean(), state.g_pending.mean()
            # A layer seen in forward but not in backward (or vice versa) this step keeps
            # both factors as they were, so A and G always describe the same examples.
            if a_new is not None and g_new is not None:
                state.a_factor = running_average(state.a_factor, a_new, decay)
                state.g_factor = running_average(state.g_factor, g_new, decay)
            state.clear_pending()

    def _update_inverses(self, damping: float) -> None:
        method: InverseMethod = "eigen" if self.config.inverse_method == "eigen" else "cholesky"
        for state in self._layers.values():
            if state.a_factor is None or state.g_factor is None:
                continue
            state.a_inverse = damped_inverse(state.a_factor, damping, method)
            state.g_inverse = damped_inverse(state.g_factor, damping, method)

    def _kl_clip_scale(
        self, gradients: Mapping[str, Tensor], preconditioned: Mapping[str, Tensor], step: int
    ) -> float | None:
        """ν = min(1, sqrt(κ / |η² Σ⟨V, ∇⟩|)); None when the sum is not finite."""
        kl_clip = self.config.kl_clip
        if kl_clip is None or not preconditioned:
            return 1.0
        lr = self.config.lr_at(step)
        terms = [(preconditioned[name] * gradients[name]).sum() for name in preconditioned]
        total = float(torch.stack(terms).sum()) * lr * lr
        if not math.isfinite(total):
            return None
        if total == 0.0:
            return 1.0
        return min(1.0, math.sqrt(kl_clip / abs(total)))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Factors, inverses and counters, as a dict of copies (safe to ``torch.save``)."""

        def copy(tensor: Tensor | None) -> Tensor | None:
            return None if tensor is None else tensor.detach().clone()

        return {
            "format": _STATE_FORMAT,
            "steps": self._step,
            "skipped_steps": self._skipped_steps,
            "forward_order": list(self._forward_order),
            "layers": {
                name: {
                    "a_factor": copy(state.a_factor),
                    "g_factor": copy(state.g_factor),
                    "a_inverse": copy(state.a_inverse),
                    "g_inverse": copy(state.g_inverse),
                }
                for name, state in self._layers.items()
            },
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; the layers must match exactly.

        Raises:
            ValueError: When the format, the registered layers or a factor shape differ.
        """
        if state_dict.get("format") != _STATE_FORMAT:
            raise ValueError(
                f"state_dict format {state_dict.get('format')!r} is not {_STATE_FORMAT}"
            )
        saved = state_dict["layers"]
        if set(saved) != set(self._layers):
            missing = sorted(set(self._layers) - set(saved))
            extra = sorted(set(saved) - set(self._layers))
            raise ValueError(
                f"state_dict layers differ from the registered ones: missing {missing}, "
                f"unexpected {extra}"
            )
        restored: dict[str, dict[str, Tensor | None]] = {}
        for name, state in self._layers.items():
            weight = state.module.weight
            assert isinstance(weight, Tensor)
            entry: dict[str, Tensor | None] = {}
            for key in ("a_factor", "g_factor", "a_inverse", "g_inverse"):
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
            state = self._layers[name]
            state.a_factor, state.g_factor = entry["a_factor"], entry["g_factor"]
            state.a_inverse, state.g_inverse = entry["a_inverse"], entry["g_inverse"]
            state.clear_pending()
        self._step = int(state_dict["steps"])
        self._skipped_steps = int(state_dict.get("skipped_steps", 0))
        order = [name for name in state_dict.get("forward_order", []) if name in self._layers]
        self._forward_order = order

    def remove(self) -> None:
        """Remove every hook this preconditioner installed; the model is left as it was."""
        self._capture.remove()
        for state in self._layers.values():
            state.clear_pending()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layers={len(self._layers)}, steps={self._step}, "
            f"config={self.config})"
        )
