"""At scale: one rank per class is exact, plans follow the world size, runs stay bounded."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from spdkfac.cli.main import main
from spdkfac.planning.placement import FactorSpec, plan_inversions
from spdkfac.profiling import breakdown
from spdkfac.sim import (
    MAX_WORKERS,
    STRATEGY_TABLE,
    Hardware,
    Workload,
    cpu_preset,
    paper_preset,
    rank_classes,
    rank_programs,
    simulate,
    simulate_strategy,
    workload_for,
)
from spdkfac.sim.costs import WorkloadCosts
from spdkfac.sim.strategies import prepare
from spdkfac.sim.timeline import build_iteration


def _interfering(hardware: Hardware) -> Hardware:
    """Communication and computation in each other's way (the engine's rates then depend
    on every participant)."""
    return replace(hardware, overlap=0.4, contention=0.3, broadcast_overlap=0.6)


@pytest.mark.parametrize("world_size", [8, 20])
@pytest.mark.parametrize("strategy", ["d-kfac", "mpd-kfac", "spd-kfac", "fusion:layerwise"])
def test_one_rank_per_class_is_every_rank(
    two_layers: Workload,
    hardware_factory: Callable[..., Hardware],
    strategy: str,
    world_size: int,
) -> None:
    hardware = _interfering(hardware_factory(world_size=world_size))
    setup = prepare(WorkloadCosts(two_layers, hardware, world_size), STRATEGY_TABLE[strategy])
    programs, collectives = build_iteration(setup, factor_step=True, inverse_step=True)
    full = simulate(
        programs, collectives, overlap=hardware.overlap, contention=hardware.contention
    ).events
    result = simulate_strategy(two_layers, hardware, world_size, strategy)
    assert result.iteration_s == pytest.approx(max(e.end for e in full), rel=1e-12)
    expected = breakdown(full, 1)
    for category, seconds in result.breakdown.items():
        assert seconds == pytest.approx(expected[category], rel=1e-9, abs=1e-15), category
    classes = rank_classes(setup, inverse_step=True)
    owners = {group.owner for group in setup.groups}
    assert len(classes) == len(owners) + (len(owners) < world_size)
    assert sorted(rank for members in classes for rank in members) == list(range(world_size))
    ranks = {event.rank for event in result.events}
    if world_size <= 16:  # every rank's timeline, as the full simulation gives it
        assert sorted(result.events, key=lambda e: (e.rank, e.start, e.name)) == sorted(
            full, key=lambda e: (e.rank, e.start, e.name)
        )
    else:  # one rank per class
        assert ranks == {members[0] for members in classes}
        assert result.kinds[0].simulated_ranks == len(classes)


def test_different_ranks_are_each_simulated(
    two_layers: Workload, hardware_factory: Callable[..., Hardware]
) -> None:
    hardware = replace(hardware_factory(world_size=6), rank_spread=0.1)
    setup = prepare(WorkloadCosts(two_layers, hardware, 6), STRATEGY_TABLE["d-kfac"])
    assert len(rank_classes(setup, inverse_step=True)) == 6
    assert rank_programs(hardware, 6) == 6 and rank_programs(cpu_preset(), 1024) is None
    jittery = replace(hardware, rank_spread=0.0, jitter=0.1)
    assert rank_programs(jittery, 1024) == 8 * 1024  # at least 8 draws of every rank
    with pytest.raises(ValueError, match="world_size must be <= 65536"):
        simulate_strategy(two_layers, hardware, MAX_WORKERS + 1, "d-kfac")


def test_placement_follows_the_world_size() -> None:
    """The paper network's ring broadcast start-up grows with P, so SPD-KFAC's balanced
    placement turns factors it broadcasts at 64 workers into ones every rank inverts."""
    specs = [FactorSpec(f"l{d}", "A", d) for d in (256, 1024, 2048, 4096)]
    hardware = paper_preset()
    plans = {p: plan_inversions(specs, p, "balanced", hardware.cost_model(p)) for p in (64, 1024)}
    communicated = {
        size: [spec.dim for spec, owner in zip(specs, plan.owners, strict=True) if owner >= 0]
        for size, plan in plans.items()
    }
    assert communicated == {64: [2048, 4096], 1024: [4096]}


def test_fusion_follows_the_world_size() -> None:
    """The optimal fusion's merge rule reads the all-reduce start-up at P: on the paper
    network ResNet-20's factors go in many buckets at 8 workers and few at 64."""
    workload = workload_for("resnet20", batch_size=32)
    hardware = paper_preset()
    buckets = {}
    for world_size in (8, 64):
        setup = prepare(WorkloadCosts(workload, hardware, world_size), STRATEGY_TABLE["spd-kfac"])
        assert setup.fusion is not None
        buckets[world_size] = len(setup.fusion.buckets)
    assert buckets[8] > 4 * buckets[64]


#: ResNet-20 (CIFAR shapes, batch 32) on the ``cpu`` preset at 2 ranks, as the simulator
#: gave before the topology model (commit 0dcda14): iteration seconds, with factors and
#: inverses every step and every 2 / 4 steps.
CPU_TWO_RANKS = {
    "sgd": (0.13018722690566586, 0.13018722690566586),
    "d-kfac": (0.2610863019110207, 0.18871461419992325),
    "mpd-kfac": (0.27026670918579987, 0.19100971601861805),
    "spd-kfac": (0.2570957865165911, 0.18996167631077587),
    "placement-only": (0.24811702267875088, 0.1854722943918558),
    "pipelining-only": (0.27006506574886074, 0.19320399611884329),
    "fusion:threshold": (0.24711103651659086, 0.18496930131077577),
}


def test_cpu_preset_two_ranks_unchanged() -> None:
    workload = workload_for("resnet20", batch_size=32)
    for name, (every_step, stale) in CPU_TWO_RANKS.items():
        result = simulate_strategy(workload, cpu_preset(), 2, name)
        assert result.iteration_s == pytest.approx(every_step, rel=1e-12), name
        result = simulate_strategy(
            workload, cpu_preset(), 2, name, factor_update_steps=2, inv_update_steps=4
        )
        assert result.iteration_s == pytest.approx(stale, rel=1e-12), name


def _one_line_error(capsys: pytest.CaptureFixture[str], flags: list[str]) -> str:
    assert main(["simulate", "--workers", "2", "--strategies", "d-kfac", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("spdkfac simulate: error: "), err
    assert "Traceback" not in err
    return err


def test_cli_refuses_unusable_inputs_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    err = _one_line_error(capsys, ["--model", "mlp", "--measured", str(tmp_path)])
    assert "--measured" in err and "not a file" in err
    err = _one_line_error(capsys, ["--model", "mlp", "--profiled", str(tmp_path)])
    assert "--profiled" in err
    err = _one_line_error(capsys, ["--model", "densenet121", "--input-size", "8"])
    assert "densenet121 cannot take 3x8x8 inputs" in err
    err = _one_line_error(capsys, ["--model", "cnn", "--input-size", "4", "--preset", "cpu"])
    assert "cnn cannot take 3x4x4 inputs" in err


def test_cli_bounds_the_world_size(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["simulate", "--model", "mlp", "--workers", "100000"])
    assert raised.value.code == 2
    assert "at most 65536 workers" in capsys.readouterr().err
    # A profile with jitter makes every rank different: 4096 workers are refused up front.
    trace = Path("benchmarks/reports/bench_resnet32_loopback/traces/d-kfac.json")
    if not trace.exists():
        pytest.skip("the committed profiled run is not in this checkout")
    flags = ["--model", "resnet32", "--batch-size", "32", "--preset", "cpu"]
    err = _one_line_error(capsys, [*flags, "--profiled", str(trace), "--workers", "4096"])
    assert "every rank differs" in err and "at most 2048" in err


def test_cli_presets_and_runs(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["simulate", "--model", "resnet20", "--workers", "8,64", "--json"]
    assert main([*flags, "--preset", "ib200", "--strategies", "spd-kfac"]) == 0
    runs = json.loads(capsys.readouterr().out)["spd-kfac"]["runs"]
    assert [(run["workers"], run["preset"]) for run in runs] == [(8, "ib200"), (64, "ib200")]
    assert runs[0]["iteration_s"] != runs[1]["iteration_s"]
