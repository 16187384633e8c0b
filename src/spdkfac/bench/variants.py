"""The benchmark's variants: the rows of :data:`spdkfac.strategies.STRATEGIES`, plus SGD."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

from spdkfac.strategies import AUTO_CANDIDATES, SGD, STRATEGIES, Strategy

__all__ = [
    "ONE_VARIANT",
    "PRESETS",
    "VARIANTS",
    "Variant",
    "after_backward_baseline",
    "parse_variants",
    "preconditioner_kwargs",
]


@dataclass(frozen=True)
class Variant:
    """One optimizer configuration of the benchmark: a row of the strategy table.

    Attributes:
        row: The strategy (:data:`~spdkfac.strategies.SGD` for plain momentum SGD).
    """

    row: Strategy

    @property
    def kfac(self) -> Mapping[str, str] | None:
        """``KFACPreconditioner`` keyword arguments (read-only), or None for SGD."""
        options = self.row.options
        return None if options is None else MappingProxyType(options)

    @property
    def description(self) -> str:
        """One line for the report."""
        return self.row.description

    @property
    def uses_kfac(self) -> bool:
        """False for the SGD baseline."""
        return self.row.uses_kfac

    @property
    def strategy(self) -> str | None:
        """The preset strategy (None for SGD)."""
        return self.row.base

    @property
    def chosen_online(self) -> bool:
        """``strategy="auto"``: its policies are chosen while it runs."""
        return self.row.base == "auto"

    @property
    def factor_exchange(self) -> str | None:
        """The fusion policy in effect (None for SGD)."""
        return "auto" if self.chosen_online else self.row.factor_exchange

    @property
    def placement(self) -> str | None:
        """The inverse placement in effect (None for SGD)."""
        return "auto" if self.chosen_online else self.row.placement


#: ``strategy="auto"`` as a benchmark row (it starts as its first candidate).
AUTO = replace(
    STRATEGIES[AUTO_CANDIDATES[0]],
    name="auto",
    base="auto",
    overrides={},
    description=f"auto: the fastest of {', '.join(AUTO_CANDIDATES)}, measured online (its "
    "trial iterations come before the measured ones and are not counted)",
)

#: Every variant the benchmark knows, in the order the report lists them.
VARIANTS: Mapping[str, Variant] = MappingProxyType(
    {row.name: Variant(row) for row in (SGD, *STRATEGIES.values(), AUTO)}
)

#: Names ``--variants`` expands.
PRESETS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "main": ("sgd", "d-kfac", "mpd-kfac", "spd-kfac", "placement-only", "pipelining-only"),
        "osawa": ("sgd", "d-kfac", "mpd-kfac", "spd-kfac", "osawa", "osawa-pipelined"),
        "auto": (
            "sgd",
            "d-kfac",
            "mpd-kfac",
            "spd-kfac",
            "osawa",
            "osawa-pipelined",
            "auto",
        ),
        "scheduler": (
            "sgd",
            "d-kfac",
            "spd-kfac",
            "spd-kfac+priority",
            "osawa-pipelined",
            "osawa-pipelined+priority",
        ),
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


#: Prefix naming one variant even where a preset has its name (``variant:auto``).
ONE_VARIANT = "variant:"


def parse_variants(text: str) -> tuple[str, ...]:
    """Variant names from a comma list of names and presets, duplicates dropped, in order.

    A preset wins over the variant of the same name (``osawa``, ``auto``); ``variant:NAME``
    is always the one variant.

    Raises:
        ValueError: Naming an unknown entry, or when the list is empty.
    """
    names: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        one = item.removeprefix(ONE_VARIANT)
        if one == item and item in PRESETS:
            expanded: Sequence[str] = PRESETS[item]
        elif one in VARIANTS:
            expanded = (one,)
        else:
            known = ", ".join([*PRESETS, *VARIANTS])
            raise ValueError(
                f"unknown variant {item!r}; choose from {known} ({ONE_VARIANT}NAME: the "
                "variant even where a preset has its name)"
            )
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
    if not variant.uses_kfac or variant.chosen_online:
        return None
    for other in names:
        candidate = VARIANTS[other].row
        if (
            candidate.fusion is not None
            and not candidate.fusion.eager
            and candidate.base == variant.strategy
            and candidate.placement_policy == variant.row.placement_policy
        ):
            return other
    return None
