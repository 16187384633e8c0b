"""Hooks that hand each registered layer's input, and later its output gradient, to sinks."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ActivationCapture"]

InputSink = Callable[[str, nn.Module, Tensor], None]
GradSink = Callable[[str, nn.Module, Tensor, Tensor], None]


def _captures(module: nn.Module, args: tuple[Any, ...], enabled: Callable[[], bool]) -> bool:
    """Whether this forward call is captured: training, autograd on, enabled, a tensor input."""
    if not (module.training and torch.is_grad_enabled() and enabled()):
        return False
    return bool(args) and isinstance(args[0], Tensor)


def _on_output_grad(output: Any, sink: Callable[[Tensor], None]) -> None:
    """Call ``sink(grad)`` with the detached gradient of ``output`` during backward."""
    if not isinstance(output, Tensor) or not output.requires_grad:
        return

    def grad_hook(grad: Tensor) -> None:
        sink(grad.detach())

    output.register_hook(grad_hook)


class ActivationCapture:
    """Installs forward and output-gradient hooks on named modules.

    A forward call is captured only when the module is in training mode, autograd is
    enabled, and ``enabled()`` returns True; other forwards (evaluation, ``no_grad``,
    steps without a factor update) cost one Python call and touch nothing. The layer input
    goes to ``on_input`` from the forward pre-hook, before the layer runs; the gradient of
    the loss with respect to the layer output goes to ``on_grad_output`` from a hook on the
    output tensor (which, unlike a module backward hook, tolerates in-place ops after the
    layer such as ``ReLU(inplace=True)``), together with that call's input: a layer used
    several times before one backward (or gradient accumulation) pairs every gradient
    with its own input. Holding the detached input costs no memory: autograd keeps it for
    the layer's backward anyway.

    Args:
        modules: Name → module to capture.
        on_input: Called as ``on_input(name, module, input)``.
        on_grad_output: Called as ``on_grad_output(name, module, input, grad_output)``.
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
        # Inputs of the forward calls being captured (pre-hook → forward hook), per module.
        self._active: dict[str, list[Tensor]] = {}
        for name, module in modules.items():
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
            self._handles.append(module.register_forward_hook(self._post_hook(name)))

    def _pre_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            if not _captures(module, args, self._enabled):
                return
            inputs = args[0].detach()
            self._active.setdefault(name, []).append(inputs)
            self._on_input(name, module, inputs)

        return hook

    def _post_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            calls = self._active.get(name)
            if not calls:
                return
            inputs = calls.pop()
            _on_output_grad(output, lambda grad: self._on_grad_output(name, module, inputs, grad))

        return hook

    def remove(self) -> None:
        """Remove every hook this object installed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._active.clear()
