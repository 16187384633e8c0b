"""Recording one training pass op by op (``__torch_dispatch__``), optionally timed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from spdkfac.sim.items import FactorHook, GradReady, Op, TraceItem

__all__ = ["median_times", "normalised", "one_pass", "plain_seconds"]

# Creation ops that only reserve memory; views are recognised from their schema.
_FREE_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
_WEIGHT_GEMMS = frozenset({"convolution", "_convolution", "convolution_backward"})


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _is_free(func: Any) -> bool:
    if func.overloadpacket.__name__ in _FREE_OPS:
        return True
    returns = func._schema.returns
    return bool(returns) and all(
        ret.alias_info is not None and not ret.alias_info.is_write for ret in returns
    )


def _gemm_side(name: str, args: Sequence[Any]) -> int:
    tensors = _tensors(list(args))
    if name in _WEIGHT_GEMMS and len(tensors) >= 2:
        weight = tensors[1] if name != "convolution_backward" else tensors[2]
        return int(min(weight.shape[0], weight.shape[1:].numel()))
    if name in ("mm", "addmm") and len(tensors) >= 2:
        first, second = tensors[-2], tensors[-1]
        return int(min(first.shape[0], first.shape[1], second.shape[1]))
    if name in ("bmm", "baddbmm") and len(tensors) >= 2:
        first, second = tensors[-2], tensors[-1]
        return int(min(first.shape[1], first.shape[2], second.shape[2]))
    return 0


class _Tracer(TorchDispatchMode):
    """Records every costed ATen op into the current list (optionally timing it).

    A timed op is charged its own run time plus the host time since the previous op
    ended (Python module calls, autograd bookkeeping, free view ops), so the ops of a
    pass add up to its wall time; the tracer's own bookkeeping is left out.
    """

    def __init__(self, sink: list[TraceItem], *, timed: bool, device: torch.device) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.sink = sink
        self.timed = timed
        self.cuda = device.type == "cuda"
        self.previous = time.perf_counter()

    def restart(self, sink: list[TraceItem]) -> None:
        """Record into ``sink`` from now on; the next op's gap starts now."""
        self.sink = sink
        self.previous = time.perf_counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _is_free(func):
            return func(*args, **kwargs)
        entered = time.perf_counter()
        if self.timed and self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if self.timed and self.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start + (entered - self.previous) if self.timed else None
        packet = func.overloadpacket
        name = packet.__name__
        flops = (
            float(flop_registry[packet](*args, **kwargs, out_val=out))
            if (packet in flop_registry)
            else 0.0
        )
        moved = sum(t.numel() * t.element_size() for t in _tensors([args, out]))
        self.sink.append(Op(f"aten.{name}", flops, float(moved), _gemm_side(name, args), seconds))
        self.previous = time.perf_counter()
        return out


def _loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy over every target: one per example, or per position of a sequence
    (logits ``[..., classes]``; flattening is a view, so it adds no traced op)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def one_pass(
    model: nn.Module,
    layers: dict[str, nn.Module],
    inputs: Tensor,
    targets: Tensor,
    *,
    timed: bool,
) -> tuple[list[TraceItem], list[TraceItem], dict[str, int]]:
    forward: list[TraceItem] = []
    backward: list[TraceItem] = []
    rows: dict[str, int] = {}
    handles = []

    def pre(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            forward.append(FactorHook("A", name))

        return hook

    def post(name: str, out_units: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if isinstance(output, Tensor):
                rows.setdefault(name, output.numel() // out_units)
                if output.requires_grad:
                    output.register_hook(lambda grad: backward.append(FactorHook("G", name)))

        return hook

    for name, module in layers.items():
        weight = module.weight
        assert isinstance(weight, Tensor)
        handles.append(module.register_forward_pre_hook(pre(name)))
        handles.append(module.register_forward_hook(post(name, int(weight.shape[0]))))
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            handles.append(
                parameter.register_post_accumulate_grad_hook(
                    lambda p, name=name: backward.append(GradReady(name, p.numel()))
                )
            )
    try:
        model.train()
        model.zero_grad(set_to_none=True)
        with _Tracer(forward, timed=timed, device=inputs.device) as tracer:
            tracer.restart(forward)
            loss = _loss(model(inputs), targets)
            tracer.restart(backward)
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return forward, backward, rows


def median_times(runs: list[list[TraceItem]]) -> list[TraceItem]:
    shapes = {tuple(type(item).__name__ for item in run) for run in runs}
    if len(shapes) != 1:
        raise RuntimeError("repeated passes traced different op sequences; cannot time them")
    merged: list[TraceItem] = []
    for items in zip(*runs, strict=True):
        first = items[0]
        if isinstance(first, Op):
            seconds = statistics.median(
                item.seconds or 0.0 for item in items if isinstance(item, Op)
            )
            merged.append(Op(first.name, first.flops, first.bytes, first.gemm_side, seconds))
        else:
            merged.append(first)
    return merged


def plain_seconds(model: nn.Module, inputs: Tensor, targets: Tensor, repeats: int) -> float:
    """Median wall time of a forward and backward pass without the tracer."""
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        if inputs.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        _loss(model(inputs), targets).backward()
        if inputs.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def normalised(
    forward: list[TraceItem], backward: list[TraceItem], plain: float
) -> tuple[list[TraceItem], list[TraceItem]]:
    """Scale op times so a pass adds up to ``plain``: the tracer's own dispatch cost, which
    lands in the gaps between ops, is taken out in proportion."""
    total = sum(i.seconds or 0.0 for i in (*forward, *backward) if isinstance(i, Op))
    factor = plain / total if total > 0 else 1.0

    def scaled(items: list[TraceItem]) -> list[TraceItem]:
        return [
            replace(item, seconds=(item.seconds or 0.0) * factor) if isinstance(item, Op) else item
            for item in items
        ]

    return scaled(forward), scaled(backward)
