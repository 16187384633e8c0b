"""Hooks that hand each registered layer's input, and later its output gradient, to sinks."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["ActivationCapture"]

InputSink = Callable[[str, nn.Module, Tensor], None]
GradSink = Callable[[str, nn.Module, Tensor, Tensor], None]
_Hook = TypeVar("_Hook", bound=Callable[..., None])


def _layer_input(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Tensor | None:
    """The layer's input, passed positionally or as ``input=`` (the name torch's layers use)."""
    value = args[0] if args else kwargs.get("input")
    return value if isinstance(value, Tensor) else None


def _eager(hook: _Hook) -> _Hook:
    """``hook`` run as plain Python under ``torch.compile``: Dynamo calls it between graphs
    instead of tracing it, so the capture's changing state (call counts, which layers
    were seen) never becomes a guard that recompiles the model at every step."""
    return cast(_Hook, torch.compiler.disable(hook))


def _in_backward() -> bool:
    """Whether autograd is running a backward pass (a checkpointed region recomputes then)."""
    return bool(torch._C._current_graph_task_id() != -1)


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
        # Captured calls whose output gradient has not arrived yet, per module.
        self._waiting: dict[str, int] = {}
        for name, module in modules.items():
            self._handles.append(
                module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True)
            )
            self._handles.append(
                module.register_forward_hook(self._post_hook(name), with_kwargs=True)
            )

    def _pre_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if not (module.training and torch.is_grad_enabled()):
                return
            layer_input = _layer_input(args, kwargs)
            if layer_input is None or layer_input.numel() == 0 or not self._enabled():
                return  # an empty batch contributes nothing (weight 0 in the exchange)
            if _in_backward() and self._waiting.get(name, 0) > 0:
                return  # a non-reentrant checkpoint's recomputation
            inputs = layer_input.detach()
            self._active.setdefault(name, []).append(inputs)
            self._on_input(name, module, inputs)

        return _eager(hook)

    def _post_hook(
        self, name: str
    ) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]:
        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> None:
            calls = self._active.get(name)
            if not calls:
                return
            inputs = calls.pop()
            if not isinstance(output, Tensor) or not output.requires_grad:
                return
            self._waiting[name] = self._waiting.get(name, 0) + 1

            def arrived(grad: Tensor) -> None:
                self._waiting[name] -= 1
                self._on_grad_output(name, module, inputs, grad)

            _on_output_grad(output, arrived)

        return _eager(hook)

    def forget(self) -> None:
        """Drop the bookkeeping of calls whose gradient never came (a forward without
        backward); called at every step."""
        self._active.clear()
        self._waiting.clear()

    def remove(self) -> None:
        """Remove every hook this object installed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._active.clear()
        self._waiting.clear()
