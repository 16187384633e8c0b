"""Presets: the paper preset re-derives, calibration files override, collectives scale."""

from __future__ import annotations

from pathlib import Path

import pytest

from spdkfac.costmodel import AlphaBetaModel, CalibrationFile, PolynomialInverseModel
from spdkfac.sim import (
    CommunicationModel,
    paper_preset,
    resolve_hardware,
    simulate_strategy,
    workload_for,
)
from spdkfac.sim.paper import PAPER_RESNET50, derive_paper_hardware


def test_paper_preset_is_its_derivation() -> None:
    resnet50 = workload_for("resnet50", batch_size=32)
    derived = derive_paper_hardware(resnet50)
    preset = paper_preset()
    assert preset.device.gemm_flops_per_second == pytest.approx(
        derived.device.gemm_flops_per_second, rel=1e-3
    )
    assert preset.factor.a_rate.flops_per_second == pytest.approx(
        derived.factor.a_rate.flops_per_second, rel=1e-3
    )
    assert preset.inverse.c0 == pytest.approx(derived.inverse.c0, rel=1e-3)
    assert preset.inverse.c3 == pytest.approx(derived.inverse.c3, rel=1e-3)
    # What was fitted comes back out of the simulator.
    d_kfac = simulate_strategy(resnet50, preset, 64, "d-kfac").breakdown
    assert d_kfac["FF&BP"] == pytest.approx(PAPER_RESNET50["FF&BP"], rel=2e-3)
    assert d_kfac["FactorComp"] == pytest.approx(PAPER_RESNET50["FactorComp"], rel=2e-3)
    assert d_kfac["InverseComp"] == pytest.approx(PAPER_RESNET50["inverse non-dist"], rel=2e-3)


def test_ring_scaling_of_collectives() -> None:
    broadcast = AlphaBetaModel(alpha=1e-4, beta=1e-9)
    allreduce = AlphaBetaModel(alpha=2e-4, beta=2e-9)
    ring = CommunicationModel({2: (broadcast, allreduce)}, scaling="ring")
    assert ring.at(2) == (broadcast, allreduce)
    b8, a8 = ring.at(8)
    assert a8.alpha == pytest.approx(2e-4 * 7) and a8.beta == pytest.approx(2e-9 * (7 / 8) / 0.5)
    assert b8.alpha == pytest.approx(1e-4 * 3) and b8.beta == pytest.approx(1e-9)
    constant = CommunicationModel({64: (broadcast, allreduce)})
    assert constant.at(8) == (broadcast, allreduce)
    assert constant.at(1)[1].predict(1e9) == 0.0


def test_calibration_file_overrides(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    CalibrationFile(
        inverse=PolynomialInverseModel(c0=1e-3, c2=0.0, c3=0.0),
        communication={
            2: (AlphaBetaModel(alpha=1e-3, beta=1e-9), AlphaBetaModel(alpha=2e-3, beta=2e-9))
        },
    ).save(path)
    hardware = resolve_hardware("cpu", str(path))
    assert hardware.inverse.c0 == 1e-3
    assert hardware.cost_model(2).allreduce.alpha == 2e-3
    assert hardware.name.startswith("cpu+")
    with pytest.raises(ValueError, match="unknown preset"):
        resolve_hardware("tpu")
    with pytest.raises(FileNotFoundError):
        resolve_hardware("cpu", str(tmp_path / "missing.json"))
