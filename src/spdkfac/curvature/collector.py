"""The factor collector: capture each block's statistics and fold them into global ones.

On factor steps the hooks hand every captured call to its block, which returns its
contributions per exchange slot; the collector accumulates them (example-weighted, with
the loss-scaling corrections of output-gradient statistics), hands each symmetric slot to
the factor exchange as soon as it has the calls the previous steps had (so its all-reduce
can start while the passes go on), and at the step reduces the rest. A slot called more
often after its hand-over (call counts may grow, and differ by rank) is marked grown; the
marks travel with the step's weights, and every rank then exchanges the marked slots
again, complete: one more collective on the steps where counts grew, none otherwise. A
group of one uses an exchange that completes at once, so there is one code path whatever
the world size.

Where ranks read the same batch (a tensor-parallel group), the layout's
:class:`~spdkfac.planning.factor_split.FactorShare` says which blocks this rank forms the
statistics of; a call of any other block is counted, its statistic not formed, and its
slots handed over empty (zeros with weight 0) when the calls are complete, as the rank
forming it hands over its own: the exchange divides by the summed weights, so the
average is the same, and every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd import Variable

from spdkfac.comm import Communicator
from spdkfac.comm.dense import reduce_dense
from spdkfac.comm.exchange import ExchangeResult
from spdkfac.comm.pipeline import (
    ExchangeSettings,
    FactorPipeline,
    FactorRoute,
    LocalFactorExchange,
)
from spdkfac.curvature.block import Contribution, CurvatureBlock
from spdkfac.curvature.capture import ActivationCapture
from spdkfac.curvature.state import FactorAccumulator
from spdkfac.linalg import is_finite
from spdkfac.planning.factor_split import FactorShare
from spdkfac.planning.fusion import FusionPlan
from spdkfac.profiling import Phase, Profiler, span_name

__all__ = ["CollectorSettings", "FactorCollector"]


def _no_autocast(tensor: Tensor) -> torch.autocast:
    """Factors are statistics kept in at least float32: a user's autocast region around the
    forward must not silently lower their precision (use ``factor_options`` for that)."""
    return torch.autocast(device_type=tensor.device.type, enabled=False)


def _keys_by_pass(blocks: Sequence[CurvatureBlock]) -> dict[tuple[str, bool], tuple[str, ...]]:
    """Each block's slot keys by ``(name, forward)``: those of the forward pass (True) and
    those of the backward pass."""
    return {
        (block.name, forward): tuple(s.key for s in block.slots() if s.forward == forward)
        for block in blocks
        for forward in (True, False)
    }


@dataclass(frozen=True, kw_only=True)
class CollectorSettings:
    """The options of a factor collector, the same for every composition.

    Attributes:
        accumulation_steps: Passes per step; slots are exchanged after the last.
        examples: Statistics from the first this many examples of each captured call
            (:attr:`~spdkfac.layers.FactorOptions.examples`; None: all).
        exchange: Bucket cap, fusion warm-up and wire dtype of the factor exchange.
    """

    accumulation_steps: int = 1
    examples: int | None = None
    exchange: ExchangeSettings = field(default_factory=ExchangeSettings)


class FactorCollector:
    """Hooks, per-step accumulators and the factor exchange of a set of blocks.

    Args:
        blocks: The curvature blocks, in a fixed order (the same on every rank).
        communicator: The group statistics are averaged over.
        route: Where and how symmetric slots are exchanged (used with more than one
            rank). A pipelined fusion launches buckets from hooks, so its group is one of
            its own (a duplicate of ``communicator``) that never interleaves with DDP's
            gradient all-reduces on the default group; the assembler creates it once,
            since creating a group is a collective and a preconditioner may assemble
            several collectors.
        settings: Accumulation, example subsampling and the exchange's options.
        enabled: Called once per forward: whether this step's passes are captured.
        grad_scale: Returns the loss scale of a ``GradScaler`` (None without one).
        profiler: Where spans are recorded.
        share: The blocks this rank forms the statistics of (the layout's; None: all).
    """

    def __init__(
        self,
        blocks: Sequence[CurvatureBlock],
        communicator: Communicator,
        route: FactorRoute,
        *,
        settings: CollectorSettings,
        enabled: Callable[[], bool],
        grad_scale: Callable[[], float] | None = None,
        profiler: Profiler,
        share: FactorShare | None = None,
    ) -> None:
        self._blocks = {block.name: block for block in blocks}
        self._examples = settings.examples
        self._communicator = communicator
        self._accumulation_steps = settings.accumulation_steps
        self._grad_scale = grad_scale
        self._scale: float | None = None
        self._profiler = profiler
        self._end_queued = False
        # Calls per step after which a slot is handed over early, learned on the first
        # factor step (a layer may run several times per pass), raised to the most calls
        # any later step saw: until then nothing is handed early. This rank's own guess:
        # a slot called more often (grown) is exchanged again at the step, agreed by all.
        self._expected: dict[str, int] | None = None
        self._grown: set[str] = set()
        # Until the first factor step: per output-gradient slot, the backward passes
        # (autograd graph tasks) its calls came in, to tell accumulation passes from a
        # layer called several times in one pass.
        self._passes: dict[str, set[int]] = {}
        self.forward_order: list[str] = []
        slots = [slot for block in blocks for slot in block.slots()]
        self._slots = {slot.key: slot for slot in slots}
        self._pending = {slot.key: FactorAccumulator() for slot in slots}
        self._keys = _keys_by_pass(blocks)
        self._labels = {pair: "+".join(keys) for pair, keys in self._keys.items()}
        # Blocks another rank of this rank's group forms the statistics of.
        self._elsewhere = frozenset(b.name for b in blocks if share and not share.computes(b.name))
        wide = any(block.dtype == torch.float64 for block in blocks)
        self._dtype = torch.float64 if wide else torch.float32
        self._dense = [(slot.key, slot.shape) for slot in slots if not slot.symmetric]
        symmetric = [slot for slot in slots if slot.symmetric]
        self._exchange: FactorPipeline | LocalFactorExchange = (
            LocalFactorExchange()
            if communicator.world_size == 1
            else FactorPipeline(
                route,
                [(slot.key, slot.shape[0]) for slot in symmetric if slot.forward],
                [(slot.key, slot.shape[0]) for slot in reversed(symmetric) if not slot.forward],
                settings=settings.exchange,
                dtype=self._dtype,
                profiler=profiler,
            )
        )
        self._capture = ActivationCapture(
            {block.name: block.module for block in blocks},
            on_input=self._on_input,
            on_grad_output=self._on_grad_output,
            enabled=enabled,
        )

    @property
    def fusion_plan(self) -> FusionPlan | None:
        """The factor buckets in use (None with a single rank: nothing is exchanged)."""
        return self._exchange.plan

    @property
    def fusion_settled(self) -> bool:
        """Whether the fusion plan is final (a measured one has planned; replicated)."""
        return self._exchange.settled

    def request_replan(self) -> None:
        """Re-plan a measured fusion after the next factor step (call on every rank)."""
        self._exchange.request_replan()

    # ------------------------------------------------------------------ hooks
    def _on_input(self, name: str, module: nn.Module, inputs: Tensor) -> None:
        if name not in self.forward_order:
            self.forward_order.append(name)
        label = self._labels[(name, True)]
        if not label:
            return
        if name in self._elsewhere:
            self._count_elsewhere(self._keys[(name, True)])
            return
        with self._profiler.span(span_name(Phase.FACTOR_COMPUTE, label)), _no_autocast(inputs):
            self._add(self._blocks[name].capture_input(inputs[: self._examples]), correction=1.0)

    def _on_grad_output(self, name: str, module: nn.Module, inputs: Tensor, grad: Tensor) -> None:
        if self._expected is None:
            self._passes.setdefault(name, set()).add(torch._C._current_graph_task_id())
        if name in self._elsewhere:
            self._count_elsewhere(self._keys[(name, False)])
            return
        label = self._labels[(name, False)]
        correction = self._correction()
        kept = self._examples
        if kept is not None and grad.shape[0] > kept:
            # δ = B·g with B the call's examples: from the first ``kept`` of them, δ comes
            # out kept/B times the whole batch's, its squares (kept/B)² times.
            correction *= (grad.shape[0] / kept) ** 2
            inputs, grad = inputs[:kept], grad[:kept]
        with self._profiler.span(span_name(Phase.FACTOR_COMPUTE, label)), _no_autocast(grad):
            self._add(self._blocks[name].capture_grad(inputs, grad), correction=correction)

    def _correction(self) -> float:
        """Factor correcting statistics that are products of two output gradients.

        δ = B·g assumes the loss is this pass's mean; with the loss divided by the number
        of passes, g is that much smaller and its square that much squared; a loss scale
        multiplies g, so the square is divided by its square.
        """
        steps = self._accumulation_steps
        correction = float(steps * steps)
        if self._grad_scale is not None:
            if self._scale is None:  # read once per step: it syncs on CUDA
                self._scale = self._grad_scale()
            correction /= self._scale * self._scale
        return correction

    def _add(self, contributions: dict[str, Contribution], *, correction: float) -> None:
        for key, (statistic, weight) in contributions.items():
            if correction != 1.0:
                statistic.mul_(correction)
            pending = self._pending[key]
            pending.add(statistic, weight)
            self._arrived(key, pending)

    def _count_elsewhere(self, keys: Sequence[str]) -> None:
        """A call of a block another rank of the group forms the statistics of: counted,
        so that its slots are handed over (empty) when the calls are complete."""
        for key in keys:
            pending = self._pending[key]
            pending.count()
            self._arrived(key, pending)

    def _arrived(self, key: str, pending: FactorAccumulator) -> None:
        expected = None if self._expected is None else self._expected.get(key)
        final = expected is not None and pending.calls >= expected
        if self._exchange.pipelined and self._slots[key].symmetric and final:
            self._hand_over(key, pending)

    def _hand_over(self, key: str, pending: FactorAccumulator) -> None:
        """Give the statistic to the exchange once it has the calls expected of it (None
        with weight 0 for a block formed elsewhere); a call after that marks the slot
        grown (exchanged again at the step)."""
        if self._exchange.hand_over(key, pending.mean(), float(pending.weight)):
            if not self._slots[key].forward and self._exchange.window_planned:
                self._end_pass_at_backward_end()
            return
        self._grown.add(key)

    def _end_pass_at_backward_end(self) -> None:
        """Once per scheduled pass (from the first output-gradient hand-over, before DDP
        queues its own): when the backward pass ends, hand over what is left and launch
        every factor bucket, so nothing the schedule orders waits past DDP's wait."""
        if self._end_queued:
            return
        self._end_queued = True

        def end() -> None:
            self._end_queued = False
            self._hand_over_rest()
            self._exchange.flush()

        Variable._execution_engine.queue_callback(end)

    def _hand_over_rest(self) -> None:
        """Statistics from fewer passes than ``accumulation_steps``, not handed over yet."""
        for key, pending in self._pending.items():
            symmetric = self._slots[key].symmetric
            if symmetric and pending.calls and not self._exchange.is_handed_over(key):
                mean, weight = pending.mean(), float(pending.weight)
                self._exchange.hand_over(key, mean, weight, in_pass=False)

    def _learn_calls(self) -> None:
        """On the first factor step: how many calls make each slot final, and a warning
        when every layer ran in more backward passes than ``accumulation_steps``
        (forgotten option; calls within one pass, a loop or an unrolled cell, count once)."""
        calls = {key: p.calls for key, p in self._pending.items() if p.calls > 0}
        self._expected = calls
        passes = min((len(tasks) for tasks in self._passes.values()), default=0)
        self._passes = {}
        if passes > self._accumulation_steps:
            warnings.warn(
                f"spdkfac: every layer ran backward {passes} times before step() with "
                f"accumulation_steps={self._accumulation_steps}. For gradient "
                f"accumulation set accumulation_steps={passes}: G factors assume each "
                "pass's loss is divided by accumulation_steps (otherwise they come out "
                f"{passes}² times too small with the usual loss / {passes})",
                RuntimeWarning,
                stacklevel=4,
            )

    # ------------------------------------------------------------------ the step
    def new_step(self) -> None:
        """Forget the loss scale read during the previous step."""
        self._scale = None

    def pending_finite(self) -> bool:
        """Whether every statistic captured this step is finite."""
        return all(is_finite(p.total) for p in self._pending.values() if p.total is not None)

    def update(self, *, local_ok: bool, decay: float) -> bool:
        """Exchange this step's statistics (:meth:`exchange`) and fold them into every
        block's running averages with factor decay ``decay``. Collective.

        Returns:
            False when some rank saw non-finite values; then no factor changes anywhere.
        """
        new = self.exchange(local_ok=local_ok)
        if new is None:
            return False
        with self._profiler.span(span_name(Phase.FACTOR_COMPUTE, "running_average")):
            for block in self._blocks.values():
                block.absorb(new, decay)
        return True

    def exchange(self, *, local_ok: bool) -> dict[str, Tensor | None] | None:
        """This step's statistics averaged over all ranks (weighted by examples), by slot.

        Collective: every rank calls it on every factor step, whatever it captured. Clears
        the step's contributions.

        Returns:
            None when some rank flagged non-finite gradients or statistics (then nothing
            may be absorbed anywhere).
        """
        local_ok = local_ok and self.pending_finite()
        if self._expected is None:
            self._learn_calls()
        self._hand_over_rest()
        result = self._exchange.finish(local_ok=local_ok, grown=self._grown)
        if result.usable and result.revise:  # agreed: every rank revises the same slots
            result = self._revise(result)
        dense: dict[str, Tensor | None] = {}
        if self._dense:
            # Issued on every factor step after the factor exchange, whatever was captured.
            with self._profiler.span(span_name(Phase.FACTOR_COMM, "dense")):
                dense = reduce_dense(
                    self._communicator,
                    self._dense,
                    {
                        key: (self._pending[key].total, self._pending[key].weight)
                        for key, _ in self._dense
                    },
                    self._dtype,
                )
        self.clear()
        if not result.usable or not all(is_finite(v) for v in dense.values() if v is not None):
            return None
        return {**result.factors, **dense}

    def _revise(self, result: ExchangeResult) -> ExchangeResult:
        """Exchange the grown slots again, each rank's every call this time."""
        contributions = {
            key: (self._pending[key].mean(), float(self._pending[key].weight))
            for key in result.revise
        }
        revised = self._exchange.revise(contributions)
        return ExchangeResult(
            factors={**result.factors, **revised.factors},
            flagged_ranks=revised.flagged_ranks,
            finite=revised.finite,
        )

    def _raise_expected(self) -> None:
        """A slot called more often than expected is expected that often from now on."""
        if self._expected is None:
            return
        for key, pending in self._pending.items():
            if pending.calls > self._expected.get(key, 0):
                self._expected[key] = pending.calls

    def clear(self) -> None:
        """Drop what was captured since the last factor update."""
        self._raise_expected()
        self._grown.clear()
        self._end_queued = False
        for pending in self._pending.values():
            pending.clear()
        self._capture.forget()

    def remove(self) -> None:
        """Remove every hook and drop what was captured."""
        self._capture.remove()
        self.clear()
