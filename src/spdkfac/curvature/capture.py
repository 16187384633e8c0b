"""Hooks that hand each registered layer's input, and later its output gradient, to sinks."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from spdkfac.comm.dtensors import full_value

__all__ = ["ActivationCapture"]

InputSink = Callable[[str, nn.Module, Tensor], None]
GradSink = Callable[[str, nn.Module, Tensor, Tensor], None]
_Hook = TypeVar("_Hook", bound=Callable[..., None])


def _layer_input(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Tensor | None:
    """The layer's input, passed positionally or as ``input=`` (the name torch's layers use)."""
    value = args[0] if args else kwargs.get("input")
    return value if isinstance(value, Tensor) else None


#: Input dims at which torch reads a layer's input as one example without a batch dim.
_UNBATCHED_DIMS: tuple[tuple[type[nn.Module], int], ...] = (
    (nn.Embedding, 0),
    (nn.Linear, 1),
    (nn.Conv1d, 2),
    (nn.Conv2d, 3),
)


def _unbatched_dim(module: nn.Module) -> int | None:
    """The input dim at which ``module`` takes an unbatched input (a 0-d index, a
    ``[C, H, W]`` image...), captured as a batch of one; None: always batched."""
    for kind, dim in _UNBATCHED_DIMS:
        if isinstance(module, kind):
            return dim
    shape = getattr(module, "normalized_shape", None)  # LayerNorm, RMSNorm
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and shape is not None:
        return len(shape)
    return None


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
        sink(full_value(grad.detach()))

    output.register_hook(grad_hook)


class ActivationCapture:
    """Installs forward and output-gradient hooks on named modules.

    A forward call is captured only when the module is in training mode, autograd is
    enabled, and ``enabled()`` returns True; other forwards (evaluation, ``no_grad``,
    steps without a factor update) cost two Python calls and touch nothing. The layer input
    goes to ``on_input`` from the forward pre-hook, before the layer runs (for a forward
    that autograd runs during backward, a checkpointed region's recomputation: when its
    output gradient arrives, or never if none does); the gradient of
    the loss with respect to the layer output goes to ``on_grad_output`` from a hook on the
    output tensor (which, unlike a module backward hook, tolerates in-place ops after the
    layer such as ``ReLU(inplace=True)``), together with that call's input: a layer used
    several times before one backward (or gradient accumulation) pairs every gradient
    with its own input. Holding the detached input costs no memory: autograd keeps it for
    the layer's backward anyway. A DTensor input or output gradient (a tensor-parallel
    layer's) is captured whole: a collective over its mesh, issued by every rank of it in
    the same order (the decision to capture is replicated).

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
        # Per module, the forward calls between pre-hook and forward hook: the captured
        # input, whether the call runs inside backward (counted at its gradient), and
        # whether it was unbatched (captured as a batch of one).
        self._active: dict[str, list[tuple[Tensor, bool, bool] | None]] = {}
        self._unbatched = {name: _unbatched_dim(module) for name, module in modules.items()}
        for name, module in modules.items():
            self._handles.append(
                module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True)
            )
            # Prepended: the layer's own output, before another forward hook replaces it
            # (tensor parallelism's turns a sharded DTensor output into a local tensor).
            self._handles.append(
                module.register_forward_hook(self._post_hook(name), with_kwargs=True, prepend=True)
            )

    def _pre_hook(self, name: str) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            # One entry per forward call, captured or not (None), so that the forward hook
            # pairs with its own call even after a recomputation that stopped early (a
            # non-reentrant checkpoint's) left one behind, until the step forgets it. A
            # call in backward that is not captured adds nothing: it would stay behind
            # on steps without a factor update.
            calls = self._active.setdefault(name, [])
            if not (module.training and torch.is_grad_enabled()):
                if not _in_backward():
                    calls.append(None)
                return
            layer_input = _layer_input(args, kwargs)
            if layer_input is None or layer_input.numel() == 0 or not self._enabled():
                if not _in_backward():
                    calls.append(None)  # an empty batch contributes nothing (weight 0)
                return
            inputs = full_value(layer_input.detach())
            unbatched = inputs.dim() == self._unbatched[name]
            if unbatched:
                inputs = inputs.unsqueeze(0)
            # A forward run by autograd during backward is a checkpointed region's
            # recomputation: a reentrant one (its first forward ran without grad) is the
            # call's only capture, a non-reentrant one repeats a call captured already.
            # Only the first kind's outputs receive gradients, so such a call counts, A
            # and G together, when its output gradient arrives; the other never counts.
            deferred = _in_backward()
            calls.append((inputs, deferred, unbatched))
            if not deferred:
                self._on_input(name, module, inputs)

        return _eager(hook)

    def _post_hook(
        self, name: str
    ) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]:
        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> None:
            calls = self._active.get(name)
            call = calls.pop() if calls else None
            if call is None or not isinstance(output, Tensor) or not output.requires_grad:
                return
            inputs, deferred, unbatched = call

            def arrived(grad: Tensor) -> None:
                if deferred:
                    self._on_input(name, module, inputs)
                self._on_grad_output(name, module, inputs, grad[None] if unbatched else grad)

            _on_output_grad(output, arrived)

        return _eager(hook)

    def forget(self) -> None:
        """Drop the bookkeeping of calls whose gradient never came (a forward without
        backward, a recomputation that stopped early); called at every factor step."""
        self._active.clear()

    def remove(self) -> None:
        """Remove every hook this object installed."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._active.clear()
