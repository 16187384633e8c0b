"""The one table of named strategies: compositions of a fusion and a placement policy.

A strategy is a row: a fusion policy (when and how factors are all-reduced,
:mod:`spdkfac.planning.fusion`), a placement policy (who inverts each factor,
:mod:`spdkfac.planning.placement`) and whether an owner's inverses share broadcasts. The
preconditioner (``strategy=`` plus the ``factor_exchange=`` / ``placement=`` overrides),
the simulator and ``spdkfac bench`` all read this table. Adding a strategy is one row
(plus a policy class when it needs a new behaviour); ``owner_computes`` (Osawa et al.'s
reduce-scatter / owners precondition / all-gather) is one such axis, the next ones (a
communication scheduler) become further fields of :class:`Strategy`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from spdkfac.planning.fusion import FUSION_POLICIES, FusionPolicy
from spdkfac.planning.placement import PLACEMENT_POLICIES, PlacementPolicy

__all__ = [
    "ALGORITHMS",
    "AUTO_CANDIDATES",
    "SGD",
    "STRATEGIES",
    "STRATEGY_NAMES",
    "Strategy",
    "compose",
]


@dataclass(frozen=True)
class Strategy:
    """One composition of policies, named.

    Attributes:
        name: Key of :data:`STRATEGIES` (``"sgd"`` for the first-order baseline).
        fusion: The factor exchange (None: no K-FAC).
        placement_policy: The inverse placement (None: no K-FAC).
        fuse_broadcasts: Pack an owner's consecutive inverses into one broadcast until its
            bandwidth time outweighs the start-up time (cost model), instead of one
            broadcast per factor as in the SPD-KFAC paper.
        description: One line for reports.
        owner_computes: Osawa et al. 2019's hybrid exchange: gradients and factors are
            reduce-scattered to each layer's owner, which inverts and preconditions, and
            the preconditioned gradients are all-gathered (no inverse is communicated).
            Needs a placement that owns layers.
        base: The algorithm (``strategy=`` value) this row modifies; itself for the
            algorithms, None for SGD.
        overrides: The ``KFACPreconditioner`` override options that turn ``base`` into
            this row (``factor_exchange=`` / ``placement=`` / ``comm_scheduler=``).
        comm_scheduler: ``"fifo"`` or ``"priority"``: who orders DDP's gradient buckets
            and the pipelined factor buckets (:mod:`spdkfac.planning.schedule`).
    """

    name: str
    fusion: FusionPolicy | None
    placement_policy: PlacementPolicy | None
    fuse_broadcasts: bool
    description: str
    base: str | None = None
    overrides: Mapping[str, str] = field(default_factory=dict)
    owner_computes: bool = False
    comm_scheduler: str = "fifo"

    def __post_init__(self) -> None:
        object.__setattr__(self, "overrides", MappingProxyType(dict(self.overrides)))
        placement = self.placement_policy
        if self.owner_computes and placement is not None and not placement.owns_layers:
            raise ValueError(
                f"placement={placement.name!r} cannot be used with strategy={self.base!r}: "
                "its owners precondition whole layers, so the placement must give every "
                "factor of a layer to one rank (e.g. 'layer-owners')"
            )

    @property
    def uses_kfac(self) -> bool:
        """False for the SGD baseline."""
        return self.fusion is not None

    @property
    def factor_exchange(self) -> str | None:
        """Name of the fusion policy (None for SGD)."""
        return None if self.fusion is None else self.fusion.name

    @property
    def placement(self) -> str | None:
        """Name of the placement policy (None for SGD)."""
        return None if self.placement_policy is None else self.placement_policy.name

    @property
    def options(self) -> dict[str, str] | None:
        """``KFACPreconditioner`` keyword arguments selecting this row (None for SGD)."""
        return None if self.base is None else {"strategy": self.base, **self.overrides}

    def with_overrides(
        self,
        *,
        factor_exchange: str | None = None,
        placement: str | None = None,
        comm_scheduler: str | None = None,
    ) -> Strategy:
        """This row with its fusion, placement and/or scheduler replaced (names)."""
        return replace(
            self,
            fusion=FUSION_POLICIES[factor_exchange] if factor_exchange else self.fusion,
            placement_policy=PLACEMENT_POLICIES[placement] if placement else self.placement_policy,
            comm_scheduler=comm_scheduler or self.comm_scheduler,
        )


def compose(
    name: str,
    base: str,
    description: str,
    *,
    factor_exchange: str | None = None,
    placement: str | None = None,
    comm_scheduler: str | None = None,
) -> Strategy:
    """A row that modifies the algorithm ``base`` by the given overrides."""
    given = {
        "factor_exchange": factor_exchange,
        "placement": placement,
        "comm_scheduler": comm_scheduler,
    }
    overrides = {key: value for key, value in given.items() if value is not None}
    row = _ALGORITHMS[base].with_overrides(**overrides)
    return replace(row, name=name, description=description, overrides=overrides)


def _algorithm(
    name: str,
    exchange: str,
    placement: str,
    fuse: bool,
    description: str,
    *,
    owner_computes: bool = False,
) -> Strategy:
    return Strategy(
        name,
        FUSION_POLICIES[exchange],
        PLACEMENT_POLICIES[placement],
        fuse,
        description,
        name,
        owner_computes=owner_computes,
    )


#: The named algorithms ``strategy=`` accepts: D-KFAC (replicated inverses), MPD-KFAC
#: (round-robin, every inverse broadcast), SPD-KFAC (Shi, Zhang, Li 2021: pipelined
#: optimal fusion, load-balanced CT/NCT placement) and Osawa et al. 2019's hybrid
#: data/model-parallel design (reduce-scatter to layer owners, owners invert and
#: precondition, all-gather of the preconditioned gradients).
_ALGORITHMS: dict[str, Strategy] = {
    row.name: row
    for row in (
        _algorithm(
            "d-kfac",
            "after-backward",
            "replicated",
            False,
            "D-KFAC: after-backward, replicated inverses",
        ),
        _algorithm(
            "mpd-kfac",
            "after-backward",
            "round-robin",
            False,
            "MPD-KFAC: after-backward, round-robin inverses",
        ),
        _algorithm(
            "spd-kfac",
            "optimal",
            "balanced",
            True,
            "SPD-KFAC: optimal fusion, balanced CT/NCT inverses",
        ),
        _algorithm(
            "osawa",
            "after-backward",
            "layer-owners",
            False,
            "Osawa et al.: reduce-scatter to layer owners, owners precondition, all-gather",
            owner_computes=True,
        ),
    )
}
ALGORITHMS: tuple[str, ...] = tuple(_ALGORITHMS)

#: The first-order baseline of the simulator and the benchmark.
SGD = Strategy("sgd", None, None, False, "momentum SGD, no K-FAC")

#: Every named composition: the algorithms and the paper's ablations (Fig. 9, Fig. 10).
STRATEGIES: Mapping[str, Strategy] = MappingProxyType(
    {
        **_ALGORITHMS,
        "placement-only": compose(
            "placement-only",
            "spd-kfac",
            "ablation: SPD-KFAC's placement with D-KFAC's after-backward exchange",
            factor_exchange="after-backward",
        ),
        "osawa-pipelined": compose(
            "osawa-pipelined",
            "osawa",
            "Osawa et al.'s owners with SPD-KFAC's pipelined optimal fusion of the factor "
            "reduce-scatter",
            factor_exchange="optimal",
        ),
        "pipelining-only": compose(
            "pipelining-only",
            "d-kfac",
            "ablation: D-KFAC's replicated inverses with SPD-KFAC's optimal fusion",
            factor_exchange="optimal",
        ),
        "spd-kfac+priority": compose(
            "spd-kfac+priority",
            "spd-kfac",
            "SPD-KFAC with the priority scheduler: gradient chunks preempt factor chunks",
            comm_scheduler="priority",
        ),
        "osawa-pipelined+priority": compose(
            "osawa-pipelined+priority",
            "osawa",
            "osawa-pipelined with the priority scheduler",
            factor_exchange="optimal",
            comm_scheduler="priority",
        ),
        "fusion:dp+priority": compose(
            "fusion:dp+priority",
            "spd-kfac",
            "SPD-KFAC placement, the exact DP merge planned around the priority scheduler's "
            "gradient chunks",
            factor_exchange="dp",
            comm_scheduler="priority",
        ),
        **{
            f"fusion:{policy}": compose(
                f"fusion:{policy}",
                "spd-kfac",
                f"SPD-KFAC placement, factor exchange {policy!r} (Fig. 10)",
                factor_exchange=policy,
            )
            for policy in FUSION_POLICIES
        },
    }
)

#: The rows ``strategy="auto"`` tries by default, in trial order (:mod:`spdkfac.engine.autotune`).
AUTO_CANDIDATES: tuple[str, ...] = ("d-kfac", "spd-kfac", "osawa", "osawa-pipelined", "mpd-kfac")
#: Values of ``strategy=``: the algorithms, and ``"auto"`` (the fastest of its candidates).
STRATEGY_NAMES: tuple[str, ...] = (*ALGORITHMS, "auto")
