"""The profiler on each device: host spans on the CPU, CUDA-event spans on a GPU (resolved
at ``events()``), nested as the work was, and the preconditioner's phases on the model's
device."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from spdkfac import KFACPreconditioner
from spdkfac.profiling import Phase, Profiler, phase_of, span_name

#: CUDA events resolve to about half a microsecond; host clocks to far less.
RESOLUTION = 1e-5


def test_spans_nest_as_the_work_did(device: torch.device) -> None:
    profiler = Profiler(enabled=True, rank=3, device=device)
    matrix = torch.randn(64, 64, device=device)
    with profiler.span("kfac/step/all"):
        for layer in ("a", "b"):
            with profiler.span(f"kfac/precondition/{layer}"):
                matrix = matrix @ matrix.T / 64
    # CUDA spans are pairs of events until events() synchronizes and resolves them.
    assert len(profiler._cuda_spans) == (3 if device.type == "cuda" else 0)
    events = profiler.events()
    assert [event.name for event in events] == [
        "kfac/step/all", "kfac/precondition/a", "kfac/precondition/b"
    ]  # fmt: skip
    assert all(event.rank == 3 and math.isfinite(event.duration) and event.duration >= 0
               for event in events)  # fmt: skip
    outer, first, second = events
    for inner in (first, second):
        assert outer.start - RESOLUTION <= inner.start
        assert inner.start + inner.duration <= outer.start + outer.duration + RESOLUTION
    assert first.start + first.duration <= second.start + RESOLUTION
    profiler.clear()
    assert profiler.events() == []


def test_a_disabled_profiler_records_nothing(device: torch.device) -> None:
    profiler = Profiler(enabled=False, device=device)
    with profiler.span("kfac/step/all"):
        torch.ones(3, device=device).sum()
    assert profiler.events() == [] and profiler._cuda_spans == []


def test_the_preconditioner_profiles_its_phases_on_the_model_device(device: torch.device) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(device)
    precond = KFACPreconditioner(model, profile=True, kl_clip=None)
    inputs = torch.randn(8, 6, device=device)
    F.cross_entropy(model(inputs), torch.randint(0, 3, (8,), device=device)).backward()
    assert precond.step()
    events = precond.profiler.events()
    phases = {phase_of(event.name) for event in events}
    assert {Phase.STEP, Phase.INVERSE_COMPUTE, Phase.PRECONDITION} <= phases
    assert span_name(Phase.STEP) in {event.name for event in events}
    assert all(math.isfinite(event.duration) and event.duration >= 0 for event in events)
