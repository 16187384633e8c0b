"""``KFACPreconditioner``: the step as the paper's phases in order, each a call."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from spdkfac.agreement import check_agreement, shared_cost_model
from spdkfac.comm import Communicator, make_communicator
from spdkfac.comm.fusion import FusionPlan
from spdkfac.config import KFACConfig, constructor_signature, resolve_config
from spdkfac.costmodel import CostModel
from spdkfac.curvature import (
    CurvatureBlock,
    FactorCollector,
    blocks_state_dict,
    discover_blocks,
    load_blocks_state,
    unwrap_model,
)
from spdkfac.inversion import InversePhase
from spdkfac.placement import Plan
from spdkfac.profiling import Phase, Profiler, span_name

__all__ = ["KFACPreconditioner"]

_STATE_FORMAT = 1


def _all_finite(tensors: Iterable[Tensor]) -> bool:
    flags = [torch.isfinite(t).all() for t in tensors]
    return bool(torch.stack(flags).all()) if flags else True


class KFACPreconditioner:
    """K-FAC preconditioner of a model's layers, plain or data parallel.

    Call :meth:`step` after ``loss.backward()`` and before ``optimizer.step()``: it replaces
    each registered layer's gradient by the preconditioned gradient (for a Kronecker block
    ``V = (G + γI)⁻¹ ∇ (A + γI)⁻¹``), scaled by the KL clip, and advances its step counter.
    Works with any ``torch.optim`` optimizer.

    In a ``torch.distributed`` job (gradients averaged by ``DistributedDataParallel`` or
    otherwise), factors are averaged across ranks, weighted by each rank's examples, and
    inversions are placed by the strategy; every rank ends with the same preconditioned
    gradient that single-process K-FAC computes on the concatenated batch.

    Args:
        model: The model, plain or wrapped in ``DistributedDataParallel``.
        config: The options as a :class:`~spdkfac.KFACConfig`; keyword ``options`` given
            as well replace its fields.
        process_group: The ``torch.distributed`` group or a
            :class:`~spdkfac.comm.Communicator` (default: the world when initialized,
            else a group of one).
        cost_model: Costs the placement and fusion decide from: a ``CostModel``, or the
            path of a JSON written by ``spdkfac calibrate`` (default: constants measured on
            the project's reference machine). Rank 0's is used on every rank.
        grad_scaler: The ``torch.amp.GradScaler`` scaling the loss, if any: output-gradient
            statistics are unscaled by it. Call ``scaler.unscale_(optimizer)`` first.
        profile: Record ``kfac/<phase>/<layer>`` spans in :attr:`profiler` (off: no cost).
        **options: The fields of :class:`~spdkfac.KFACConfig` (``damping``, ``lr``,
            ``strategy``, …), documented there once.

    Raises:
        ValueError: On an invalid option (naming it and its value), a model without any
            supported layer, a process group this rank is not in, or ranks that disagree
            on the options or the registered layers (raised on every rank).
        TypeError: On an unknown keyword argument or a model that is not an ``nn.Module``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        config: KFACConfig | None = None,
        process_group: Any = None,
        cost_model: CostModel | str | os.PathLike[str] | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        profile: bool = False,
        **options: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
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
        self.config = resolve_config(config, options)
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
        self._blocks = self._discover_and_agree()
        self._step = 0
        self._skipped_steps = 0
        composition = self.config.composition
        assert composition.fusion is not None and composition.placement_policy is not None
        costs = shared_cost_model(self._communicator, cost_model)
        specs = [spec for block in self._blocks for spec in block.inverse_specs()]
        self._inverses = InversePhase(
            composition.placement_policy.plan(specs, self._communicator.world_size, costs),
            self._communicator,
            self.config.inverse_method,
            min_group_elements=costs.broadcast_group_elements()
            if composition.fuse_broadcasts
            else 0,
            max_failures=self.config.max_inverse_failures,
            profiler=self.profiler,
        )
        self._collector = FactorCollector(
            self._blocks,
            self._communicator,
            composition.fusion,
            enabled=lambda: self.config.is_factor_step(self._step),
            allreduce=costs.allreduce,
            accumulation_steps=self.config.accumulation_steps,
            bucket_cap_bytes=int(self.config.bucket_cap_mb * 2**20),
            fusion_warmup_steps=self.config.fusion_warmup_steps,
            comm_dtype=self.config.factor_comm_dtype,
            grad_scale=None if grad_scaler is None else lambda: float(grad_scaler.get_scale()),
            profiler=self.profiler,
        )

    def _discover_and_agree(self) -> list[CurvatureBlock]:
        """This rank's blocks, after every rank checked that all agree (a collective)."""
        try:
            blocks: list[CurvatureBlock] | None = discover_blocks(
                self._model,
                self.config.skip_layers,
                self.config.factor_options,
                normalization=self.config.batchnorm,
                normalization_damping_multiplier=self.config.batchnorm_damping_multiplier,
            )
            local_error: ValueError | None = None
        except ValueError as error:
            blocks, local_error = None, error
        check_agreement(self._communicator, self.config.fingerprint(), blocks, local_error)
        assert blocks is not None
        return blocks

    # ------------------------------------------------------------------ introspection
    def _section(self, section: str) -> dict[str, CurvatureBlock]:
        return {block.name: block for block in self._blocks if block.section == section}

    @property
    def layers(self) -> list[str]:
        """Kronecker-factored module names in forward order (definition order until seen)."""
        seen = self._seen_layers()
        return seen + [name for name in self._section("layers") if name not in seen]

    def _seen_layers(self) -> list[str]:
        """Kronecker-factored module names captured so far, in forward order."""
        registered = self._section("layers")
        return [name for name in self._collector.forward_order if name in registered]

    @property
    def plan(self) -> Plan:
        """Where each factor is inverted (see :mod:`spdkfac.placement`)."""
        return self._inverses.plan

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
        a_factor, g_factor = self._section("layers")[name].factors()
        return a_factor, g_factor

    def inverses(self, name: str) -> tuple[Tensor | None, Tensor | None]:
        """The damped inverses (Â, Ĝ) of a registered layer (None before the first one)."""
        a_inverse, g_inverse = self._section("layers")[name].inverses()
        return a_inverse, g_inverse

    @property
    def batchnorm_layers(self) -> list[str]:
        """BatchNorm layers given curvature (empty unless the ``batchnorm`` option is set)."""
        return list(self._section("batchnorm"))

    def batchnorm_blocks(self, name: str) -> tuple[Tensor | None, Tensor | None]:
        """A BatchNorm layer's running-average ``[C, 3]`` blocks ``(F_γγ, F_γβ, F_ββ)`` and
        their damped inverses (None before the first update)."""
        block = self._section("batchnorm").get(name)
        if block is None:
            raise KeyError(f"{name!r} is not a BatchNorm layer with curvature")
        return block.factors()[0], block.inverses()[0]

    @property
    def fusion_plan(self) -> FusionPlan | None:
        """The factor buckets in use (None with a single rank: nothing is exchanged)."""
        return self._collector.fusion_plan

    def replan_fusion(self) -> None:
        """Re-plan the ``optimal`` fusion from fresh measurements after the next factor step.

        Call it on every rank at the same step (it leads to a collective).
        """
        self._collector.request_replan()

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
        with self.profiler.span(span_name(Phase.STEP)):
            step = self._step
            self._step += 1
            self._collector.new_step()
            gradients = self._gradients()
            usable = _all_finite(gradients.values())
            if self.config.is_factor_step(step):
                usable = self._update_factors(local_ok=usable) and usable
            else:
                usable = self._agree_on_usable(usable)
            if self.config.is_inverse_step(step):
                self._inverses.run(self._blocks, self.config.damping_at(step))
            if not usable:
                return self._skip()
            preconditioned = self._precondition(gradients)
            if not self._apply(gradients, preconditioned, step):
                return self._skip()
            return True

    def _gradients(self) -> dict[str, Tensor]:
        """Every block's gradient matrix (blocks without a gradient are left out)."""
        return {
            block.name: grad for block in self._blocks if (grad := block.gradient()) is not None
        }

    def _update_factors(self, *, local_ok: bool) -> bool:
        """Exchange this step's statistics and fold them into the running averages.

        Returns:
            False when some rank saw non-finite values; then no factor changes anywhere.
        """
        new = self._collector.exchange(local_ok=local_ok)
        if new is None:
            return False
        decay = self.config.factor_decay
        with self.profiler.span(span_name(Phase.FACTOR_COMPUTE, "running_average")):
            for block in self._blocks:
                block.absorb(new, decay)
        return True

    def _agree_on_usable(self, usable: bool) -> bool:
        """Skip on every rank or on none: gradients need not be replicated (no DDP)."""
        if self._communicator.world_size == 1:
            return usable
        with self.profiler.span(span_name(Phase.FLAG_COMM, "skip")):
            flag = torch.tensor([0.0 if usable else 1.0], device=self._communicator.device)
            return float(self._communicator.all_reduce_max(flag).wait()) == 0.0

    def _precondition(self, gradients: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Each block's preconditioned gradient."""
        preconditioned = {}
        for block in self._blocks:
            if block.name in gradients:
                with self.profiler.span(span_name(Phase.PRECONDITION, block.name)):
                    preconditioned[block.name] = block.precondition(gradients[block.name])
        return preconditioned

    def _apply(
        self, gradients: Mapping[str, Tensor], preconditioned: Mapping[str, Tensor], step: int
    ) -> bool:
        """Scale by the KL clip and write back; False when the clip sum is not finite."""
        with self.profiler.span(span_name(Phase.PRECONDITION, "kl_clip")):
            scale = self._kl_clip_scale(gradients, preconditioned, step)
            if scale is None:
                return False
            for block in self._blocks:
                if block.name in preconditioned:
                    matrix = preconditioned[block.name]
                    block.set_gradient(matrix.mul_(scale) if scale != 1.0 else matrix)
        return True

    def _skip(self) -> bool:
        self._skipped_steps += 1
        return False

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
            "forward_order": self._seen_layers(),
            **blocks_state_dict(self._blocks, self.config.batchnorm),
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
        load_blocks_state(self._blocks, state_dict, self.config.batchnorm)
        self._collector.clear()
        self._step = int(state_dict["steps"])
        self._skipped_steps = int(state_dict.get("skipped_steps", 0))
        registered = self._section("layers")
        self._collector.forward_order[:] = [
            name for name in state_dict.get("forward_order", []) if name in registered
        ]

    def remove(self) -> None:
        """Remove every hook this preconditioner installed; the model is left as it was."""
        self._collector.remove()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layers={len(self._blocks)}, steps={self._step}, "
            f"world_size={self._communicator.world_size}, config={self.config})"
        )


KFACPreconditioner.__signature__ = constructor_signature(  # type: ignore[attr-defined]
    KFACPreconditioner.__init__
)
