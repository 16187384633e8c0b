"""Compute taken from profiled runs, per-collective interference, and iteration jitter."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from spdkfac.cli import main
from spdkfac.profiling import Event, chrome_trace
from spdkfac.sim import (
    Collective,
    Compute,
    Hardware,
    Issue,
    ProfiledCompute,
    Wait,
    Workload,
    events_from_chrome_trace,
    simulate,
    simulate_strategy,
)
from spdkfac.sim.costs import WorkloadCosts

MS = 1e-3


def _iteration(rank: int, start: float, fb: float, a: float, prologue: float) -> list[Event]:
    """One profiled iteration: forward/backward (with an A product and a gradient wait),
    then a step with a prologue, a factor wait and a preconditioning span, then a tail."""
    t = start
    events = [
        Event("kfac/forward_backward/all", rank, t, fb + a + 2 * MS),
        Event("kfac/factor_compute/fc1/A", rank, t + 1 * MS, a),
        Event("kfac/grad_comm/wait", rank, t + fb + a, 2 * MS),
    ]
    t += fb + a + 2 * MS
    step = prologue + 5 * MS + 1 * MS
    events += [
        Event("kfac/step/all", rank, t, step),
        Event("kfac/factor_comm/wait", rank, t + prologue, 5 * MS),
        Event("kfac/factor_comm/unpack", rank, t + prologue + 3 * MS, 2 * MS),
        Event("kfac/precondition/fc1", rank, t + prologue + 5 * MS, 1 * MS),
    ]
    end = t + step + 3 * MS  # the tail: 3 ms
    events.append(Event("kfac/iteration/all", rank, start, end - start))
    return events


def _profile_events() -> list[Event]:
    # rank 0: forward/backward 100 and 120 ms; rank 1: 130 and 110 ms. A products 4 / 6 ms.
    events = []
    for rank, fbs in ((0, (100 * MS, 120 * MS)), (1, (130 * MS, 110 * MS))):
        start = 0.0
        for fb, a in zip(fbs, (4 * MS, 6 * MS), strict=True):
            events += _iteration(rank, start, fb, a, prologue=7 * MS)
            start += 1.0
    return events


def test_pieces_are_averaged_over_iterations_and_ranks() -> None:
    profile = ProfiledCompute.from_events(_profile_events())
    assert profile.forward_backward == pytest.approx(115 * MS)
    spans = profile.spans
    assert spans["factor_compute/fc1/A"] == pytest.approx(5 * MS)
    assert spans["precondition/fc1"] == pytest.approx(1 * MS)
    assert spans["step/prologue"] == pytest.approx(7 * MS)
    assert spans["iteration/tail"] == pytest.approx(3 * MS)
    # Waits are not compute; the unpacking inside the factor wait is.
    assert [name for name in spans if "comm" in name] == ["factor_comm/unpack"]
    assert spans["factor_comm/unpack"] == pytest.approx(2 * MS)
    # Per-iteration compute: fb + A + prologue + unpack + precondition + tail = fb + a + 13:
    # rank 0 117 and 139 ms (mean 128), rank 1 147 and 129 ms (mean 138).
    assert profile.rank_spread == pytest.approx(5 / 133)
    # Deviations from the rank's mean: rank 0 -11, +11; rank 1 +9, -9. Shared by both
    # ranks: -1, +1; each rank's own: ±10 ms, i.e. σ²/2 = 100 (two ranks).
    assert profile.jitter == pytest.approx(200**0.5 / 133)
    # By phase: forward/backward ±10 ms of its own around 115 ms; the A products vary
    # (4, 6 ms) alike on both ranks, which makes no rank wait: 0; the rest never changes.
    assert profile.phase_jitter["forward_backward"] == pytest.approx(200**0.5 / 115)
    for phase in ("factor_compute", "step", "iteration", "precondition", "factor_comm"):
        assert profile.phase_jitter[phase] == pytest.approx(0.0, abs=1e-12)


def test_chrome_trace_round_trip_and_load(tmp_path: Path) -> None:
    events = _profile_events()
    back = events_from_chrome_trace(chrome_trace(events))
    assert len(back) == len(events)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(chrome_trace(events)))
    loaded = ProfiledCompute.load(path)
    direct = ProfiledCompute.from_events(events)
    assert loaded.forward_backward == pytest.approx(direct.forward_backward)
    assert dict(loaded.spans) == pytest.approx(dict(direct.spans))
    with pytest.raises(ValueError, match="no kfac/iteration/all"):
        ProfiledCompute.from_events([e for e in events if "iteration" not in e.name])
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        ProfiledCompute.load(tmp_path / "bad.json")


def test_a_profile_of_a_simulated_run_reproduces_it(
    two_layers: Workload, round_hardware: Hardware
) -> None:
    """Simulate D-KFAC, read its timeline as a profile, simulate again from the profile
    on hardware whose compute models are all different: the same timeline comes back."""
    hardware = replace(round_hardware, broadcast_buffers=False)
    original = simulate_strategy(two_layers, hardware, 2, "d-kfac")
    profile = ProfiledCompute.from_events(original.events)
    assert profile.rank_spread == 0.0 and profile.jitter == 0.0
    other = replace(
        hardware,
        device=replace(hardware.device, gemm_flops_per_second=3e6),
        inverse=replace(hardware.inverse, c0=9e-4),
        factor=replace(
            hardware.factor, a_rate=replace(hardware.factor.a_rate, overhead_seconds=7e-4)
        ),
    )
    assert simulate_strategy(two_layers, other, 2, "d-kfac").iteration_s != pytest.approx(
        original.iteration_s
    )
    timed, calibrated = profile.apply(two_layers, other)
    again = simulate_strategy(timed, calibrated, 2, "d-kfac")
    assert again.iteration_s == pytest.approx(original.iteration_s, rel=1e-9)
    assert dict(again.breakdown) == pytest.approx(dict(original.breakdown), rel=1e-9, abs=1e-12)


def test_apply_refuses_another_model(two_layers: Workload, round_hardware: Hardware) -> None:
    profile = ProfiledCompute.from_events(_profile_events(), source="trace.json")
    with pytest.raises(ValueError, match=r"trace\.json has no factor_compute span of fc1/G, fc2/A"):
        profile.apply(two_layers, round_hardware)
    events = list(simulate_strategy(two_layers, round_hardware, 2, "d-kfac").events)
    ProfiledCompute.from_events(events).apply(two_layers, round_hardware)  # its own model
    extra = [*events, Event("kfac/factor_compute/fc9/A", 0, 1e-4, 1e-5)]
    profile = ProfiledCompute.from_events(extra, source="trace.json")
    with pytest.raises(ValueError, match="layers it does not have: fc9/A: it is not"):
        profile.apply(two_layers, round_hardware)


def test_profiled_pieces_apply_only_to_their_workload(
    two_layers: Workload, round_hardware: Hardware
) -> None:
    spans = {"precondition/kl_clip": 0.25}
    hardware = replace(round_hardware, spans=spans, spans_for=("other", 4, (2,)))
    assert WorkloadCosts(two_layers, hardware, 2).kl_clip() != 0.25
    hardware = replace(hardware, spans_for=("two-layers", 4, (2,)))
    assert WorkloadCosts(two_layers, hardware, 2).kl_clip() == 0.25


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("jitter", 0.5),
        ("jitter", -0.1),
        ("broadcast_overlap", 1.5),
        ("broadcast_contention", 1.0),
        ("bookkeeping_scale", 0.0),
    ],
)
def test_bad_knobs_are_refused(round_hardware: Hardware, field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        replace(round_hardware, **{field: value})


def test_a_collective_carries_its_own_interference() -> None:
    # Rank 0 computes 1 s while a 0.5 s transfer moves. Contention 0.5 of the collective:
    # 0.25 s of compute done by 0.5, then 0.75 s at full speed -> 1.25.
    programs = [[Issue(0), Compute(1.0), Wait((0,))], [Issue(0), Wait((0,))]]
    slowed = Collective("c", "a", (0, 1), 0.0, 0.5, contention=0.5)
    assert simulate(programs, [slowed]).finish[0] == pytest.approx(1.25)
    # The collective's own 0 overrides the engine's 0.5.
    free = Collective("c", "a", (0, 1), 0.0, 0.5, contention=0.0)
    assert simulate(programs, [free], contention=0.5).finish[0] == pytest.approx(1.0)
    # Its overlap 0.5: the transfer moves at half rate while rank 0 computes -> ends at 1.
    half = Collective("c", "a", (0, 1), 0.0, 0.5, overlap=0.5)
    assert simulate(programs, [half]).ends == [pytest.approx(1.0)]
    with pytest.raises(ValueError, match="bad contention"):
        simulate(programs, [Collective("c", "a", (0, 1), 0.0, 0.5, contention=1.0)])


def test_jitter_makes_ranks_wait_and_is_reproducible(
    two_layers: Workload, hardware_factory: Callable[..., Hardware]
) -> None:
    steady = hardware_factory(allreduce=(0.0, 0.0), broadcast=(0.0, 0.0))
    shaky = replace(steady, jitter=0.2)
    calm = simulate_strategy(two_layers, steady, 2, "sgd")
    first = simulate_strategy(two_layers, shaky, 2, "sgd")
    second = simulate_strategy(two_layers, shaky, 2, "sgd")
    assert calm.breakdown["GradComm"] == 0.0
    assert first.breakdown["GradComm"] > 0.0  # the faster rank waits for the slower
    assert first.iteration_s > calm.iteration_s  # the slowest rank sets the pace
    assert first.iteration_s == second.iteration_s  # a fixed seed
    assert simulate_strategy(two_layers, shaky, 1, "sgd").iteration_s == calm.iteration_s


def test_jitter_of_one_phase_only_delays_the_collective_after_it(
    two_layers: Workload, hardware_factory: Callable[..., Hardware]
) -> None:
    free = replace(hardware_factory(allreduce=(0.0, 0.0), broadcast=(0.0, 0.0)), jitter=0.0)
    shaky = replace(free, phase_jitter={"inverse_compute": 0.3})
    assert shaky.jitter_of("inverse_compute") == 0.3 and shaky.jitter_of("step") == 0.0
    calm = simulate_strategy(two_layers, free, 2, "d-kfac").breakdown
    split = simulate_strategy(two_layers, shaky, 2, "d-kfac").breakdown
    assert calm["InverseComm"] == 0.0 and split["InverseComm"] > 0.0
    assert split["GradComm"] == 0.0 and split["FactorComm"] == pytest.approx(calm["FactorComm"])
    with pytest.raises(ValueError, match=r"phase_jitter\['step'\]"):
        replace(free, phase_jitter={"step": 0.7})


def test_cli_simulates_from_a_profile(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = Path("benchmarks/reports/bench_resnet32_loopback/traces/d-kfac.json")
    if not trace.exists():
        pytest.skip("the committed profiled run is not in this checkout")
    flags = ["simulate", "--model", "resnet32", "--input-size", "32", "--batch-size", "32"]
    flags += ["--workers", "2", "--preset", "cpu", "--strategies", "d-kfac", "--json"]
    assert main([*flags, "--profiled", str(trace)]) == 0
    profiled = json.loads(capsys.readouterr().out)
    assert main(flags) == 0
    modelled = json.loads(capsys.readouterr().out)
    seconds = [document["d-kfac"]["runs"][0]["iteration_s"] for document in (profiled, modelled)]
    assert seconds[0] != seconds[1]
    assert main([*flags[:2], "resnet20", *flags[3:], "--profiled", str(trace)]) == 1
    assert "does not have: layer1.3.conv1/A" in capsys.readouterr().err
