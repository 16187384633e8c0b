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
from spdkfac.batchnorm_curvature import BatchNormCurvature
from spdkfac.capture import ActivationCapture, PairedCapture
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
from spdkfac.discovery import discover_batchnorm_layers, discover_layers, unwrap_model
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
        batchnorm: Osawa et al.'s curvature for BatchNorm scale and shift: ``"diagonal"``
            (their diagonal Fisher), ``"unit-wise"`` (each channel's 2×2 block over
            (γ_c, β_c)) or None (default: BatchNorm keeps its plain gradient). The blocks
            follow the factors' refresh intervals and running average, are all-reduced in
            one extra collective on factor steps, and are inverted on every rank (closed
            form; see :mod:`spdkfac.batchnorm_curvature`).
        batchnorm_damping_multiplier: ρ_BN > 0: BatchNorm blocks are damped with ρ_BN·γ.

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
        batchnorm: str | None = None,
        batchnorm_damping_multiplier: float = 1.0,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if isinstance(skip_layers, (str, type)):
            raise ValueError(f"skip_layers must be a sequence, got {skip_layers!r}")
        try:
            skip_entries = tuple(skip_layers)
        except TypeError:
            raise ValueError(f"skip_layers must be a sequence, got {skip_layers!r}") from None
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise ValueError(
                f"grad_scaler must be a torch.amp.GradScaler or None, got {grad_scaler!r}"
            )
        if not isinstance(profile, bool):
            raise ValueError(f"profile must be a bool, got {profile!r}")
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
            skip_layers=skip_entries,
            strategy=strategy,
            placement=placement,
            factor_options=factor_options or FactorOptions(),
            factor_exchange=factor_exchange,
            accumulation_steps=accumulation_steps,
            factor_comm_dtype=factor_comm_dtype,
            bucket_cap_mb=bucket_cap_mb,
            fusion_warmup_steps=fusion_warmup_steps,
            max_inverse_failures=max_inverse_failures,
            batchnorm=batchnorm,
            batchnorm_damping_multiplier=batchnorm_damping_multiplier,
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
        normalization = (
            discover_batchnorm_layers(self._model, self.config.skip_layers)
            if self.config.batchnorm is not None
            else {}
        )
        self._batchnorm = (
            BatchNormCurvature(normalization, mode=self.config.batchnorm)
            if self.config.batchnorm is not None and normalization
            else None
        )
        try:
            layers: dict[str, LayerState] | None = discover_layers(
                self._model,
                self.config.skip_layers,
                self.config.factor_options,
                handled=normalization.keys(),
            )
            local_error: ValueError | None = None
        except ValueError as error:
            layers, local_error = None, error
        fingerprint = self.config.fingerprint()
        if self._batchnorm is not None:
            fingerprint += f"|batchnorm:{self._batchnorm.describe()}"
        check_agreement(self._communicator, fingerprint, layers, local_error)
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
        self._batchnorm_capture = (
            None
            if self._batchnorm is None
            else PairedCapture(
                self._batchnorm.modules,
                on_pair=self._capture_batchnorm,
                enabled=self._capturing,
            )
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

    @property
    def batchnorm_layers(self) -> list[str]:
        """BatchNorm layers given curvature (empty unless the ``batchnorm`` option is set)."""
        return [] if self._batchnorm is None else self._batchnorm.names

    def batchnorm_blocks(self, name: str) -> tuple[Tensor | None, Tensor | None]:
        """A BatchNorm layer's running-average ``[C, 3]`` blocks ``(F_γγ, F_γβ, F_ββ)`` and
        their damped inverses (None before the first update)."""
        if self._batchnorm is None or name not in self._batchnorm.names:
            raise KeyError(f"{name!r} is not a BatchNorm layer with curvature")
        return self._batchnorm.blocks(name)

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

    def _capture_batchnorm(
        self, name: str, module: nn.Module, inputs: Tensor, grad: Tensor
    ) -> None:
        assert self._batchnorm is not None
        with (
            self.profiler.span(span_name("factor_compute", f"{name}/BN")),
            _no_autocast(grad),
        ):
            # The same corrections as G: the block entries are products of two gradients.
            scale = float(self.config.accumulation_steps**2)
            if self._grad_scaler is not None:
                if self._grad_scale is None:
                    self._grad_scale = float(self._grad_scaler.get_scale())
                scale /= self._grad_scale * self._grad_scale
            self._batchnorm.capture(name, module, inputs, grad, scale)

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
        normalization = {} if self._batchnorm is None else self._batchnorm.gradients()
        usable = _all_finite([*gradients.values(), *normalization.values()])
        if self.config.is_factor_step(step):
            usable = self._update_factors(local_ok=usable) and usable
        elif self._communicator.world_size > 1:
            # Gradients need not be replicated (no DDP): skip on every rank or on none.
            flag = torch.tensor([0.0 if usable else 1.0], device=self._communicator.device)
            usable = float(self._communicator.all_reduce_max(flag).wait()) == 0.0
        if self.config.is_inverse_step(step):
            self._update_inverses(self.config.damping_at(step))
            if self._batchnorm is not None:
                with self.profiler.span(span_name("inverse_compute", "batchnorm")):
                    self._batchnorm.update_inverses(self.config.batchnorm_damping_at(step))
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
        normalized: dict[str, Tensor] = {}
        if self._batchnorm is not None:
            with self.profiler.span(span_name("precondition", "batchnorm")):
                normalized = self._batchnorm.precondition(normalization)
        with self.profiler.span(span_name("precondition", "kl_clip")):
            # BatchNorm and Linear/Conv names are different modules, so the keys are unique.
            scale = self._kl_clip_scale(
                {**gradients, **normalization}, {**preconditioned, **normalized}, step
            )
            if scale is None:
                return self._skip()
            for name, matrix in preconditioned.items():
                state = self._layers[name]
                state.adapter.set_gradient(
                    state.module, matrix.mul_(scale) if scale != 1.0 else matrix
                )
            for name, matrix in normalized.items():
                assert self._batchnorm is not None
                self._batchnorm.set_gradient(name, matrix.mul_(scale) if scale != 1.0 else matrix)
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
        if self._batchnorm is not None:
            local_ok = local_ok and self._batchnorm.pending_finite()
        new = self._global_contributions(local_ok)
        normalization: dict[str, Tensor | None] = {}
        if self._batchnorm is not None:
            # Issued on every factor step after the factor exchange, whatever was captured.
            with self.profiler.span(span_name("factor_comm", "batchnorm")):
                normalization = self._batchnorm.reduce_pending(self._communicator)
        for state in self._layers.values():
            state.clear_pending()
        if new is None or not _all_finite(v for v in normalization.values() if v is not None):
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
            if self._batchnorm is not None:
                self._batchnorm.absorb(normalization, decay)
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
        } | ({} if self._batchnorm is None else {"batchnorm": self._batchnorm.state_dict()})

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; the layers must match exactly.

        Raises:
            ValueError: When the format, the registered layers or a factor shape differ.
        """
        if state_dict.get("format") != _STATE_FORMAT:
            raise ValueError(
                f"state_dict format {state_dict.get('format')!r} is not {_STATE_FORMAT}"
            )
        saved_batchnorm = state_dict.get("batchnorm")
        if (saved_batchnorm is None) != (self._batchnorm is None):
            raise ValueError(
                "state_dict and preconditioner disagree on BatchNorm curvature: saved "
                f"{'none' if saved_batchnorm is None else saved_batchnorm.get('mode')!r}, "
                f"batchnorm={self.config.batchnorm!r} with "
                f"{len(self.batchnorm_layers)} BatchNorm layers"
            )
        restored = (
            None
            if self._batchnorm is None or saved_batchnorm is None
            else self._batchnorm.check_state(saved_batchnorm)
        )
        load_layer_states(self._layers, state_dict["layers"])
        if self._batchnorm is not None and restored is not None:
            self._batchnorm.restore(restored)
        self._step = int(state_dict["steps"])
        self._skipped_steps = int(state_dict.get("skipped_steps", 0))
        self._forward_order = [n for n in state_dict.get("forward_order", []) if n in self._layers]

    def remove(self) -> None:
        """Remove every hook this preconditioner installed; the model is left as it was."""
        self._capture.remove()
        if self._batchnorm_capture is not None:
            self._batchnorm_capture.remove()
        for state in self._layers.values():
            state.clear_pending()
        if self._batchnorm is not None:
            self._batchnorm.clear_pending()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layers={len(self._layers)}, steps={self._step}, "
            f"world_size={self._communicator.world_size}, config={self.config})"
        )
