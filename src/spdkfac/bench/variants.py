"""The benchmark's variants: the rows of :data:`spdkfac.strategies.STRATEGIES`, plus SGD."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from spdkfac.config import KFACConfig
from spdkfac.strategies import SGD, STRATEGIES, AutoStrategy, Strategy

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
    """One optimizer configuration of the benchmark: a row of the strategy table, or the
    :class:`~spdkfac.strategies.AutoStrategy` that chooses one of its rows online.

    Attributes:
        selection: The strategy (:data:`~spdkfac.strategies.SGD` for plain momentum SGD).
    """

    selection: Strategy | AutoStrategy

    @property
    def name(self) -> str:
        """Key of :data:`VARIANTS`."""
        return self.selection.name

    @property
    def row(self) -> Strategy | None:
        """The fixed composition it runs (None: chosen online)."""
        return None if isinstance(self.selection, AutoStrategy) else self.selection

    @property
    def chosen_online(self) -> bool:
        """``strategy="auto"``: its policies are chosen while it runs."""
        return self.row is None

    @property
    def kfac(self) -> Mapping[str, str] | None:
        """``KFACPreconditioner`` keyword arguments (read-only), or None for SGD."""
        options = {"strategy": self.selection.name} if self.row is None else self.row.options
        return None if options is None else MappingProxyType(options)

    @property
    def description(self) -> str:
        """One line for the report."""
        if self.row is None:
            tried = ", ".join(row.name for row in self.selection.rows)
            return (
                f"{self.name}: the fastest of {tried}, measured online (its trial iterations "
                "come before the measured ones and are not counted)"
            )
        return self.row.description

    @property
    def uses_kfac(self) -> bool:
        """False for the SGD baseline."""
        return self.row is None or self.row.uses_kfac

    @property
    def strategy(self) -> str | None:
        """The preset strategy (None for SGD)."""
        return self.name if self.row is None else self.row.base

    @property
    def factor_exchange(self) -> str | None:
        """The fusion policy in effect (None for SGD; chosen online: the variant's name)."""
        return self.name if self.row is None else self.row.factor_exchange

    @property
    def placement(self) -> str | None:
        """The inverse placement in effect (None for SGD; chosen online: the variant's name)."""
        return self.name if self.row is None else self.row.placement


#: ``strategy="auto"`` as a benchmark variant: the selection a preconditioner with the
#: default candidates makes.
AUTO = KFACConfig(strategy="auto").selection

#: Every variant the benchmark knows, in the order the report lists them.
VARIANTS: Mapping[str, Variant] = MappingProxyType(
    {selection.name: Variant(selection) for selection in (SGD, *STRATEGIES.values(), AUTO)}
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
    row = VARIANTS[name].row
    if row is None or not row.uses_kfac:
        return None
    for other in names:
        candidate = VARIANTS[other].row
        if (
            candidate is not None
            and candidate.fusion is not None
            and not candidate.fusion.eager
            and candidate.base == row.base
            and candidate.placement_policy == row.placement_policy
        ):
            return other
    return None
