"""The simulator's blocks and inverse form are the run's: discovery with the run's options,
the placed factors of its blocks, each priced by the form's wire size and compute scale."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from spdkfac import KFACConfig, KFACPreconditioner
from spdkfac.cli.main import main
from spdkfac.forms import inverse_form
from spdkfac.linalg import packed_size
from spdkfac.sim import cpu_preset, simulate_strategy, trace_workload, workload_for
from spdkfac.sim.costs import WorkloadCosts
from spdkfac.sim.strategies import STRATEGY_TABLE, prepare


def test_broadcasts_travel_in_the_form_s_wire_size() -> None:
    """Round-robin communicates every factor: the broadcasts carry every factor's packed
    triangle for Cholesky inverses, its ``d² + d`` eigen-basis otherwise."""
    cholesky = workload_for("resnet20", batch_size=8)
    basis = cholesky.with_form(inverse_form("eigen-basis"))
    hardware = cpu_preset()
    dims = [spec.dim for spec in cholesky.factors]
    totals = {}
    for label, workload in (("cholesky", cholesky), ("eigen-basis", basis)):
        setup = prepare(WorkloadCosts(workload, hardware, 4), STRATEGY_TABLE["mpd-kfac"])
        totals[label] = sum(group.elements for group in setup.groups)
    assert totals["cholesky"] == sum(packed_size(d) for d in dims)
    assert totals["eigen-basis"] == sum(d * d + d for d in dims)


def test_the_simulated_iteration_changes_with_the_form() -> None:
    """Each inversion takes the fit times the form's compute scale; a refresh costs
    more with eigen-bases, and the balanced placement prices them so (more CT)."""
    cholesky = workload_for("resnet20", batch_size=8)
    basis = workload_for("resnet20", batch_size=8, config=KFACConfig(inverse_method="eigen-basis"))
    assert [s.key for s in basis.factors] == [s.key for s in cholesky.factors]
    forms = (("cholesky", cholesky), ("eigen-basis", basis))
    hardware = cpu_preset()
    # One rank: nothing contends with the inversions, whose spans are the model's times.
    alone = {label: simulate_strategy(w, hardware, 1, "d-kfac") for label, w in forms}
    key = cholesky.factors[-1].key
    name = f"kfac/inverse_compute/{key}"
    seconds = {
        label: sum(e.duration for e in result.events if e.name == name)
        for label, result in alone.items()
    }
    scale = inverse_form("eigen-basis").compute_scale
    assert seconds["eigen-basis"] == pytest.approx(scale * seconds["cholesky"], rel=1e-12)
    results = {label: simulate_strategy(w, hardware, 4, "mpd-kfac") for label, w in forms}
    assert results["eigen-basis"].iteration_s > results["cholesky"].iteration_s
    plans = {
        label: prepare(WorkloadCosts(w, hardware, 4), STRATEGY_TABLE["spd-kfac"]).plan
        for label, w in forms
    }
    communicated = {
        label: sum(owner >= 0 for owner in plan.owners)
        for label, plan in plans.items()
        if plan is not None
    }
    assert communicated["eigen-basis"] > communicated["cholesky"]


def test_memory_counts_the_form_s_result_shape() -> None:
    cholesky = workload_for("mlp", batch_size=8)
    basis = cholesky.with_form(inverse_form("eigen-basis"))
    hardware = cpu_preset()
    memory = {
        label: simulate_strategy(workload, hardware, 2, "d-kfac").factor_memory_bytes
        for label, workload in (("cholesky", cholesky), ("eigen-basis", basis))
    }
    extra = sum(4 * d for layer in cholesky.layers for d in (layer.a_dim, layer.g_dim))
    assert memory["eigen-basis"] == memory["cholesky"] + extra  # [d, d + 1] per result


class _Mixed(nn.Module):
    """An embedding, a grouped convolution, a batch norm and linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.conv = nn.Conv1d(4, 4, 3, padding=1, groups=2)
        self.norm = nn.BatchNorm1d(4)
        self.hidden = nn.Linear(4, 6)
        self.skipped = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.conv(self.emb(tokens).transpose(1, 2))).transpose(1, 2)
        return self.head(self.skipped(torch.relu(self.hidden(x))))


def test_the_workload_places_exactly_the_run_s_factors() -> None:
    """The simulator registers what the preconditioner registers (discovery with the same
    options): an embedding's diagonal A is not placed, a skipped layer is absent, and the
    blocks it does not model (grouped convolution, batch norm) are listed."""
    config = KFACConfig(
        skip_layers=("skipped",), batchnorm="unit-wise", inverse_method="eigen-basis"
    )
    torch.manual_seed(0)
    model = _Mixed()
    workload = trace_workload(
        model, (5,), batch_size=2, name="mixed", vocab_size=11, config=config, device="cpu"
    )
    precond = KFACPreconditioner(model, config=config, lr=0.1)
    assert workload.factors == precond.plan.factors
    assert [layer.name for layer in workload.layers] == ["emb", "hidden", "head"]
    assert [layer.kind for layer in workload.layers] == ["embedding", "linear", "linear"]
    assert workload.unmodelled == ("conv", "norm")
    assert workload.form.method == "eigen-basis"
    emb = next(spec for spec in workload.factors if spec.layer == "emb")
    assert (emb.key, emb.wire_elements) == ("emb/G", 4 * 4 + 4)


def test_cli_inverse_method_changes_the_result(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", "--model", "resnet20", "--workers", "4", "--preset", "cpu"]
    base += ["--batch-size", "8", "--json", "--strategies", "mpd-kfac"]
    times = {}
    for method in ("cholesky", "eigen-basis"):
        assert main([*base, "--inverse-method", method]) == 0
        runs = json.loads(capsys.readouterr().out)["mpd-kfac"]["runs"]
        times[method] = runs[0]["iteration_s"]
    assert times["eigen-basis"] > times["cholesky"]
    assert main([*base[:-3], "--strategies", "d-kfac", "--inverse-method", "eigen"]) == 0
    assert "inverse method: eigen" in capsys.readouterr().out
