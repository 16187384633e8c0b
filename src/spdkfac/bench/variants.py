"""The benchmark's variants: one table from a name to the preconditioner's keyword arguments."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from spdkfac.config import STRATEGIES

__all__ = [
    "PRESETS",
    "VARIANTS",
    "Variant",
    "after_backward_baseline",
    "parse_variants",
    "preconditioner_kwargs",
]


@dataclass(frozen=True)
class Variant:
    """One optimizer configuration of the benchmark.

    Attributes:
        kfac: ``KFACPreconditioner`` keyword arguments, or None for plain momentum SGD.
        description: One line for the report.
    """

    kfac: Mapping[str, str] | None
    description: str

    def __post_init__(self) -> None:
        if self.kfac is not None:  # a read-only copy: the table must not change under us
            object.__setattr__(self, "kfac", MappingProxyType(dict(self.kfac)))

    @property
    def uses_kfac(self) -> bool:
        """False for the SGD baseline."""
        return self.kfac is not None

    @property
    def strategy(self) -> str | None:
        """The preset strategy (None for SGD)."""
        return None if self.kfac is None else self.kfac["strategy"]

    @property
    def factor_exchange(self) -> str | None:
        """The fusion policy in effect: the override, else the strategy's (None for SGD)."""
        if self.kfac is None:
            return None
        return self.kfac.get("factor_exchange") or STRATEGIES[self.kfac["strategy"]].factor_exchange

    @property
    def placement(self) -> str | None:
        """The inverse placement in effect (None for SGD)."""
        if self.kfac is None:
            return None
        return self.kfac.get("placement") or STRATEGIES[self.kfac["strategy"]].placement


def _spd(exchange: str) -> Variant:
    return Variant(
        {"strategy": "spd-kfac", "factor_exchange": exchange},
        f"SPD-KFAC placement, factor exchange {exchange!r} (Fig. 10)",
    )


#: Every variant the benchmark knows, in the order the report lists them.
VARIANTS: Mapping[str, Variant] = MappingProxyType(
    {
        "sgd": Variant(None, "momentum SGD, no K-FAC"),
        "d-kfac": Variant({"strategy": "d-kfac"}, "D-KFAC: after-backward, replicated inverses"),
        "mpd-kfac": Variant(
            {"strategy": "mpd-kfac"}, "MPD-KFAC: after-backward, round-robin inverses"
        ),
        "spd-kfac": Variant(
            {"strategy": "spd-kfac"}, "SPD-KFAC: optimal fusion, balanced CT/NCT inverses"
        ),
        "placement-only": Variant(
            {"strategy": "spd-kfac", "factor_exchange": "after-backward"},
            "ablation: SPD-KFAC's placement with D-KFAC's after-backward exchange",
        ),
        "pipelining-only": Variant(
            {"strategy": "d-kfac", "factor_exchange": "optimal"},
            "ablation: D-KFAC's replicated inverses with SPD-KFAC's optimal fusion",
        ),
        "fusion:after-backward": _spd("after-backward"),
        "fusion:layerwise": _spd("layerwise"),
        "fusion:threshold": _spd("threshold"),
        "fusion:optimal": _spd("optimal"),
    }
)

#: Names ``--variants`` expands.
PRESETS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "main": ("sgd", "d-kfac", "mpd-kfac", "spd-kfac", "placement-only", "pipelining-only"),
        "fig10": (
            "fusion:after-backward",
            "fusion:layerwise",
            "fusion:threshold",
            "fusion:optimal",
        ),
    }
)


def preconditioner_kwargs(name: str) -> dict[str, str] | None:
    """A fresh copy of variant ``name``'s preconditioner keyword arguments (None: SGD).

    Raises:
        KeyError: For an unknown name.
    """
    kfac = VARIANTS[name].kfac
    return None if kfac is None else dict(kfac)


def parse_variants(text: str) -> tuple[str, ...]:
    """Variant names from a comma list of names and presets, duplicates dropped, in order.

    Raises:
        ValueError: Naming an unknown entry, or when the list is empty.
    """
    names: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item in PRESETS:
            expanded: Sequence[str] = PRESETS[item]
        elif item in VARIANTS:
            expanded = (item,)
        else:
            known = ", ".join([*PRESETS, *VARIANTS])
            raise ValueError(f"unknown variant {item!r}; choose from {known}")
        names.extend(name for name in expanded if name not in names)
    if not names:
        raise ValueError(f"--variants needs at least one variant, got {text!r}")
    return tuple(names)


def after_backward_baseline(name: str, names: Sequence[str]) -> str | None:
    """The variant in ``names`` that differs from ``name`` only by exchanging factors after
    backward (same strategy and placement), which Fig. 10 measures hiding against.

    A variant that already exchanges after backward is its own baseline; SGD has none.
    """
    variant = VARIANTS[name]
    if not variant.uses_kfac:
        return None
    for other in names:
        candidate = VARIANTS[other]
        if (
            candidate.factor_exchange == "after-backward"
            and candidate.strategy == variant.strategy
            and candidate.placement == variant.placement
        ):
            return other
    return None
