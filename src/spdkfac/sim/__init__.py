"""Discrete-event simulator of distributed K-FAC at cluster scale."""

from __future__ import annotations

from spdkfac.sim.clusters import NETWORKS
from spdkfac.sim.collectives import (
    CollectiveOp,
    Flat,
    Hierarchical,
    Link,
    Shape,
    Topology,
)
from spdkfac.sim.engine import simulate
from spdkfac.sim.hardware import CommunicationModel, DeviceModel, Hardware
from spdkfac.sim.measured import MeasuredCompute, measure_compute
from spdkfac.sim.network import Anchor, CollectiveCost, Network, NetworkModel
from spdkfac.sim.presets import (
    PRESETS,
    cluster_preset,
    cpu_preset,
    paper_preset,
    resolve_hardware,
)
from spdkfac.sim.profiled import ProfiledCompute, events_from_chrome_trace
from spdkfac.sim.program import (
    Close,
    Collective,
    Compute,
    Issue,
    Open,
    Program,
    SimulationResult,
    Wait,
)
from spdkfac.sim.report import (
    SimulationRun,
    inverse_phase_seconds,
    markdown_report,
    results_to_json,
    write_trace,
)
from spdkfac.sim.simulator import (
    MAX_RANK_PROGRAMS,
    MAX_WORKERS,
    IterationKind,
    StrategyResult,
    rank_classes,
    rank_programs,
    simulate_strategies,
    simulate_strategy,
)
from spdkfac.sim.strategies import (
    DEFAULT_STRATEGIES,
    STRATEGY_TABLE,
    Strategy,
    parse_strategies,
)
from spdkfac.sim.window import WINDOW_POLICIES, parse_comm_schedulers, window_policy
from spdkfac.sim.workload import (
    FactorHook,
    GradReady,
    LayerSpec,
    Op,
    Workload,
    trace_workload,
)
from spdkfac.sim.zoo import SIM_MODEL_NAMES, model_by_name, workload_for

__all__ = [
    "DEFAULT_STRATEGIES",
    "MAX_RANK_PROGRAMS",
    "MAX_WORKERS",
    "NETWORKS",
    "PRESETS",
    "SIM_MODEL_NAMES",
    "STRATEGY_TABLE",
    "WINDOW_POLICIES",
    "Anchor",
    "Close",
    "Collective",
    "CollectiveCost",
    "CollectiveOp",
    "CommunicationModel",
    "Compute",
    "DeviceModel",
    "FactorHook",
    "Flat",
    "GradReady",
    "Hardware",
    "Hierarchical",
    "Issue",
    "IterationKind",
    "LayerSpec",
    "Link",
    "MeasuredCompute",
    "Network",
    "NetworkModel",
    "Op",
    "Open",
    "ProfiledCompute",
    "Program",
    "Shape",
    "SimulationResult",
    "SimulationRun",
    "Strategy",
    "StrategyResult",
    "Topology",
    "Wait",
    "Workload",
    "cluster_preset",
    "cpu_preset",
    "events_from_chrome_trace",
    "inverse_phase_seconds",
    "markdown_report",
    "measure_compute",
    "model_by_name",
    "paper_preset",
    "parse_comm_schedulers",
    "parse_strategies",
    "rank_classes",
    "rank_programs",
    "resolve_hardware",
    "results_to_json",
    "simulate",
    "simulate_strategies",
    "simulate_strategy",
    "trace_workload",
    "window_policy",
    "workload_for",
    "write_trace",
]
