"""``KFACPreconditioner``: the step as the paper's phases in order, each a call."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import torch
from torch import Tensor, nn

from spdkfac.comm import BucketLaunches, Communicator, make_communicator
from spdkfac.config import KFACConfig, resolve_config
from spdkfac.costmodel import CostModel
from spdkfac.engine.agreement import (
    check_runtime_arguments,
    discover_agreed_blocks,
    shared_cost_model,
)
from spdkfac.engine.assembly import Assembler, Stages
from spdkfac.engine.autotune import AutoChoice, AutoTuner
from spdkfac.engine.clip import LearningRates
from spdkfac.engine.final import EngineParts
from spdkfac.engine.guard import GradientGuard, ModelClaim, warn_uncaptured
from spdkfac.engine.staging import apply_staged
from spdkfac.engine.state import Counters, StateKeeper
from spdkfac.layout import layout_of
from spdkfac.planning.fusion import FusionPlan
from spdkfac.planning.placement import Plan
from spdkfac.planning.schedule import CommSchedule
from spdkfac.profiling import Phase, Profiler, span_name
from spdkfac.strategies import Strategy
from spdkfac.support.signature import signature_with_options

__all__ = ["KFACPreconditioner"]

_LOG = logging.getLogger("spdkfac")
_OPTIONS = frozenset(option.name for option in fields(KFACConfig))


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
        optimizer: The optimizer that applies the update: the KL clip then uses the
            learning rate of each layer's parameter group at every step (schedulers
            included) unless the ``lr`` option is given.
        profile: Record ``kfac/<phase>/<layer>`` spans in :attr:`profiler` (off: no cost).
        **options: The fields of :class:`~spdkfac.KFACConfig` (``damping``, ``lr``,
            ``strategy``, …), documented there once.

    Raises:
        ValueError: On an invalid option (naming it and its value), a model without any
            supported layer or preconditioned by another one not ``remove()``d yet, a
            process group this rank is not in, or ranks that disagree on the options or
            the registered layers (raised on every rank).
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
        optimizer: torch.optim.Optimizer | None = None,
        profile: bool = False,
        **options: Any,
    ) -> None:
        check_runtime_arguments(model, grad_scaler, optimizer, profile, cost_model)
        self.config = resolve_config(config, options)
        self._communicator: Communicator = make_communicator(process_group)
        layout = layout_of(model)
        self._model = layout.module
        self._claim = ModelClaim(self._model, f"the KFACPreconditioner at {id(self):#x}")
        first = next(self._model.parameters(), None)
        self.profiler = Profiler(
            enabled=profile,
            rank=self._communicator.rank,
            device=None if first is None else first.device,
        )
        self._blocks = discover_agreed_blocks(self._communicator, self._model, self.config)
        self._rates = LearningRates(optimizer, self._blocks, self.config)
        self._guard = GradientGuard(self._blocks)
        self._warned_empty = False
        self._counters = Counters()
        self._state = StateKeeper(self._blocks, self._communicator)
        parts = EngineParts(
            self._blocks,
            self._communicator,
            layout,
            shared_cost_model(self._communicator, cost_model),
            self.profiler,
            enabled=lambda: self.config.is_factor_step(self._counters.step),
            grad_scale=None if grad_scaler is None else lambda: float(grad_scaler.get_scale()),
        )
        self._auto = AutoTuner.of(self.config, self._communicator)
        self._assembler = Assembler(parts, self.config)
        self._stages: Stages = self._assembler.build(self.config.composition, self.config)
        self._claim.take()

    # ------------------------------------------------------------------ introspection
    @property
    def layers(self) -> list[str]:
        """Kronecker-factored module names in forward order (definition order until seen)."""
        seen = self._state.seen_layers(self._stages)
        return seen + [name for name in self._state.kronecker() if name not in seen]

    @property
    def strategy_choice(self) -> AutoChoice | None:
        """What ``strategy="auto"`` chose (None before it decides, and for a named strategy)."""
        return None if self._auto is None else self._auto.choice

    @property
    def composition(self) -> str:
        """Name of the composition in use (the row ``auto`` is trying or chose)."""
        return self._stages.composition.name

    @property
    def plan(self) -> Plan:
        """Where each factor is inverted (see :mod:`spdkfac.planning.placement`)."""
        return self._stages.inverses.plan

    @property
    def comm_schedule(self) -> CommSchedule | None:
        """The order ``comm_scheduler="priority"`` issues a factor step's gradient and
        factor chunks in (None before it is planned, or without a scheduler)."""
        scheduler = self._assembler.scheduler
        return None if scheduler is None else scheduler.schedule

    @property
    def gradient_launches(self) -> BucketLaunches | None:
        """Launch times of DDP's gradient buckets when the preconditioner owns their
        communication (``strategy="osawa"``, or ``"auto"`` trying it, under DDP), for
        profiling; else None."""
        hooks = self._assembler.hooks
        return hooks.launches if hooks is not None else self._stages.final.launches

    @property
    def communicator(self) -> Communicator:
        """The group factors and inverses are exchanged over."""
        return self._communicator

    @property
    def steps(self) -> int:
        """Number of completed :meth:`step` calls (including skipped ones)."""
        return self._counters.step

    @property
    def skipped_steps(self) -> int:
        """Number of :meth:`step` calls that skipped the update on non-finite values."""
        return self._counters.skipped

    def factors(self, name: str) -> tuple[Tensor | None, Tensor | None]:
        """The running-average (A, G) of a registered layer (None before the first update)."""
        a_factor, g_factor = self._state.kronecker()[name].factors()
        return a_factor, g_factor

    def inverses(self, name: str) -> tuple[Tensor | None, Tensor | None]:
        """The damped inverses (Â, Ĝ) of a registered layer (None before the first one)."""
        a_inverse, g_inverse = self._state.kronecker()[name].inverses()
        return a_inverse, g_inverse

    @property
    def batchnorm_layers(self) -> list[str]:
        """Normalization layers given curvature (BatchNorm, GroupNorm, LayerNorm, RMSNorm;
        empty unless ``normalization`` or ``batchnorm`` is set; the name is older)."""
        return list(self._state.normalization())

    def batchnorm_blocks(self, name: str) -> tuple[Tensor | None, Tensor | None]:
        """A normalization layer's running-average ``[P, 3]`` blocks ``(F_γγ, F_γβ, F_ββ)``
        and their damped inverses (None before the first update)."""
        block = self._state.normalization().get(name)
        if block is None:
            raise KeyError(f"{name!r} is not a normalization layer with curvature")
        return block.factors()[0], block.inverses()[0]

    @property
    def fusion_plan(self) -> FusionPlan | None:
        """The factor buckets in use (None with a single rank: nothing is exchanged)."""
        return self._stages.collector.fusion_plan

    def replan_fusion(self) -> None:
        """Re-plan the ``optimal`` fusion from fresh measurements after the next factor step.

        Call it on every rank at the same step (it leads to a collective).
        """
        self._stages.collector.request_replan()

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

        Raises:
            ValueError: A registered layer's parameters were replaced since construction
                (e.g. ``fully_shard`` applied afterwards).
            RuntimeError: Called again without a new backward pass.
        """
        self._guard.check()
        with self.profiler.span(span_name(Phase.STEP)):
            step = self._counters.step
            self._counters.step += 1
            applied = self._precondition(step)
        if self._auto is not None and not self._auto.decided:
            self._tune(step)
        return applied

    def _precondition(self, step: int) -> bool:
        stages = self._stages
        stages.collector.new_step()
        gradients, usable = stages.final.collect()
        if self.config.is_factor_step(step):
            usable = self._update_factors(local_ok=usable) and usable
        else:
            usable = stages.final.agree(usable)
        if self.config.is_inverse_step(step) or self._counters.stale_inverses:
            self._counters.stale_inverses = False
            stages.inverses.run(self._blocks, self.config.damping_at(step))
        kl_clip = self.config.kl_clip_at(step)
        rates = self._rates.at(self.config, step)
        if not apply_staged(stages.final, gradients, rates, kl_clip, usable):
            self._counters.skipped += 1
            return False
        self._guard.record()
        return True

    def _tune(self, step: int) -> None:
        """``strategy="auto"``: time the step; switch compositions where the trials say."""
        assert self._auto is not None
        settled = self._stages.collector.fusion_settled
        following = self._auto.after_config_step(step, self.config, settled=settled)
        if following is not None and following.name != self.composition:
            self._switch(following)
        if self._auto.wants_probe(self.config.intervals_at(step)[1]):
            damping = self.config.damping_at(step)
            self._auto.probe(lambda: self._state.discarded_inverse_phase(self._stages, damping))
        if self._auto.choice is not None and self._communicator.rank == 0:
            _LOG.info("%s", self._auto.choice.describe())
        self._auto.started()

    def _update_factors(self, *, local_ok: bool) -> bool:
        """Exchange and absorb this step's statistics (False: some rank saw non-finite
        values, no factor changed anywhere)."""
        decay = self.config.factor_decay_at(self._counters.step - 1)
        if not self._stages.collector.update(local_ok=local_ok, decay=decay):
            return False
        if not self._warned_empty:
            self._warned_empty = True
            warn_uncaptured(self._stages.final.held())
        return True

    # ------------------------------------------------------------------ state
    def state_dict(self, *, inverses: bool = True) -> dict[str, Any]:
        """Factors, inverses and counters, as a dict of copies (safe to ``torch.save``).

        It holds every layer's factors and inverses (any rank's resumes any world size);
        with ``strategy="osawa"`` it gathers them from their owners, a collective (for
        sharded state see :meth:`dcp_state_dict`). ``inverses=False`` leaves the inverses
        out (about half the size): loading it recomputes them at the next step.
        With ``strategy="auto"`` it records the choice and the world size it was made for.
        """
        return self._state.save(self._stages, self._counters, self.config, self._auto, inverses)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; the layers must match exactly.

        With ``strategy="auto"``, a choice saved at the same world size is kept (no new
        trials); after a world-size change the trials run again. Another form's state dict
        loads its factors (inverses of another kind are recomputed, moments start fresh).

        Raises:
            ValueError: When the format, the registered layers or a factor shape differ.
        """
        state_dict = self._state.checked(state_dict, self.config)
        saved = state_dict.get("auto")
        if self._auto is not None and saved is not None:
            if saved["world_size"] == self._communicator.world_size:
                self._auto.adopt(saved["chosen"], int(state_dict["steps"]))
            if self._auto.current.name != self.composition:
                self._rebuild(self._auto.current)
        self._state.load(state_dict, self._stages, self._counters, self.config)

    def dcp_state_dict(self, *, inverses: bool = True) -> dict[str, Any]:
        """This rank's state for ``torch.distributed.checkpoint``, also the template a fresh
        preconditioner loads into (no collective; see docs/distributed.md)."""
        return self._state.dcp(self._stages, self._counters, self.config, self._auto, inverses)

    def load_dcp_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """:meth:`load_state_dict` of the :meth:`dcp_state_dict` ``dcp.load`` filled."""
        self.load_state_dict(self._state.from_dcp(state_dict))

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the factors and of the inverses this rank holds (live tensors)."""
        return self._state.memory_bytes()

    def _rebuild(self, composition: Strategy) -> None:
        """Use ``composition``'s stages from the next step on (no collective)."""
        self._stages.collector.remove()
        self._stages = self._assembler.build(composition, self.config)

    def _switch(self, composition: Strategy) -> None:
        """Move to ``composition``'s stages, keeping every factor and inverse (collective:
        an owner-computes composition gathers its owners' state)."""
        state = self.state_dict()
        self._rebuild(composition)
        self.load_state_dict(state)

    # ------------------------------------------------------------------ options
    def update_config(self, **options: Any) -> None:
        """Change hyperparameters from the next step on (``damping``, ``factor_decay``,
        ``factor_update_steps``, ``inv_update_steps``, ``kl_clip``, ``lr``,
        ``batchnorm_damping_multiplier``, ``max_inverse_failures``); validated like the
        constructor's. Call it on every rank with the same values.

        Raises:
            ValueError: An invalid value, or an option that cannot change after
                construction (build a new preconditioner for those).
        """
        self.config = self.config.updated(options)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OPTIONS:
            raise AttributeError(
                f"{name!r} is an option of the preconditioner's frozen config: use "
                f"precond.update_config({name}=...) (or a callable of the step)"
            )
        super().__setattr__(name, value)

    def retune(self) -> None:
        """``strategy="auto"``: run the trials again from the next step (e.g. after the
        machine's load changed). Call it on every rank at the same step (a collective).

        Raises:
            ValueError: When the strategy is not ``"auto"``.
        """
        if self._auto is None:
            raise ValueError(f"retune() needs strategy='auto', not {self.config.strategy!r}")
        self._auto = AutoTuner.of(self.config, self._communicator)
        assert self._auto is not None
        if self._auto.current.name != self.composition:
            self._switch(self._auto.current)

    def remove(self) -> None:
        """Remove every hook installed and release the process groups created (on every
        rank, after the last step); the model is left as it was (DDP's own hook all-reduces
        again), another preconditioner may be built on it; :meth:`step` then raises
        ``RuntimeError``, a second ``remove()`` does nothing."""
        if self._guard.removed:
            return
        self._stages.collector.remove()
        self._assembler.close()
        self._guard.removed = True
        self._claim.release()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layers={len(self._blocks)}, steps={self._counters.step}, "
            f"world_size={self._communicator.world_size}, config={self.config})"
        )


KFACPreconditioner.__signature__ = signature_with_options(  # type: ignore[attr-defined]
    KFACPreconditioner.__init__, KFACConfig
)
