"""``spdkfac train``'s K-FAC options: a nested :class:`~spdkfac.config.KFACConfig` (the
library's options and defaults, defined once) and Osawa et al.'s schedules over it, with
the flat form the flags, config files and checkpoints use.

The flat form names each option as its flag does (``damping``, ``factor_examples``,
``batchnorm``, ...); :func:`kfac_to_flat` and :func:`kfac_from_flat` translate, so a
file written before the options were nested reads as it always did.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from operator import attrgetter
from types import MappingProxyType
from typing import Any

from torch import nn

from spdkfac.config import KFACConfig
from spdkfac.layers import FactorOptions
from spdkfac.layers.batchnorm import BATCHNORM_MODES
from spdkfac.schedules import damping_warmup, stale_interval
from spdkfac.support.checks import check_choice, check_int, check_number

__all__ = [
    "BATCHNORM_CURVATURES",
    "KFAC_FLAGS",
    "KFACSchedules",
    "check_train_kfac",
    "hidden_layers_only",
    "kfac_from_flat",
    "kfac_to_flat",
]

#: ``--batchnorm`` values: "off" (plain gradient) or a mode of ``KFACPreconditioner``.
BATCHNORM_CURVATURES: tuple[str, ...] = ("off", *BATCHNORM_MODES)

_SAME_NAME = ("strategy", "inverse_method", "grafting", "comm_scheduler", "damping",
              "factor_decay", "factor_update_steps", "inv_update_steps",
              "weight_sharing")  # fmt: skip

#: The flat value standing for an option's None, as its flag says it (a TOML file cannot
#: hold None): no KL clip, no BatchNorm curvature.
_NONE_AS: Mapping[str, Any] = MappingProxyType(
    {"kl_clip": 0.0, "batchnorm": "off", "normalization": "off"}
)


def _none_as(name: str) -> Callable[[KFACConfig], Any]:
    """The flat value of the same-named option ``name`` of :data:`_NONE_AS`."""
    return lambda kfac: _NONE_AS[name] if getattr(kfac, name) is None else getattr(kfac, name)


#: Flat name -> its value in a :class:`KFACConfig`, in the flat form's order.
_READERS: dict[str, Callable[[KFACConfig], Any]] = {
    **{name: attrgetter(name) for name in _SAME_NAME},
    "kl_clip": _none_as("kl_clip"),
    "factor_examples": lambda kfac: kfac.factor_options.examples,
    "batchnorm": _none_as("batchnorm"),
    "normalization": _none_as("normalization"),
    "batchnorm_damping_multiplier": attrgetter("batchnorm_damping_multiplier"),
    "accumulation_steps": attrgetter("accumulation_steps"),
}

#: The K-FAC options ``spdkfac train`` has a flag for, by flag name.
KFAC_FLAGS: tuple[str, ...] = tuple(_READERS)

#: The :class:`KFACConfig` fields those flags set.
_FLAGGED_FIELDS = frozenset(
    {*_SAME_NAME, "kl_clip", "factor_options", "batchnorm", "normalization",
     "batchnorm_damping_multiplier", "accumulation_steps"}
)  # fmt: skip

#: Options a flag gives as a number; their schedules are :class:`KFACSchedules`.
_PLAIN_NUMBERS = ("damping", "kl_clip", "factor_decay", "factor_update_steps", "inv_update_steps")


def hidden_layers_only(kfac: KFACConfig, hidden: set[str], model: nn.Module) -> KFACConfig:
    """``kfac`` on the ``hidden`` layers of ``model`` (names in the user's module) only,
    as the transformer recipe runs it (``--optimizer kfac-muon``, ``kfac-eigen-adam``):
    every other layer with a weight is skipped (AdamW's)."""
    skipped = tuple(
        name
        for name, module in model.named_modules()
        if name
        and name not in hidden
        and isinstance(module.__dict__.get("_parameters", {}).get("weight"), nn.Parameter)
    )
    return replace(kfac, skip_layers=skipped)


def kfac_to_flat(kfac: KFACConfig) -> dict[str, Any]:
    """The flag-named values of ``kfac`` (``batchnorm`` "off" and ``kl_clip`` 0 for None)."""
    return {name: read(kfac) for name, read in _READERS.items()}


def kfac_from_flat(values: Mapping[str, Any]) -> KFACConfig:
    """A :class:`KFACConfig` from flag-named values; a missing one keeps its default.

    Raises:
        ValueError: An invalid value (the message names the flag's option).
    """
    options = {name: values[name] for name in KFAC_FLAGS if name in values}
    if "factor_examples" in options:
        examples = options.pop("factor_examples")
        if examples is not None:
            check_int("factor_examples", examples)
        options["factor_options"] = FactorOptions(examples=examples)
    for name in ("batchnorm", "normalization"):
        if name in options:
            check_choice(name, options[name], BATCHNORM_CURVATURES)
    for name, stand_in in _NONE_AS.items():
        if name in options and options[name] == stand_in:
            options[name] = None
    return KFACConfig(**options)


def check_train_kfac(kfac: object) -> KFACConfig:
    """``kfac`` if the flat form holds it whole: options without a flag at their defaults,
    the flagged numbers plain numbers.

    Raises:
        ValueError: Naming the options that cannot be saved with the run.
    """
    if not isinstance(kfac, KFACConfig):
        raise ValueError(f"kfac must be a KFACConfig, got {kfac!r}")
    defaults = KFACConfig()
    unflagged = [
        spec.name
        for spec in fields(KFACConfig)
        if spec.name not in _FLAGGED_FIELDS
        and getattr(kfac, spec.name) != getattr(defaults, spec.name)
    ]
    if kfac.factor_options != FactorOptions(examples=kfac.factor_options.examples):
        unflagged.append("factor_options (beyond examples)")
    if unflagged:
        raise ValueError(
            f"spdkfac train has no option for kfac's {', '.join(unflagged)}: leave them at "
            f"their defaults (the run's options are {', '.join(KFAC_FLAGS)})"
        )
    scheduled = [name for name in _PLAIN_NUMBERS if callable(getattr(kfac, name))]
    if scheduled:
        raise ValueError(
            f"kfac's {', '.join(scheduled)} must be numbers in a training config; their "
            "schedules are kfac_schedules (damping warm-up, stale refresh intervals)"
        )
    return kfac


@dataclass(frozen=True, kw_only=True)
class KFACSchedules:
    """Osawa et al.'s schedules over K-FAC's options (``spdkfac train --help``).

    Attributes:
        damping_initial: Damping at step 0 of the warm-up (None: no warm-up).
        damping_warmup_steps: Steps over which it moves linearly to ``kfac.damping``.
        stale_switch_step: Step after which the refresh intervals grow (None: never).
        stale_factor_update_steps: Factor refresh interval after the switch.
        stale_inv_update_steps: Inverse refresh interval after the switch.
        stale_growth_steps: Double the intervals every N steps after the switch (0: jump).
    """

    damping_initial: float | None = None
    damping_warmup_steps: int = 0
    stale_switch_step: int | None = None
    stale_factor_update_steps: int = 10
    stale_inv_update_steps: int = 100
    stale_growth_steps: int = 0

    def __post_init__(self) -> None:
        for name in ("stale_factor_update_steps", "stale_inv_update_steps"):
            check_int(name, getattr(self, name), low=1)
        for name in ("damping_warmup_steps", "stale_growth_steps"):
            check_int(name, getattr(self, name), low=0)
        if self.stale_switch_step is not None:
            check_int("stale_switch_step", self.stale_switch_step, low=1)
        if self.damping_initial is not None:
            check_number("damping_initial", self.damping_initial)

    def applied_to(self, kfac: KFACConfig) -> KFACConfig:
        """``kfac`` with the damping warm-up and the stale intervals as functions of the
        step (what the preconditioner of a run is given).

        Raises:
            ValueError: When a schedule's own checks refuse the values.
        """
        kfac = check_train_kfac(kfac)
        changes: dict[str, Any] = {}
        if self.damping_initial is not None and self.damping_warmup_steps > 0:
            target = check_number("damping", kfac.damping)
            changes["damping"] = damping_warmup(
                self.damping_initial, target, self.damping_warmup_steps
            )
        if self.stale_switch_step is not None:
            for name, late in (
                ("factor_update_steps", self.stale_factor_update_steps),
                ("inv_update_steps", self.stale_inv_update_steps),
            ):
                changes[name] = stale_interval(
                    check_int(name, getattr(kfac, name)),
                    late,
                    self.stale_switch_step,
                    growth_steps=self.stale_growth_steps,
                )
        return replace(kfac, **changes)
