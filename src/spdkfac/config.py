"""Frozen, validated configuration of the K-FAC preconditioner and schedule resolution."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from spdkfac.comm.fusion import FACTOR_EXCHANGES
from spdkfac.layers import FactorOptions
from spdkfac.layers.batchnorm import BATCHNORM_MODES
from spdkfac.linalg import INVERSE_METHODS
from spdkfac.placement import PLACEMENTS

__all__ = [
    "STRATEGIES",
    "FloatSchedule",
    "IntSchedule",
    "KFACConfig",
    "SkipEntry",
    "StrategyPreset",
    "resolve_float",
    "resolve_interval",
]

FloatSchedule = float | Callable[[int], float]
IntSchedule = int | Callable[[int], int]
SkipEntry = str | type[nn.Module]


@dataclass(frozen=True)
class StrategyPreset:
    """A distributed K-FAC algorithm as a composition of policies.

    Attributes:
        factor_exchange: When and how factors are all-reduced (a fusion policy of
            :mod:`spdkfac.comm.fusion`; ``"after-backward"``: all at ``step()``).
        placement: Inverse placement planner (see :mod:`spdkfac.placement`).
        fuse_broadcasts: Pack an owner's consecutive inverses into one broadcast until its
            bandwidth time outweighs the start-up time (cost model), instead of one
            broadcast per factor as in the SPD-KFAC paper.
    """

    factor_exchange: str
    placement: str
    fuse_broadcasts: bool = False


#: The named algorithms: D-KFAC (replicated inverses), MPD-KFAC (round-robin, every
#: inverse broadcast) and SPD-KFAC (load-balanced CT/NCT placement by a cost model).
STRATEGIES: dict[str, StrategyPreset] = {
    "d-kfac": StrategyPreset(factor_exchange="after-backward", placement="replicated"),
    "mpd-kfac": StrategyPreset(factor_exchange="after-backward", placement="round-robin"),
    "spd-kfac": StrategyPreset(
        factor_exchange="optimal", placement="balanced", fuse_broadcasts=True
    ),
}


def _check_positive_float(name: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return number


def _check_interval(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def resolve_float(name: str, schedule: FloatSchedule, step: int, *, allow_zero: bool) -> float:
    """Evaluate a float-or-callable hyperparameter at ``step`` and validate the result."""
    value = schedule(step) if callable(schedule) else schedule
    try:
        return _check_positive_float(name, value, allow_zero=allow_zero)
    except ValueError as error:
        if callable(schedule):
            raise ValueError(f"{error} (returned by the schedule at step {step})") from None
        raise


def resolve_interval(name: str, schedule: IntSchedule, step: int) -> int:
    """Evaluate an int-or-callable refresh interval at ``step`` and validate the result."""
    value = schedule(step) if callable(schedule) else schedule
    try:
        return _check_interval(name, value)
    except ValueError as error:
        if callable(schedule):
            raise ValueError(f"{error} (returned by the schedule at step {step})") from None
        raise


@dataclass(frozen=True, kw_only=True)
class KFACConfig:
    """Hyperparameters of :class:`~spdkfac.KFACPreconditioner`; validated on construction.

    Callables are functions of the preconditioner's step counter (the number of completed
    ``step()`` calls) and are validated each time they are evaluated. A refresh interval
    ``k`` fires on the steps where ``step % k == 0`` (so step 0 always refreshes).

    Attributes:
        damping: γ added to a copy of each factor's diagonal before inversion.
        factor_decay: ξ in ``F ← ξ·F + (1−ξ)·F_new``, in (0, 1].
        factor_update_steps: Interval between factor updates.
        inv_update_steps: Interval between inverse updates.
        kl_clip: κ of the KL clip, or None to disable it.
        lr: Learning rate η used by the KL clip (match the optimizer's).
        inverse_method: ``"cholesky"`` or ``"eigen"``; both compute (F + γI)⁻¹.
        skip_layers: Module names (a name also skips its children) or module types.
        strategy: ``"spd-kfac"``, ``"mpd-kfac"`` or ``"d-kfac"`` (see :data:`STRATEGIES`).
        placement: Overrides the strategy's inverse placement (``"replicated"``,
            ``"round-robin"`` or ``"balanced"``); None keeps the preset's.
        factor_options: How factors are computed (method, compute dtype); see
            :class:`~spdkfac.layers.FactorOptions`.
        factor_exchange: Overrides the strategy's fusion policy (``"after-backward"``,
            ``"layerwise"``, ``"threshold"`` or ``"optimal"``); None keeps the preset's.
        bucket_cap_mb: Bucket cap of the ``threshold`` and ``after-backward`` policies.
        fusion_warmup_steps: Factor steps measured before the ``optimal`` plan is made.
        factor_comm_dtype: Dtype factors travel in (e.g. ``torch.bfloat16``); running
            averages stay in float32. None: the factors' own dtype.
        accumulation_steps: Forward/backward passes per ``step()`` (gradient
            accumulation). Factors are exchanged once, after the last pass; each pass's
            loss is assumed divided by ``accumulation_steps``, as in the usual recipe.
        max_inverse_failures: Consecutive inverse updates with a failed inversion that are
            tolerated (the previous inverse is kept); one more raises on every rank.
        batchnorm: Curvature for the scale and shift of BatchNorm layers (Osawa et al.):
            ``"diagonal"`` (their approximation), ``"unit-wise"`` (each channel's 2×2
            block over (γ_c, β_c)) or None (plain gradient, the default).
        batchnorm_damping_multiplier: ρ_BN: BatchNorm blocks are damped with ρ_BN·γ
            (Osawa et al. use ρ_BN > 1; their code's default is 16).
    """

    damping: FloatSchedule = 0.003
    factor_decay: float = 0.95
    factor_update_steps: IntSchedule = 1
    inv_update_steps: IntSchedule = 1
    kl_clip: float | None = 0.001
    lr: FloatSchedule = 0.1
    inverse_method: str = "cholesky"
    skip_layers: tuple[SkipEntry, ...] = field(default=())
    strategy: str = "spd-kfac"
    placement: str | None = None
    factor_options: FactorOptions = field(default_factory=FactorOptions)
    factor_exchange: str | None = None
    bucket_cap_mb: float = 64.0
    fusion_warmup_steps: int = 5
    factor_comm_dtype: torch.dtype | None = None
    accumulation_steps: int = 1
    max_inverse_failures: int = 3
    batchnorm: str | None = None
    batchnorm_damping_multiplier: float = 1.0

    def __post_init__(self) -> None:
        if not callable(self.damping):
            _check_positive_float("damping", self.damping)
        if not callable(self.lr):
            _check_positive_float("lr", self.lr, allow_zero=True)
        decay = self.factor_decay
        if (
            isinstance(decay, bool)
            or not isinstance(decay, (int, float))
            or not (0.0 < float(decay) <= 1.0)
        ):
            raise ValueError(f"factor_decay must be in (0, 1], got {decay!r}")
        for name in ("factor_update_steps", "inv_update_steps"):
            value = getattr(self, name)
            if not callable(value):
                _check_interval(name, value)
        if self.kl_clip is not None:
            _check_positive_float("kl_clip", self.kl_clip)
        if self.inverse_method not in INVERSE_METHODS:
            raise ValueError(
                f"inverse_method must be one of {INVERSE_METHODS}, got {self.inverse_method!r}"
            )
        if isinstance(self.skip_layers, (str, type)):
            raise ValueError(
                f"skip_layers must be a sequence of names or types, got {self.skip_layers!r}"
            )
        entries = tuple(self.skip_layers)
        for entry in entries:
            if not isinstance(entry, str) and not (
                isinstance(entry, type) and issubclass(entry, nn.Module)
            ):
                raise ValueError(
                    f"skip_layers entries must be module names or nn.Module types, got {entry!r}"
                )
        object.__setattr__(self, "skip_layers", entries)
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {tuple(STRATEGIES)}, got {self.strategy!r}")
        if not isinstance(self.factor_options, FactorOptions):
            raise ValueError(f"factor_options must be a FactorOptions, got {self.factor_options!r}")
        if self.factor_exchange is not None and self.factor_exchange not in FACTOR_EXCHANGES:
            raise ValueError(
                f"factor_exchange must be one of {FACTOR_EXCHANGES}, got {self.factor_exchange!r}"
            )
        _check_positive_float("bucket_cap_mb", self.bucket_cap_mb)
        _check_interval("fusion_warmup_steps", self.fusion_warmup_steps)
        _check_interval("accumulation_steps", self.accumulation_steps)
        if (
            isinstance(self.max_inverse_failures, bool)
            or not isinstance(self.max_inverse_failures, int)
            or self.max_inverse_failures < 0
        ):
            raise ValueError(
                f"max_inverse_failures must be an int >= 0, got {self.max_inverse_failures!r}"
            )
        if self.factor_comm_dtype not in (
            None,
            torch.float32,
            torch.float64,
            torch.bfloat16,
            torch.float16,
        ):
            raise ValueError(
                "factor_comm_dtype must be None, torch.float32, torch.float64, torch.bfloat16 "
                f"or torch.float16, got {self.factor_comm_dtype!r}"
            )
        if self.placement is not None and self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.batchnorm is not None and self.batchnorm not in BATCHNORM_MODES:
            raise ValueError(
                f"batchnorm must be one of {BATCHNORM_MODES} or None, got {self.batchnorm!r}"
            )
        _check_positive_float("batchnorm_damping_multiplier", self.batchnorm_damping_multiplier)

    @property
    def inverse_placement(self) -> str:
        """The placement in effect: the override, else the strategy's."""
        return self.placement or STRATEGIES[self.strategy].placement

    @property
    def fusion_policy(self) -> str:
        """The fusion policy in effect: the override, else the strategy's."""
        return self.factor_exchange or STRATEGIES[self.strategy].factor_exchange

    def fingerprint(self) -> str:
        """A text that is equal on two ranks iff their options are (callables by name)."""
        parts = []
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if callable(value) and not isinstance(value, type):
                value = f"callable:{getattr(value, '__qualname__', type(value).__name__)}"
            elif name == "skip_layers":
                value = tuple(v if isinstance(v, str) else v.__qualname__ for v in value)
            parts.append(f"{name}={value!r}")
        return ";".join(parts)

    def damping_at(self, step: int) -> float:
        """Damping γ at ``step``."""
        return resolve_float("damping", self.damping, step, allow_zero=False)

    def batchnorm_damping_at(self, step: int) -> float:
        """Damping ρ_BN·γ of the BatchNorm blocks at ``step``."""
        return self.batchnorm_damping_multiplier * self.damping_at(step)

    def lr_at(self, step: int) -> float:
        """Learning rate η used by the KL clip at ``step``."""
        return resolve_float("lr", self.lr, step, allow_zero=True)

    def is_factor_step(self, step: int) -> bool:
        """Whether factors are updated at ``step``."""
        return step % resolve_interval("factor_update_steps", self.factor_update_steps, step) == 0

    def is_inverse_step(self, step: int) -> bool:
        """Whether inverses are recomputed at ``step``."""
        return step % resolve_interval("inv_update_steps", self.inv_update_steps, step) == 0
