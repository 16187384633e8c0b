"""``KFACConfig``: the one definition of the preconditioner's options, frozen and validated."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import Any, get_args

import torch

from spdkfac.comm.pipeline import ExchangeSettings
from spdkfac.curvature.collector import CollectorSettings
from spdkfac.curvature.discovery import BlockSettings
from spdkfac.forms import FormMethod, GraftingName, InverseForm, inverse_form
from spdkfac.layers import FactorOptions
from spdkfac.planning.schedule import SCHEDULER_POLICIES
from spdkfac.schedules import resolve_float, resolve_interval
from spdkfac.strategies import AUTO_CANDIDATES, STRATEGIES, AutoStrategy, Strategy
from spdkfac.support.checks import (
    check_candidates,
    check_choice,
    check_int,
    check_number,
    check_skip_layers,
)
from spdkfac.types import (
    CommSchedulerName,
    FactorExchangeName,
    FloatSchedule,
    IntSchedule,
    NormalizationMode,
    PlacementName,
    SkipEntry,
    StrategyName,
    WeightSharing,
)

__all__ = [
    "MUTABLE_OPTIONS",
    "KFACConfig",
    "resolve_config",
]

#: Choices of the dtype options (None: the default of each).
_DTYPES = (None, torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: Options that may change during training (:meth:`KFACConfig.updated`).
MUTABLE_OPTIONS = (
    "damping",
    "factor_decay",
    "factor_update_steps",
    "inv_update_steps",
    "kl_clip",
    "lr",
    "batchnorm_damping_multiplier",
    "max_inverse_failures",
)


@dataclass(frozen=True, kw_only=True)
class KFACConfig:
    """Options of :class:`~spdkfac.KFACPreconditioner`; validated on construction.

    ``KFACPreconditioner(model, **options)`` and ``KFACPreconditioner(model,
    config=KFACConfig(**options))`` are the same. Callables are functions of the
    preconditioner's step counter (the number of completed ``step()`` calls) and are
    validated each time they are evaluated. A refresh interval ``k`` fires on the steps
    where ``step % k == 0`` (so step 0 always refreshes). Invalid values raise
    ``ValueError`` naming the option and the value.

    Attributes:
        damping: γ added to a copy of each factor's diagonal before inversion (float > 0
            or callable of the step; default 0.1: docs/cli.md, "Defaults").
        factor_decay: ξ in ``F ← ξ·F + (1−ξ)·F_new``, in (0, 1] (float or callable).
        factor_update_steps: Interval between factor updates (int >= 1 or callable).
        inv_update_steps: Interval between inverse updates (int >= 1 or callable; 10).
        kl_clip: κ of the KL clip (float > 0 or callable), or None to disable it.
        lr: Learning rate η used by the KL clip (float or callable). None (default): the
            rate of each layer's parameter group in the ``optimizer`` given to the
            preconditioner, read at every step; 0.1, with a warning, without one.
        inverse_method: ``"cholesky"`` or ``"eigen"`` (both compute each factor's
            ``(F + γI)⁻¹``), or ``"eigen-basis"`` (each factor's eigendecomposition, the
            damping added to the Kronecker product's eigenvalues, as KAISA's eigen
            method); for transformers ``"eigen-adam"`` (Adam's moments in the factors'
            eigen-bases, SOAP's recipe; a full update direction: step it with momentum-free
            SGD, ``kl_clip=None``) or ``"one-sided"`` (A's damped inverse alone, damping
            relative to A's mean eigenvalue; then ``torch.optim.Muon``): see
            :mod:`spdkfac.forms`.
        grafting: ``"sgd"`` or ``"adam"``: each layer's preconditioned gradient rescaled to
            the norm of SGD's step (the gradient) or Adam's (``∇/(√v̂+ε)``, its second
            moment kept per layer), so the form gives the direction and the grafted method
            the step size (:mod:`spdkfac.forms.graft`); None (default): no grafting.
        inverse_dtype: Dtype inverses (or eigen-bases) are stored, broadcast and applied
            in, e.g. ``torch.bfloat16`` (decompositions run in float32); None: float32
            (float64 for a float64 model).
        factor_dtype: Dtype the running factors are stored in; None: float32 (float64 for
            a float64 model). Statistics are computed and averaged over ranks as before.
        skip_layers: Module names (a name also skips its children), ``"re:<pattern>"``
            (names the regular expression matches whole), class names (``"Embedding"``)
            or module types.
        strategy: ``"spd-kfac"`` (default), ``"mpd-kfac"``, ``"d-kfac"``, ``"osawa"`` or
            ``"layer-paths"`` (each layer osawa's way or SPD-KFAC's, whichever the cost
            model prices lower): a row of :data:`spdkfac.strategies.STRATEGIES`; or
            ``"auto"``: the fastest of
            ``auto_candidates``, measured during the first refresh cycles
            (:mod:`spdkfac.engine.autotune`; not with the ``placement`` / ``factor_exchange``
            overrides).
        auto_candidates: The rows of :data:`~spdkfac.strategies.STRATEGIES` ``"auto"``
            tries, in order.
        auto_trial_steps: Fewest timed steps per candidate and round (rounded up to whole
            refresh cycles).
        auto_rounds: Most rounds of trials: after each, the candidates within 5 % of the
            fastest run again and pool their samples (1: each runs once).
        placement: Overrides the strategy's inverse placement (``"replicated"``,
            ``"round-robin"``, ``"balanced"`` or ``"layer-owners"``; ``"osawa"`` needs
            the last); None keeps the strategy's.
        factor_options: How factors are computed (method, compute dtype); see
            :class:`~spdkfac.layers.FactorOptions`.
        factor_exchange: Overrides the strategy's fusion policy (``"after-backward"``,
            ``"layerwise"``, ``"threshold"``, ``"optimal"`` or ``"dp"``); None keeps the
            strategy's.
        bucket_cap_mb: Bucket cap of the ``threshold`` and ``after-backward`` policies.
        fusion_warmup_steps: Factor steps measured before the ``optimal`` plan is made.
        comm_scheduler: ``"fifo"`` (gradient and factor buckets on separate process
            groups, each in its own order) or ``"priority"`` (during a pipelined factor
            exchange both on one group, in one order where gradients preempt factors chunk
            by chunk; PACE, INFOCOM 2020): see :mod:`spdkfac.planning.schedule`.
        factor_comm_dtype: Dtype factors travel in (e.g. ``torch.bfloat16``); running
            averages stay in float32. None: the factors' own dtype.
        accumulation_steps: Forward/backward passes per ``step()`` (gradient
            accumulation). Factors are exchanged once, after the last pass; each pass's
            loss is assumed divided by ``accumulation_steps``, as in the usual recipe.
        max_inverse_failures: Consecutive inverse updates with a failed inversion that are
            tolerated (the previous inverse is kept); one more raises on every rank.
        weight_sharing: How layers applied at many positions of each example (sequence
            models, convolutions) are factored (Eschenhagen et al., NeurIPS 2023):
            ``"expand"`` (default: every position is an example) or ``"reduce"`` (inputs
            averaged and output gradients summed over positions first; factor cost
            independent of the sequence length). Embeddings always expand.
        normalization: Curvature for the scale and shift of every normalization layer
            (BatchNorm, GroupNorm, LayerNorm, RMSNorm; Osawa et al. 2019 for BatchNorm):
            ``"diagonal"``, ``"unit-wise"`` (each unit's 2×2 block over (γ, β)) or None
            (plain gradient, the default).
        batchnorm: The same for BatchNorm layers only (the older form of
            ``normalization``, kept); when both are set they must agree.
        batchnorm_damping_multiplier: ρ: normalization blocks (all kinds) are damped with
            ρ·γ (Osawa et al. use ρ > 1 for BatchNorm; their code's default is 16).
    """

    damping: FloatSchedule = 0.1
    factor_decay: FloatSchedule = 0.95
    factor_update_steps: IntSchedule = 1
    inv_update_steps: IntSchedule = 10
    kl_clip: FloatSchedule | None = 0.001
    lr: FloatSchedule | None = None
    inverse_method: FormMethod = "cholesky"
    grafting: GraftingName | None = None
    inverse_dtype: torch.dtype | None = None
    factor_dtype: torch.dtype | None = None
    skip_layers: tuple[SkipEntry, ...] = field(default=())
    strategy: StrategyName = "spd-kfac"
    auto_candidates: tuple[str, ...] = AUTO_CANDIDATES
    auto_trial_steps: int = 10
    auto_rounds: int = 2
    placement: PlacementName | None = None
    factor_options: FactorOptions = field(default_factory=FactorOptions)
    factor_exchange: FactorExchangeName | None = None
    bucket_cap_mb: float = 64.0
    fusion_warmup_steps: int = 5
    factor_comm_dtype: torch.dtype | None = None
    comm_scheduler: CommSchedulerName = "fifo"
    accumulation_steps: int = 1
    max_inverse_failures: int = 3
    weight_sharing: WeightSharing = "expand"
    normalization: NormalizationMode | None = None
    batchnorm: NormalizationMode | None = None
    batchnorm_damping_multiplier: float = 1.0

    def __post_init__(self) -> None:
        # Checked values are stored as the plain Python numbers the checks return (a numpy
        # scalar or a 0-d tensor is a number to a user, but not to TOML or weights_only).
        plain = partial(object.__setattr__, self)
        if not callable(self.damping):
            plain("damping", check_number("damping", self.damping))
        if self.lr is not None and not callable(self.lr):
            plain("lr", check_number("lr", self.lr, low_inclusive=True))
        if not callable(self.factor_decay):
            plain("factor_decay", check_number("factor_decay", self.factor_decay, high=1.0))
        for name in ("factor_update_steps", "inv_update_steps"):
            value = getattr(self, name)
            if not callable(value):
                plain(name, check_int(name, value))
        if self.kl_clip is not None and not callable(self.kl_clip):
            plain("kl_clip", check_number("kl_clip", self.kl_clip))
        self.inverse_form  # noqa: B018 (raises ValueError naming a bad inverse_method or grafting)
        if self.inverse_method == "eigen-adam" and self.kl_clip is not None:
            raise ValueError(
                f"kl_clip must be None with inverse_method='eigen-adam' (got {self.kl_clip!r}): "
                "its direction carries Adam's own scale, which the KL clip would rescale"
            )
        check_choice("inverse_dtype", self.inverse_dtype, _DTYPES)
        check_choice("factor_dtype", self.factor_dtype, _DTYPES)
        object.__setattr__(self, "skip_layers", check_skip_layers(self.skip_layers))
        check_choice("strategy", self.strategy, get_args(StrategyName))
        object.__setattr__(
            self, "auto_candidates", check_candidates(self.auto_candidates, STRATEGIES)
        )
        plain("auto_trial_steps", check_int("auto_trial_steps", self.auto_trial_steps))
        plain("auto_rounds", check_int("auto_rounds", self.auto_rounds))
        if not isinstance(self.factor_options, FactorOptions):
            raise ValueError(f"factor_options must be a FactorOptions, got {self.factor_options!r}")
        if self.factor_exchange is not None:
            check_choice("factor_exchange", self.factor_exchange, get_args(FactorExchangeName))
        plain("bucket_cap_mb", check_number("bucket_cap_mb", self.bucket_cap_mb))
        for name in ("fusion_warmup_steps", "accumulation_steps"):
            plain(name, check_int(name, getattr(self, name)))
        plain(
            "max_inverse_failures",
            check_int("max_inverse_failures", self.max_inverse_failures, low=0),
        )
        check_choice("factor_comm_dtype", self.factor_comm_dtype, _DTYPES)
        check_choice("comm_scheduler", self.comm_scheduler, get_args(CommSchedulerName))
        if self.placement is not None:
            check_choice("placement", self.placement, get_args(PlacementName))
        check_choice("weight_sharing", self.weight_sharing, get_args(WeightSharing))
        for name in ("normalization", "batchnorm"):
            if getattr(self, name) is not None:
                check_choice(name, getattr(self, name), get_args(NormalizationMode))
        self.composition  # noqa: B018 (raises ValueError on an incompatible override)
        if None not in (self.normalization, self.batchnorm) and (
            self.normalization != self.batchnorm
        ):
            raise ValueError(
                f"normalization={self.normalization!r} and batchnorm={self.batchnorm!r} "
                "disagree: set one of them"
            )
        multiplier = check_number("batchnorm_damping_multiplier", self.batchnorm_damping_multiplier)
        plain("batchnorm_damping_multiplier", multiplier)

    @property
    def selection(self) -> Strategy | AutoStrategy:
        """What ``strategy`` selects: a row with the overrides applied, or, for
        ``"auto"``, an :class:`~spdkfac.strategies.AutoStrategy` of its candidate rows
        (``comm_scheduler="priority"`` applies to every one; a ``+priority`` row keeps its
        scheduler). The one place the option's text is read.

        Raises:
            ValueError: ``"auto"`` with a ``factor_exchange`` or ``placement`` override.
        """
        if self.strategy == "auto":
            overrides = {"factor_exchange": self.factor_exchange, "placement": self.placement}
            given = {name: value for name, value in overrides.items() if value is not None}
            if given:
                raise ValueError(
                    f"strategy='auto' chooses the factor exchange and the placement itself: "
                    f"remove {given}, or name a strategy"
                )
            priority = SCHEDULER_POLICIES[self.comm_scheduler].orders_traffic
            scheduler = self.comm_scheduler if priority else None
            return AutoStrategy(
                tuple(
                    STRATEGIES[name].with_overrides(comm_scheduler=scheduler)
                    for name in self.auto_candidates
                )
            )
        return STRATEGIES[self.strategy].with_overrides(
            factor_exchange=self.factor_exchange,
            placement=self.placement,
            comm_scheduler=self.comm_scheduler,
        )

    @property
    def composition(self) -> Strategy:
        """The strategy row a preconditioner of these options starts with (for
        ``"auto"``: its first candidate)."""
        return self.selection.first

    @property
    def norm_mode(self) -> NormalizationMode | None:
        """The normalization-curvature mode in effect (saved with the state)."""
        return self.normalization if self.normalization is not None else self.batchnorm

    @property
    def block_settings(self) -> BlockSettings:
        """What layer discovery needs from these options."""
        return BlockSettings(
            factor_options=self.factor_options,
            weight_sharing=self.weight_sharing,
            normalization=self.normalization,
            batchnorm=self.batchnorm,
            norm_damping_multiplier=self.batchnorm_damping_multiplier,
            form=self.inverse_form,
            factor_dtype=self.factor_dtype,
        )

    @property
    def collector_settings(self) -> CollectorSettings:
        """What the factor collector and its exchange need from these options."""
        return CollectorSettings(
            accumulation_steps=self.accumulation_steps,
            examples=self.factor_options.examples,
            exchange=ExchangeSettings(
                bucket_cap_bytes=int(self.bucket_cap_mb * 2**20),
                warmup_steps=self.fusion_warmup_steps,
                comm_dtype=self.factor_comm_dtype,
            ),
        )

    @property
    def inverse_form(self) -> InverseForm:
        """What the inverse phase computes (``inverse_method`` in ``inverse_dtype``), and
        how it preconditions (grafted when ``grafting`` is set)."""
        return inverse_form(
            self.inverse_method, self.inverse_dtype, self.grafting, self.factor_dtype
        )

    def updated(self, options: Mapping[str, Any]) -> KFACConfig:
        """These options with ``options`` changed; only :data:`MUTABLE_OPTIONS` may change.

        Raises:
            ValueError: An invalid value or an option that cannot change after construction.
            TypeError: An unknown option.
        """
        fixed = sorted(set(options) & {f.name for f in fields(self)} - set(MUTABLE_OPTIONS))
        if fixed:
            raise ValueError(
                f"options {fixed} cannot change after construction; the ones that can are "
                f"{list(MUTABLE_OPTIONS)}"
            )
        return resolve_config(self, options)

    def fingerprint(self) -> str:
        """A text that is equal on two ranks iff their options are (callables by name)."""
        parts = []
        for option in fields(self):
            value = getattr(self, option.name)
            if callable(value) and not isinstance(value, type):
                value = f"callable:{getattr(value, '__qualname__', type(value).__name__)}"
            elif option.name == "skip_layers":
                value = tuple(v if isinstance(v, str) else v.__qualname__ for v in value)
            parts.append(f"{option.name}={value!r}")
        return ";".join(parts)

    def damping_at(self, step: int) -> float:
        """Damping γ at ``step``."""
        return resolve_float("damping", self.damping, step, allow_zero=False)

    def lr_at(self, step: int) -> float:
        """Learning rate η used by the KL clip at ``step`` (0.1 when unset)."""
        return resolve_float("lr", 0.1 if self.lr is None else self.lr, step, allow_zero=True)

    def factor_decay_at(self, step: int) -> float:
        """ξ at ``step``, in (0, 1]."""
        value = resolve_float("factor_decay", self.factor_decay, step, allow_zero=False)
        if value > 1.0:
            raise ValueError(f"factor_decay must be <= 1, got {value!r} at step {step}")
        return value

    def kl_clip_at(self, step: int) -> float | None:
        """κ at ``step`` (None: no clip)."""
        if self.kl_clip is None:
            return None
        return resolve_float("kl_clip", self.kl_clip, step, allow_zero=False)

    def intervals_at(self, step: int) -> tuple[int, int]:
        """The factor and inverse refresh intervals at ``step``."""
        return (
            resolve_interval("factor_update_steps", self.factor_update_steps, step),
            resolve_interval("inv_update_steps", self.inv_update_steps, step),
        )

    def is_factor_step(self, step: int) -> bool:
        """Whether factors are updated at ``step``."""
        return step % resolve_interval("factor_update_steps", self.factor_update_steps, step) == 0

    def is_inverse_step(self, step: int) -> bool:
        """Whether inverses are recomputed at ``step``."""
        return step % resolve_interval("inv_update_steps", self.inv_update_steps, step) == 0


def resolve_config(config: KFACConfig | None, options: Mapping[str, Any]) -> KFACConfig:
    """``config`` (default options when None) with the keyword ``options`` applied.

    Raises:
        ValueError: ``config`` is not a :class:`KFACConfig`, or an option is invalid.
        TypeError: An option that is not a field of :class:`KFACConfig`.
    """
    if config is not None and not isinstance(config, KFACConfig):
        raise ValueError(f"config must be a KFACConfig or None, got {config!r}")
    known = {option.name for option in fields(KFACConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"KFACPreconditioner got unexpected keyword arguments {unknown}; the options "
            f"are {sorted(known)}"
        )
    return replace(config, **options) if config is not None else KFACConfig(**options)
