"""Hooks that hand each registered layer's input and output gradient to a sink."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ActivationCapture"]

InputSink = Callable[[str, nn.Module, Tensor], None]
GradSink = Callable[[str, nn.Module, Tensor], None]


class ActivationCapture:
    """Installs forward and output-gradient hooks on named modules.

    A forward call is captured only when the module is in training mode, autograd is
    enabled, and ``enabled()`` returns True; other forwards (evaluation, ``no_grad``,
    steps without a factor update) cost one Python call and touch nothing. The layer input
    goes to ``on_input`` from the forward pre-hook, before the layer runs; the gradient of
    the loss with respect to the layer output goes to ``on_grad_output`` from a hook on the
    output tensor (which, unlike a module backward hook, tolerates in-place ops after the
    layer such as ``ReLU(inplace=True)``).

    Args:
        modules: Name → module to capture.
        on_input: Called as ``on_input(name, module, input)``.
        on_grad_output: Called as ``on_grad_output(name, module, grad_output)``.
        enabled: Called once per forward to decide whether to capture it.
    """

    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        *,
        on_input: InputSink,
        on_grad_output: GradSink,
        enabled: Callable[[], bool],
    ) -> None:
        self._on_input = on_input
        self._on_grad_output = on_grad_output
        self._enabled = enabled
        self._handles: list[RemovableHandle] = []
        # Modules whose current forward call is being captured (pre-hook → forward hook).
        self._active: set[str] = set()
        for name, module in modules.items():
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
            self._handles.append(module.register_forward_hook(self._post_hook(name)))

    def _pre_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not (module.training and torch.is_grad_enabled() and self._enabled()):
                return
            if not args or not isinstance(args[0], Tensor):
                return
            self._active.add(name)
            self._on_input(name, module, args[0].detach())

        return hook

    def _post_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if name not in self._active:
                return
            self._active.discard(name)
            if not isinstance(output, Tensor) or not output.requires_grad:
                return

            def grad_hook(grad: Tensor) -> None:
                self._on_grad_output(name, module, grad.detach())

            output.register_hook(grad_hook)

        return hook

    def remove(self) -> None:
        """Remove every hook this object installed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._active.clear()
