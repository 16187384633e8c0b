"""``KFACPreconditioner``: wires capture, exchange, placement and inverses into a step."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from spdkfac.agreement import check_agreement, shared_cost_model
from spdkfac.capture import ActivationCapture
from spdkfac.comm import Communicator, make_communicator
from spdkfac.comm.fusion import FusionPlan
from spdkfac.comm.pipeline import FactorPipeline
from spdkfac.config import STRATEGIES, FloatSchedule, IntSchedule, KFACConfig, SkipEntry
from spdkfac.costmodel import CostModel
from spdkfac.curvature import (
    FactorAccumulator,
    LayerState,
    layer_states_to_dict,
    load_layer_states,
    running_average,
)
from spdkfac.discovery import discover_layers, unwrap_model
from spdkfac.inversion import invert_factors
from spdkfac.layers import FactorOptions, precondition
from spdkfac.linalg import InverseMethod
from spdkfac.placement import FactorSpec, Plan, plan_inversions
from spdkfac.profiling import Profiler, span_name

__all__ = ["KFACPreconditioner"]

_STATE_FORMAT = 1


def _no_autocast(tensor: Tensor) -> torch.autocast:
    """Factors are statistics kept in at least float32: a user's autocast region around the
    forward must not silently lower their precision (use ``factor_options`` for that)."""
    return torch.autocast(device_type=tensor.device.type, enabled=False)


def _all_finite(tensors: Iterable[Tensor]) -> bool:
    flags = [torch.isfinite(t).all() for t in tensors]
    return bool(torch.stack(flags).all()) if flags else True


class KFACPreconditioner:
    """K-FAC preconditioner for the Linear and Conv2d layers of a model, data parallel.

    Call :meth:`step` after ``loss.backward()`` and before ``optimizer.step()``: it replaces
    each registered layer's weight and bias gradient by the preconditioned gradient
    ``V = (G + γI)⁻¹ ∇ (A + γI)⁻¹`` (scaled by the KL clip) and advances its step counter.
    Works with any ``torch.optim`` optimizer. Conventions are those of ``DESIGN.md``.

    In a ``torch.distributed`` job (gradients averaged by ``DistributedDataParallel`` or
    otherwise), factors are averaged across ranks, weighted by each rank's examples, and
    inversions are placed by the strategy's planner; every rank ends with the same
    preconditioned gradient that single-process K-FAC computes on the concatenated batch.

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
        strategy: ``"spd-kfac"`` (default), ``"mpd-kfac"`` or ``"d-kfac"``.
        placement: Override of the strategy's inverse placement.
        process_group: The ``torch.distributed`` group (default: the world when
            initialized, else a group of one).
        cost_model: Costs the ``balanced`` placement decides from: a ``CostModel``, or
            the path of a JSON written by ``spdkfac calibrate`` (default: constants
            measured on the project's reference machine). Rank 0's is used on every rank.
        factor_options: How factors are computed (method, compute dtype); default: the
            fastest exact method per layer in float32.
        factor_exchange: Override of the strategy's fusion policy: ``"after-backward"``,
            ``"layerwise"``, ``"threshold"`` or ``"optimal"`` (SPD-KFAC's pipelining).
        accumulation_steps: Forward/backward passes per :meth:`step` (gradient
            accumulation, each pass's loss divided by it); factors are exchanged once.
        factor_comm_dtype: Dtype factors travel in (``torch.bfloat16`` halves the bytes).
        bucket_cap_mb: Bucket cap of the ``threshold`` and ``after-backward`` policies.
        fusion_warmup_steps: Factor steps measured before the ``optimal`` plan is made.
        max_inverse_failures: Consecutive inverse updates with a failed inversion that
            are tolerated (each keeps the previous inverse); one more raises on every rank.
        grad_scaler: The ``torch.amp.GradScaler`` scaling the loss, if any: G factors are
            unscaled by it. Call ``scaler.unscale_(optimizer)`` before :meth:`step`.
        profile: Record ``kfac/<phase>/<layer>`` spans in :attr:`profiler` (off: no cost).

    Raises:
        ValueError: On an invalid option (naming it and its value), a model without any
            supported layer, a process group this rank is not in, or ranks that disagree
            on the options or the registered layers (raised on every rank).
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
        strategy: str = "spd-kfac",
        placement: str | None = None,
        process_group: Any = None,
        cost_model: CostModel | str | os.PathLike[str] | None = None,
        factor_options: FactorOptions | None = None,
        factor_exchange: str | None = None,
        accumulation_steps: int = 1,
        factor_comm_dtype: torch.dtype | None = None,
        bucket_cap_mb: float = 64.0,
        fusion_warmup_steps: int = 5,
        max_inverse_failures: int = 3,
        grad_scaler: torch.amp.GradScaler | None = None,
        profile: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if isinstance(skip_layers, (str, type)):
            raise ValueError(f"skip_layers must be a sequence, got {skip_layers!r}")
        if cost_model is not None and not isinstance(cost_model, (CostModel, str, os.PathLike)):
            raise TypeError(
                f"cost_model must be a CostModel, a path to a calibration JSON or None, "
                f"got {cost_model!r}"
            )
        self.config = KFACConfig(
            damping=damping,
            factor_decay=factor_decay,
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            kl_clip=kl_clip,
            lr=lr,
            inverse_method=inverse_method,
            skip_layers=tuple(skip_layers),
            strategy=strategy,
            placement=placement,
            factor_options=factor_options or FactorOptions(),
            factor_exchange=factor_exchange,
            accumulation_steps=accumulation_steps,
            factor_comm_dtype=factor_comm_dtype,
            bucket_cap_mb=bucket_cap_mb,
            fusion_warmup_steps=fusion_warmup_steps,
            max_inverse_failures=max_inverse_failures,
        )
        self._communicator: Communicator = (
            process_group
            if isinstance(process_group, Communicator)
            else make_communicator(process_group)
        )
        self._model = unwrap_model(model)
        first = next(self._model.parameters(), None)
        self.profiler = Profiler(
            enabled=profile,
            rank=self._communicator.rank,
            device=None if first is None else first.device,
        )
        try:
            layers: dict[str, LayerState] | None = discover_layers(
                self._model, self.config.skip_layers, self.config.factor_options
            )
            local_error: ValueError | None = None
        except ValueError as error:
            layers, local_error = None, error
        check_agreement(self._communicator, self.config.fingerprint(), layers, local_error)
        assert layers is not None
        self._layers = layers
        self._forward_order: list[str] = []
        self._warned_extra_pass = False
        self._inverse_failures = 0
        self._grad_scaler = grad_scaler
        self._grad_scale: float | None = None
        self._step = 0
        self._skipped_steps = 0
        specs = [
            FactorSpec(name, kind, state.a_dim if kind == "A" else state.g_dim)
            for name, state in layers.items()
            for kind in ("A", "G")
        ]
        costs = shared_cost_model(self._communicator, cost_model)
        self._plan = plan_inversions(
            specs, self._communicator.world_size, self.config.inverse_placement, costs
        )
        fuse = STRATEGIES[self.config.strategy].fuse_broadcasts
        self._broadcast_group_elements = costs.broadcast_group_elements() if fuse else 0
        wide = any(state.factor_dtype == torch.float64 for state in layers.values())
        self._pipeline: FactorPipeline | None = None
        if self._communicator.world_size > 1:
            policy = self.config.fusion_policy
            # Buckets launched from hooks get a group of their own, so they never
            # interleave with DDP's gradient all-reduces on the default group.
            group = (
                self._communicator.duplicate() if policy != "after-backward" else self._communicator
            )
            self._pipeline = FactorPipeline(
                group,
                [(name, state.a_dim, state.g_dim) for name, state in layers.items()],
                policy,
                allreduce=costs.allreduce,
                bucket_cap_bytes=int(self.config.bucket_cap_mb * 2**20),
                warmup_steps=self.config.fusion_warmup_steps,
                dtype=torch.float64 if wide else torch.float32,
                comm_dtype=self.config.factor_comm_dtype,
                profiler=self.profiler,
            )
        self._capture = ActivationCapture(
            {name: state.module for name, state in layers.items()},
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
    def plan(self) -> Plan:
        """Where each factor is inverted (see :mod:`spdkfac.placement`)."""
        return self._plan

    @property
    def communicator(self) -> Communicator:
        """The group factors and inverses are exchanged over."""
        return self._communicator

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
        with (
            self.profiler.span(span_name("factor_compute", f"{name}/A")),
            _no_autocast(inputs),
        ):
            factor, weight = state.adapter.a_factor(module, inputs.to(state.factor_dtype))
            state.a_pending.add(factor, weight)
            self._hand_over_if_final(f"{name}/A", state.a_pending)

    def _capture_grad_output(self, name: str, module: nn.Module, grad: Tensor) -> None:
        state = self._layers[name]
        with (
            self.profiler.span(span_name("factor_compute", f"{name}/G")),
            _no_autocast(grad),
        ):
            factor, weight = state.adapter.g_factor(module, grad.to(state.factor_dtype))
            if self._grad_scaler is not None:
                if self._grad_scale is None:  # read once per step: it syncs on CUDA
                    self._grad_scale = float(self._grad_scaler.get_scale())
                factor.div_(self._grad_scale * self._grad_scale)
            steps = self.config.accumulation_steps
            if steps > 1:
                # δ = B·g assumes the loss is this pass's mean; with the loss divided by
                # the number of passes, g is that much smaller and G its square smaller.
                factor.mul_(float(steps * steps))
            state.g_pending.add(factor, weight)
            self._hand_over_if_final(f"{name}/G", state.g_pending)

    def _hand_over_if_final(self, key: str, pending: FactorAccumulator) -> None:
        """After the last accumulation pass, give the factor to the (pipelined) exchange."""
        if self._pipeline is None or pending.calls < self.config.accumulation_steps:
            return
        mean = pending.mean()
        if mean is None or self._pipeline.hand_over(key, mean, float(pending.weight)):
            return
        if not self._warned_extra_pass:
            self._warned_extra_pass = True
            warnings.warn(
                f"spdkfac: more forward/backward passes than accumulation_steps="
                f"{self.config.accumulation_steps} before step(); the extra passes do "
                "not update the factors",
                RuntimeWarning,
                stacklevel=4,
            )

    @property
    def fusion_plan(self) -> FusionPlan | None:
        """The factor buckets in use (None with a single rank: nothing is exchanged)."""
        return None if self._pipeline is None else self._pipeline.plan

    def replan_fusion(self) -> None:
        """Re-plan the ``optimal`` fusion from fresh measurements after the next factor step.

        Call it on every rank at the same step (it leads to a collective).
        """
        if self._pipeline is not None:
            self._pipeline.request_replan()

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self) -> bool:
        """Precondition the registered gradients in place and advance the step counter.

        The collectives a step issues depend only on the step counter and the config, so
        every rank issues the same ones in the same order.

        Returns:
            True when the update was applied. False when it was skipped because a gradient,
            a captured factor or the KL-clip sum was non-finite: gradients are left as they
            were, no factor absorbs the step, and the caller should skip
            ``optimizer.step()``. On factor-update steps the decision is agreed by all
            ranks; otherwise it is local (identical when gradients are all-reduced).
        """
        with self.profiler.span(span_name("step")):
            return self._step_phases()

    def _step_phases(self) -> bool:
        step = self._step
        self._step += 1
        self._grad_scale = None
        gradients = {
            name: grad
            for name, state in self._layers.items()
            if (grad := state.adapter.gradient(state.module)) is not None
        }
        usable = _all_finite(gradients.values())
        if self.config.is_factor_step(step):
            usable = self._update_factors(local_ok=usable) and usable
        elif self._communicator.world_size > 1:
            # Gradients need not be replicated (no DDP): skip on every rank or on none.
            flag = torch.tensor([0.0 if usable else 1.0], device=self._communicator.device)
            usable = float(self._communicator.all_reduce_max(flag).wait()) == 0.0
        if self.config.is_inverse_step(step):
            self._update_inverses(self.config.damping_at(step))
        if not usable:
            return self._skip()
        preconditioned = {}
        for name, grad in gradients.items():
            state = self._layers[name]
            with self.profiler.span(span_name("precondition", name)):
                if state.a_inverse is not None and state.g_inverse is not None:
                    preconditioned[name] = precondition(grad, state.a_inverse, state.g_inverse)
                else:
                    preconditioned[name] = grad
        with self.profiler.span(span_name("precondition", "kl_clip")):
            scale = self._kl_clip_scale(gradients, preconditioned, step)
            if scale is None:
                return self._skip()
            for name, matrix in preconditioned.items():
                state = self._layers[name]
                state.adapter.set_gradient(
                    state.module, matrix.mul_(scale) if scale != 1.0 else matrix
                )
        return True

    def _skip(self) -> bool:
        self._skipped_steps += 1
        return False

    def _update_factors(self, *, local_ok: bool) -> bool:
        """Fold this step's captured factors into the running averages (globally).

        Returns:
            False when some rank saw non-finite values; then no factor changes anywhere.
        """
        local_ok = local_ok and _all_finite(
            total
            for state in self._layers.values()
            for total in (state.a_pending.total, state.g_pending.total)
            if total is not None
        )
        new = self._global_contributions(local_ok)
        for state in self._layers.values():
            state.clear_pending()
        if new is None:
            return False
        decay = self.config.factor_decay
        with self.profiler.span(span_name("factor_compute", "running_average")):
            for name, state in self._layers.items():
                a_new, g_new = new.get(f"{name}/A"), new.get(f"{name}/G")
                # A layer seen in forward but not in backward (or vice versa) keeps both
                # factors as they were, so A and G always describe the same examples.
                if a_new is not None and g_new is not None:
                    state.a_factor = running_average(state.a_factor, a_new, decay)
                    state.g_factor = running_average(state.g_factor, g_new, decay)
        return True

    def _global_contributions(self, local_ok: bool) -> dict[str, Tensor | None] | None:
        """This step's factors averaged over all ranks; None when any rank flagged."""
        if self._pipeline is None:
            if not local_ok:
                return None
            return {
                f"{name}/{kind}": pending.mean()
                for name, state in self._layers.items()
                for kind, pending in (("A", state.a_pending), ("G", state.g_pending))
            }
        # Factors from fewer passes than accumulation_steps were not handed over yet.
        for name, state in self._layers.items():
            for kind, pending in (("A", state.a_pending), ("G", state.g_pending)):
                mean = pending.mean()
                key = f"{name}/{kind}"
                if mean is not None and not self._pipeline.is_handed_over(key):
                    self._pipeline.hand_over(key, mean, float(pending.weight))
        result = self._pipeline.finish(local_ok=local_ok)
        return result.factors if result.usable else None

    def _update_inverses(self, damping: float) -> None:
        factors: dict[str, Tensor] = {}
        for name, state in self._layers.items():
            if state.a_factor is not None and state.g_factor is not None:
                factors[f"{name}/A"] = state.a_factor
                factors[f"{name}/G"] = state.g_factor
        method: InverseMethod = "eigen" if self.config.inverse_method == "eigen" else "cholesky"
        previous: dict[str, Tensor | None] = {}
        for name, state in self._layers.items():
            previous[f"{name}/A"], previous[f"{name}/G"] = state.a_inverse, state.g_inverse
        outcome = invert_factors(
            factors,
            self._plan,
            self._communicator,
            damping,
            method,
            previous=previous,
            min_group_elements=self._broadcast_group_elements,
            profiler=self.profiler,
        )
        for name, state in self._layers.items():
            if f"{name}/A" in factors:
                # A factor that failed with no previous inverse leaves the layer on its
                # plain gradient until an inversion succeeds.
                state.a_inverse = outcome.inverses.get(f"{name}/A")
                state.g_inverse = outcome.inverses.get(f"{name}/G")
        # The failure set is agreed by every rank, so this counter is replicated state.
        self._inverse_failures = self._inverse_failures + 1 if outcome.failed else 0
        if self._inverse_failures > self.config.max_inverse_failures:
            raise RuntimeError(
                f"spdkfac: inverting factors failed on {self._inverse_failures} consecutive "
                f"inverse updates (max_inverse_failures={self.config.max_inverse_failures}); "
                f"last failures: {sorted(outcome.failed)}"
            )

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
        """Factors, inverses and counters, as a dict of copies (safe to ``torch.save``).

        Factors and inverses are the same on every rank, so any rank's state dict can
        resume any world size.
        """
        return {
            "format": _STATE_FORMAT,
            "steps": self._step,
            "skipped_steps": self._skipped_steps,
            "forward_order": list(self._forward_order),
            "layers": layer_states_to_dict(self._layers),
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
        load_layer_states(self._layers, state_dict["layers"])
        self._step = int(state_dict["steps"])
        self._skipped_steps = int(state_dict.get("skipped_steps", 0))
        self._forward_order = [n for n in state_dict.get("forward_order", []) if n in self._layers]

    def remove(self) -> None:
        """Remove every hook this preconditioner installed; the model is left as it was."""
        self._capture.remove()
        for state in self._layers.values():
            state.clear_pending()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layers={len(self._layers)}, steps={self._step}, "
            f"world_size={self._communicator.world_size}, config={self.config})"
        )
