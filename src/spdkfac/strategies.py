"""The one table of named strategies: compositions of one object per strategy axis.

A strategy is a row: a fusion policy (when and how factors are all-reduced,
:mod:`spdkfac.planning.fusion`), a placement policy (who inverts each factor,
:mod:`spdkfac.planning.placement`), a final-stage policy (every rank preconditions, or
each layer's owner: :mod:`spdkfac.planning.final`), a scheduler policy (who orders a
factor step's traffic: :mod:`spdkfac.planning.schedule`) and a broadcast policy (how
communicated inverses are grouped: :mod:`spdkfac.planning.broadcasts`). The
preconditioner (``strategy=`` plus the ``factor_exchange=`` / ``placement=`` /
``comm_scheduler=`` overrides), the simulator and ``spdkfac bench`` all read this table.
Adding a strategy is one row (plus a policy object when it needs a new behaviour).
``strategy="auto"`` is its own type, :class:`AutoStrategy`: the candidate rows it tries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from spdkfac.planning.broadcasts import BroadcastPolicy, FusedBroadcasts, PerFactorBroadcasts
from spdkfac.planning.final import LAYER_PATHS, OWNER_COMPUTES, REPLICATED, FinalPolicy
from spdkfac.planning.fusion import FUSION_POLICIES, FusionPolicy
from spdkfac.planning.placement import PLACEMENT_POLICIES, PlacementPolicy
from spdkfac.planning.schedule import FIFO, SCHEDULER_POLICIES, SchedulerPolicy

__all__ = [
    "ALGORITHMS",
    "AUTO_CANDIDATES",
    "SGD",
    "STRATEGIES",
    "STRATEGY_NAMES",
    "AutoStrategy",
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
        broadcasts: How an owner's communicated inverses are grouped into broadcasts.
        description: One line for reports.
        base: The algorithm (``strategy=`` value) this row modifies; itself for the
            algorithms, None for SGD.
        overrides: The ``KFACPreconditioner`` override options that turn ``base`` into
            this row (``factor_exchange=`` / ``placement=`` / ``comm_scheduler=``).
        final: Who preconditions: every rank, or each layer's owner (Osawa et al.'s
            hybrid exchange, which needs a placement that owns layers).
        scheduler: Who orders DDP's gradient buckets and the pipelined factor buckets
            (:mod:`spdkfac.planning.schedule`).
    """

    name: str
    fusion: FusionPolicy | None
    placement_policy: PlacementPolicy | None
    broadcasts: BroadcastPolicy
    description: str
    base: str | None = None
    overrides: Mapping[str, str] = field(default_factory=dict)
    final: FinalPolicy = REPLICATED
    scheduler: SchedulerPolicy = FIFO

    def __post_init__(self) -> None:
        object.__setattr__(self, "overrides", MappingProxyType(dict(self.overrides)))
        placement = self.placement_policy
        if placement is not None:
            self.final.check_placement(placement.name, placement.owns_layers, self.base)

    @property
    def rows(self) -> tuple[Strategy, ...]:
        """The compositions a preconditioner of this selection may use: this one."""
        return (self,)

    @property
    def first(self) -> Strategy:
        """The composition a preconditioner starts with: this one."""
        return self

    @property
    def uses_kfac(self) -> bool:
        """False for the SGD baseline."""
        return self.fusion is not None

    @property
    def owner_computes(self) -> bool:
        """Whether each layer's owner preconditions it (the final stage's fact)."""
        return self.final.owners_precondition

    @property
    def comm_scheduler(self) -> str:
        """Name of the scheduler policy."""
        return self.scheduler.name

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
            scheduler=SCHEDULER_POLICIES[comm_scheduler] if comm_scheduler else self.scheduler,
        )


@dataclass(frozen=True)
class AutoStrategy:
    """``strategy="auto"``: the fastest of ``candidates``, measured online
    (:mod:`spdkfac.engine.autotune`); it starts with the first.

    Attributes:
        candidates: The rows it tries, in trial order.
    """

    candidates: tuple[Strategy, ...]
    name: str = "auto"

    def __post_init__(self) -> None:
        if not self.candidates:
            raise ValueError("auto_candidates must name at least one strategy")

    @property
    def rows(self) -> tuple[Strategy, ...]:
        """The compositions a preconditioner of this selection may use: the candidates."""
        return self.candidates

    @property
    def first(self) -> Strategy:
        """The composition a preconditioner starts with: the first candidate."""
        return self.candidates[0]


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
    broadcasts: BroadcastPolicy,
    description: str,
    *,
    final: FinalPolicy = REPLICATED,
) -> Strategy:
    return Strategy(
        name,
        FUSION_POLICIES[exchange],
        PLACEMENT_POLICIES[placement],
        broadcasts,
        description,
        name,
        final=final,
    )


#: The named algorithms ``strategy=`` accepts: D-KFAC (replicated inverses), MPD-KFAC
#: (round-robin, every inverse broadcast), SPD-KFAC (Shi, Zhang, Li 2021: pipelined
#: optimal fusion, load-balanced CT/NCT placement) and Osawa et al. 2019's hybrid
#: data/model-parallel design (reduce-scatter to layer owners, owners invert and
#: precondition, all-gather of the preconditioned gradients); and ``layer-paths``, which
#: sends each layer Osawa's way or SPD-KFAC's by the cost model
#: (:func:`~spdkfac.planning.paths.plan_gradient_paths`).
_ALGORITHMS: dict[str, Strategy] = {
    row.name: row
    for row in (
        _algorithm(
            "d-kfac",
            "after-backward",
            "replicated",
            PerFactorBroadcasts(),
            "D-KFAC: after-backward, replicated inverses",
        ),
        _algorithm(
            "mpd-kfac",
            "after-backward",
            "round-robin",
            PerFactorBroadcasts(),
            "MPD-KFAC: after-backward, round-robin inverses",
        ),
        _algorithm(
            "spd-kfac",
            "optimal",
            "balanced",
            FusedBroadcasts(),
            "SPD-KFAC: optimal fusion, balanced CT/NCT inverses",
        ),
        _algorithm(
            "osawa",
            "after-backward",
            "layer-owners",
            PerFactorBroadcasts(),
            "Osawa et al.: reduce-scatter to layer owners, owners precondition, all-gather",
            final=OWNER_COMPUTES,
        ),
        _algorithm(
            "layer-paths",
            "after-backward",
            "balanced",
            FusedBroadcasts(),
            "per layer by the cost model: osawa's owner path or SPD-KFAC's replicated "
            "inverses (balanced CT/NCT)",
            final=LAYER_PATHS,
        ),
    )
}
ALGORITHMS: tuple[str, ...] = tuple(_ALGORITHMS)

#: The first-order baseline of the simulator and the benchmark.
SGD = Strategy("sgd", None, None, PerFactorBroadcasts(), "momentum SGD, no K-FAC")

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
