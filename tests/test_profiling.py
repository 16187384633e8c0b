"""The profiler: spans, the paper's breakdown (overlap arithmetic), Chrome traces."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_helper import run_distributed
from spdkfac import KFACPreconditioner
from spdkfac.comm import TorchDistributedCommunicator, gather_events
from spdkfac.profiling import (
    PHASES,
    Event,
    Phase,
    Profiler,
    breakdown,
    chrome_trace,
    phase_of,
    span_name,
)


def test_breakdown_of_a_synthetic_timeline_is_exact() -> None:
    events = [
        # rank 0: iteration [0, 10]; forward/backward [0, 6] with factor work inside
        Event("kfac/iteration/all", 0, 0.0, 10.0),
        Event("kfac/forward_backward/all", 0, 0.0, 6.0),
        Event("kfac/factor_compute/fc/A", 0, 1.0, 1.0),
        Event("kfac/factor_compute/fc/G", 0, 4.0, 1.5),
        Event("kfac/grad_comm/wait", 0, 5.5, 0.5),
        Event("kfac/step/all", 0, 6.0, 3.5),
        Event("kfac/factor_comm/wait", 0, 6.0, 1.0),
        Event("kfac/inverse_compute/fc/A", 0, 7.0, 1.0),
        Event("kfac/inverse_comm/wait", 0, 7.5, 1.0),  # overlaps the inversion by 0.5
        Event("kfac/precondition/fc", 0, 8.5, 0.5),
        # rank 1: only a forward/backward and a precondition
        Event("kfac/iteration/all", 1, 0.0, 10.0),
        Event("kfac/forward_backward/all", 1, 0.0, 8.0),
        Event("kfac/precondition/fc", 1, 8.0, 2.0),
    ]
    result = breakdown(events, iterations=1)
    # Rank 0: FF&BP = 6 - 1 - 1.5 - 0.5 = 3; FactorComp 2.5; GradComm 0.5; FactorComm 1;
    # InverseComp 0.5 (the wait wins the overlap); InverseComm 1; Precondition 0.5;
    # Other = step leftovers [9, 9.5] + iteration leftovers [9.5, 10] = 1.
    rank0 = {
        "FF&BP": 3.0, "GradComm": 0.5, "FactorComp": 2.5, "FactorComm": 1.0,
        "InverseComp": 0.5, "InverseComm": 1.0, "Precondition": 0.5, "Other": 1.0,
    }  # fmt: skip
    rank1 = dict.fromkeys(rank0, 0.0) | {"FF&BP": 8.0, "Precondition": 2.0}
    for category, seconds in result.items():
        assert seconds == pytest.approx((rank0[category] + rank1[category]) / 2), category
    assert sum(result.values()) == pytest.approx(10.0)
    halved = breakdown(events, iterations=2)
    assert halved["FF&BP"] == pytest.approx(result["FF&BP"] / 2)
    with pytest.raises(ValueError, match="iterations"):
        breakdown(events, iterations=0)


def test_span_names() -> None:
    assert span_name("precondition", "layer1.0.conv1") == "kfac/precondition/layer1.0.conv1"
    assert phase_of("kfac/inverse_comm/wait") == "inverse_comm"
    with pytest.raises(ValueError, match="kfac/<phase>/<layer>"):
        phase_of("forward")


def test_phases_are_one_enum_accepted_as_members_or_values() -> None:
    assert span_name(Phase.INVERSE_COMM, "wait") == span_name("inverse_comm", "wait")
    assert span_name(Phase.STEP) == "kfac/step/all"
    assert set(PHASES) == set(Phase)
    assert phase_of(span_name(Phase.FLAG_COMM, "skip")) == Phase.FLAG_COMM
    with pytest.raises(ValueError, match=r"phase must be one of .*got 'forward'"):
        span_name("forward", "x")


def test_enabled_spans_show_in_torch_profiler() -> None:
    enabled, disabled = Profiler(enabled=True), Profiler()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as trace:
        with enabled.span(span_name(Phase.PRECONDITION, "probe")):
            torch.ones(3).add_(1.0)
        with disabled.span(span_name(Phase.PRECONDITION, "silent")):
            torch.ones(3).add_(1.0)
    names = {event.name for event in trace.events()}
    assert "kfac/precondition/probe" in names
    assert "kfac/precondition/silent" not in names
    assert [e.name for e in enabled.events()] == ["kfac/precondition/probe"]


def test_disabled_profiler_records_nothing() -> None:
    profiler = Profiler()
    first, second = profiler.span("kfac/step/all"), profiler.span("kfac/step/all")
    assert first is second  # one shared no-op context manager
    with first:
        pass
    profiler.record("kfac/step/all", 0.0, 1.0)
    assert profiler.events() == []


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 16, 4))


def test_spans_nest_and_cover_the_step() -> None:
    model = _model()
    precond = KFACPreconditioner(model, profile=True)
    inputs, targets = torch.randn(5, 1, 6, 6), torch.randint(0, 4, (5,))
    F.cross_entropy(model(inputs), targets).backward()
    precond.step()
    events = precond.profiler.events()
    names = {e.name for e in events}
    for layer in ("0", "3"):
        assert {f"kfac/factor_compute/{layer}/A", f"kfac/factor_compute/{layer}/G"} <= names
        assert f"kfac/precondition/{layer}" in names
        assert {f"kfac/inverse_compute/{layer}/A", f"kfac/inverse_compute/{layer}/G"} <= names
    (step,) = [e for e in events if e.name == "kfac/step/all"]
    inside = [e for e in events if e.phase in {"inverse_compute", "precondition"}]
    assert inside and all(step.start <= e.start and e.end <= step.end + 1e-9 for e in inside)
    assert sum(e.duration for e in inside) <= step.duration + 1e-9
    assert all(e.end <= step.start + 1e-9 for e in events if e.phase == "factor_compute"
               and e.name != "kfac/factor_compute/running_average")  # fmt: skip
    assert KFACPreconditioner(_model()).profiler.enabled is False


def test_chrome_trace_has_one_process_per_rank() -> None:
    events = [Event("kfac/step/all", 0, 5.0, 1.0), Event("kfac/precondition/x", 1, 5.5, 0.25)]
    trace = json.loads(json.dumps(chrome_trace(events)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert min(e["ts"] for e in spans) == 0.0
    assert [e["dur"] for e in spans] == [1e6, 0.25e6]


def _profiled_worker(rank: int, world_size: int) -> list[str]:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(_model())
    precond = KFACPreconditioner(model, strategy="mpd-kfac", profile=True)
    inputs = torch.randn(4, 1, 6, 6, generator=torch.Generator().manual_seed(rank))
    F.cross_entropy(model(inputs), torch.randint(0, 4, (4,))).backward()
    precond.step()
    merged = gather_events(precond.profiler.events(), TorchDistributedCommunicator())
    return sorted({f"{e.rank}:{e.phase}" for e in merged})


def test_events_from_all_ranks_gathered() -> None:
    results = run_distributed(_profiled_worker, 2)
    assert results[0] == results[1]
    for rank in (0, 1):
        for phase in ("factor_compute", "factor_comm", "inverse_comm", "precondition", "step"):
            assert f"{rank}:{phase}" in results[0]
