"""Cost models: fitting, JSON persistence, bad files, and planners using a saved model."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from spdkfac.costmodel import (
    DEFAULT_COST_MODEL,
    AlphaBetaModel,
    CalibrationFile,
    CalibrationSamples,
    CostModel,
    ExponentialInverseModel,
    FactorSample,
    FactorTimeModel,
    FlopRateModel,
    PolynomialInverseModel,
    load_cost_model,
    median_relative_error,
    resolve_cost_model,
    save_cost_model,
)
from spdkfac.planning.placement import EVERY_RANK, FactorSpec, plan_balanced

SIZES = [int(x) for x in np.geomspace(1024, 64 * 2**20, 25)]
DIMS = [int(x) for x in np.geomspace(32, 4096, 25)]


def _relative(fitted: float, true: float) -> float:
    return abs(fitted - true) / abs(true)


@pytest.mark.parametrize(("alpha", "beta"), [(3e-4, 7e-10), (2e-5, 1e-8), (1e-3, 1e-11)])
def test_alpha_beta_fit_recovers_noiseless_parameters(alpha: float, beta: float) -> None:
    true = AlphaBetaModel(alpha, beta)
    fitted = AlphaBetaModel.fit([(b, true.predict(b)) for b in SIZES])
    assert _relative(fitted.alpha, alpha) < 1e-6
    assert _relative(fitted.beta, beta) < 1e-6


def test_alpha_beta_fit_with_five_percent_noise() -> None:
    rng = np.random.default_rng(1)
    true = AlphaBetaModel(3e-4, 7e-10)
    noisy = [(b, true.predict(b) * (1 + 0.05 * rng.standard_normal())) for b in SIZES * 2]
    fitted = AlphaBetaModel.fit(noisy)
    assert _relative(fitted.alpha, true.alpha) < 0.1
    assert _relative(fitted.beta, true.beta) < 0.1
    assert median_relative_error(fitted, noisy) < 0.06


def test_alpha_beta_fit_clamps_to_non_negative() -> None:
    # A line through these points has a negative intercept: α must be clamped to 0.
    steep = [(1000.0, 1e-6), (2000.0, 3e-6), (4000.0, 7e-6)]
    fitted = AlphaBetaModel.fit(steep)
    assert fitted.alpha == 0.0 and fitted.beta > 0
    # Times falling with size: β must be clamped to 0, α is then a weighted mean.
    falling = [(1000.0, 3e-4), (1e6, 2e-4)]
    fitted = AlphaBetaModel.fit(falling)
    assert fitted.beta == 0.0 and 2e-4 < fitted.alpha < 3e-4


@pytest.mark.parametrize(
    "params",
    [(6e-5, 1e-8, 3.5e-11), (1e-4, 0.0, 2e-11), (0.0, 3e-9, 1e-11), (5e-5, 0.0, 0.0)],
)
def test_polynomial_fit_recovers_noiseless_parameters(params: tuple[float, float, float]) -> None:
    true = PolynomialInverseModel(*params)
    fitted = PolynomialInverseModel.fit([(d, true.predict(d)) for d in DIMS])
    for got, want in zip((fitted.c0, fitted.c2, fitted.c3), params, strict=True):
        if want == 0:
            assert got == 0.0  # the subset without the term wins
        else:
            assert _relative(got, want) < 1e-6


def test_polynomial_fit_with_five_percent_noise() -> None:
    rng = np.random.default_rng(2)
    true = PolynomialInverseModel(6e-5, 1e-8, 3.5e-11)
    noisy = [(d, true.predict(d) * (1 + 0.05 * rng.standard_normal())) for d in DIMS * 3]
    fitted = PolynomialInverseModel.fit(noisy)
    for got, want in zip((fitted.c0, fitted.c2, fitted.c3), (6e-5, 1e-8, 3.5e-11), strict=True):
        assert _relative(got, want) < 0.1


def test_exponential_fit_recovers_paper_model() -> None:
    true = ExponentialInverseModel(alpha=2e-4, beta=1.5e-3)
    samples = [(float(d), true.predict(d)) for d in DIMS]
    for weights in (True, False):
        fitted = ExponentialInverseModel.fit(samples, paper_weights=weights)
        assert _relative(fitted.alpha, 2e-4) < 1e-6 and _relative(fitted.beta, 1.5e-3) < 1e-6


@pytest.mark.parametrize(
    "samples", [[], [(100, 0.0)], [(100, -1.0)], [(-1, 1e-3)], [(100, math.nan)]]
)
def test_fits_reject_unusable_samples(samples: list[tuple[float, float]]) -> None:
    with pytest.raises(ValueError):
        AlphaBetaModel.fit(samples)
    with pytest.raises(ValueError):
        PolynomialInverseModel.fit(samples)


def test_median_relative_error() -> None:
    model = AlphaBetaModel(alpha=1.0, beta=0.0)
    assert median_relative_error(model, [(0, 1.0), (0, 2.0), (0, 0.5)]) == pytest.approx(0.5)


def test_flop_rate_fit_recovers_parameters() -> None:
    true = FlopRateModel(flops_per_second=5e10, overhead_seconds=4e-5)
    fitted = FlopRateModel.fit([(f, true.predict(f)) for f in (2e5, 1e6, 1e7, 1e8, 1e9, 3e9)])
    assert _relative(fitted.overhead_seconds, 4e-5) < 1e-6
    assert _relative(fitted.flops_per_second, 5e10) < 1e-6


def test_factor_time_model_fit_and_fallback() -> None:
    rates = {"A": FlopRateModel(3e11, 8e-5), "G": FlopRateModel(7e10, 3e-5)}
    flops = [1e6, 1e7, 1e8, 1e9, 3e9, 2e5]
    samples = [
        FactorSample(f"layer{i}", kind, f * (2 if kind == "A" else 1), 1.0)
        for i, f in enumerate(flops)
        for kind in ("A", "G")
    ]
    samples = [
        FactorSample(s.layer, s.kind, s.flops, rates[s.kind].predict(s.flops)) for s in samples
    ]
    model = FactorTimeModel.fit(samples)
    for kind, true in rates.items():
        fitted = model.rate(kind)  # type: ignore[arg-type]
        assert _relative(fitted.flops_per_second, true.flops_per_second) < 1e-6
        assert _relative(fitted.overhead_seconds, true.overhead_seconds) < 1e-6
    assert model.seconds("layer1", "G", 123.0) == samples[3].seconds  # measured wins
    assert model.seconds("unknown", "A", 2e9) == pytest.approx(rates["A"].predict(2e9))
    assert model.seconds("unknown", "G", 2e9) == pytest.approx(rates["G"].predict(2e9))
    with pytest.raises(ValueError, match="both A and G"):
        FactorTimeModel.fit(samples[:3])
    with pytest.raises(TypeError):
        model.layers["new"] = (1.0, 1.0)  # type: ignore[index]


def _calibration(world_sizes: tuple[int, ...] = (2,)) -> CalibrationFile:
    communication = {
        p: (AlphaBetaModel(3e-4 * p, 7e-10), AlphaBetaModel(4e-4 * p, 8e-10)) for p in world_sizes
    }
    factor = FactorTimeModel(
        a_rate=FlopRateModel(6e10, 1e-5),
        g_rate=FlopRateModel(2e10, 3e-5),
        layers={"conv1": (1e-3, 2e-4)},
    )
    samples = CalibrationSamples(
        world_size=world_sizes[0],
        inverse=((64, 1e-4), (128, 4e-4)),
        broadcast=((4096, 3e-4),),
        allreduce=((4096, 4e-4),),
        factor=(FactorSample("conv1", "A", 1e6, 1e-3), FactorSample("conv1", "G", 1e5, 2e-4)),
    )
    return CalibrationFile(
        inverse=PolynomialInverseModel(6e-5, 1e-8, 3.5e-11),
        communication=communication,
        factor=factor,
        metadata={"backend": "gloo", "world_sizes": list(world_sizes), "device": "test CPU"},
        samples=samples,
    )


def test_json_round_trip(tmp_path: Path) -> None:
    original = _calibration((2, 4))
    path = original.save(tmp_path / "model.json")
    loaded = CalibrationFile.load(path)
    assert loaded == original
    assert loaded.to_json() == original.to_json()
    document = json.loads(path.read_text())
    assert document["format"] == "spdkfac-costmodel" and document["format_version"] == 1
    assert set(document["communication"]) == {"2", "4"}
    assert load_cost_model(path, 4) == CostModel(
        inverse=original.inverse,
        broadcast=original.communication[4][0],
        allreduce=original.communication[4][1],
    )


def test_save_cost_model_writes_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calibration = _calibration()
    target = tmp_path / "model.json"
    save_cost_model(
        target,
        inverse=calibration.inverse,
        communication=calibration.communication,
        metadata={"note": "first"},
    )
    assert sorted(os.listdir(tmp_path)) == ["model.json"]  # no temporary file left behind
    before = target.read_text()

    def crash(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        calibration.save(target)
    assert target.read_text() == before  # the old file is intact ...
    assert sorted(os.listdir(tmp_path)) == ["model.json"]  # ... and the temporary is gone


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=r"nope\.json"):
        load_cost_model(missing, 2)
    with pytest.raises(FileNotFoundError, match=r"nope\.json"):
        resolve_cost_model(str(missing), 2)


def _mutated(path: Path, edit: str) -> dict[str, object]:
    document = _calibration().to_json()
    if edit == "format":
        document["format"] = "something-else"
    elif edit == "version":
        document["format_version"] = 99
    elif edit == "missing":
        del document["inverse"]
    elif edit == "negative":
        document["communication"]["2"]["broadcast"]["alpha"] = -1.0  # type: ignore[index]
    elif edit == "string":
        document["inverse"]["c3"] = "fast"  # type: ignore[index]
    elif edit == "world":
        document["communication"] = {"two": document["communication"]["2"]}  # type: ignore[index]
    path.write_text(json.dumps(document))
    return document


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        ("format", "not a spdkfac-costmodel file"),
        ("version", "format_version: is 99"),
        ("missing", "inverse: expected an object"),
        ("negative", r"communication\.2\.broadcast: alpha must be"),
        ("string", r"inverse\.c3: expected a number"),
        ("world", "world size"),
    ],
)
def test_wrong_schema_is_a_value_error_naming_file_and_reason(
    tmp_path: Path, edit: str, reason: str
) -> None:
    path = tmp_path / "bad.json"
    _mutated(path, edit)
    with pytest.raises(ValueError, match=reason) as caught:
        load_cost_model(path, 2)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("content", [b"", b'{"format": ', b"\xff\xfe\x00garbage", b"[1, 2]"])
def test_corrupt_file_is_a_value_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "corrupt.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"corrupt\.json"):
        load_cost_model(path, 2)


def test_other_world_size_warns_and_uses_nearest(tmp_path: Path) -> None:
    path = _calibration((2, 8)).save(tmp_path / "model.json")
    with pytest.warns(UserWarning, match=r"world size 3 \(measured: \[2, 8\]\).*world size 2"):
        model = load_cost_model(path, 3)
    assert model.broadcast == AlphaBetaModel(6e-4, 7e-10)
    with pytest.warns(UserWarning, match="model.json"):
        assert load_cost_model(path, 6).broadcast.alpha == pytest.approx(2.4e-3)  # 8 is nearer
    with pytest.warns(UserWarning, match="world size 8"):
        load_cost_model(path, 5)  # a tie goes to the larger (more pessimistic) size


def test_single_process_file_for_many_ranks_warns_and_uses_defaults(tmp_path: Path) -> None:
    path = _calibration((1,)).save(tmp_path / "model.json")
    with pytest.warns(UserWarning, match="built-in default collective costs"):
        model = load_cost_model(path, 4)
    assert model.broadcast == DEFAULT_COST_MODEL.broadcast
    assert model.inverse == PolynomialInverseModel(6e-5, 1e-8, 3.5e-11)


def test_world_size_one_needs_no_entry(tmp_path: Path) -> None:
    path = _calibration((2,)).save(tmp_path / "model.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_cost_model(path, 1)
    assert model.broadcast == model.allreduce == AlphaBetaModel(0.0, 0.0)


def test_resolve_cost_model(tmp_path: Path) -> None:
    assert resolve_cost_model(None, 4) is DEFAULT_COST_MODEL
    custom = CostModel(
        PolynomialInverseModel(0, 0, 1e-9), AlphaBetaModel(0, 0), AlphaBetaModel(0, 0)
    )
    assert resolve_cost_model(custom, 4) is custom
    path = _calibration().save(tmp_path / "model.json")
    assert resolve_cost_model(path, 2) == load_cost_model(path, 2)
    assert resolve_cost_model(str(path), 2) == resolve_cost_model(_calibration(), 2)
    with pytest.raises(TypeError, match="cost_model"):
        resolve_cost_model(42, 2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size"):
        resolve_cost_model(path, 0)


def test_planner_uses_a_saved_model(tmp_path: Path) -> None:
    specs = [
        FactorSpec(f"layer{i}", kind, dim) for i, dim in enumerate((16, 300, 2048)) for kind in "AG"
    ]
    inverse = PolynomialInverseModel(6e-5, 1e-8, 3.5e-11)
    slow, free = AlphaBetaModel(10.0, 1e-3), AlphaBetaModel(0.0, 0.0)
    paths = {}
    for name, link in (("slow", slow), ("free", free)):
        paths[name] = save_cost_model(
            tmp_path / f"{name}.json", inverse=inverse, communication={2: (link, link)}
        )
    never = plan_balanced(specs, 2, resolve_cost_model(paths["slow"], 2))
    always = plan_balanced(specs, 2, resolve_cost_model(paths["free"], 2))
    assert never.owners == (EVERY_RANK,) * len(specs)  # recomputing beats a 10 s broadcast
    assert EVERY_RANK not in always.owners  # a free broadcast: everything communicated
    assert set(always.owners) == {0, 1}


def test_results_are_priced_by_their_wire_elements_and_compute_scale() -> None:
    model = CostModel(
        inverse=PolynomialInverseModel(c0=1.0, c2=0.0, c3=1.0),
        broadcast=AlphaBetaModel(alpha=3.0, beta=0.5),
        allreduce=AlphaBetaModel(alpha=0.0, beta=0.0),
        bytes_per_element=2,
    )
    assert model.inverse_seconds(4) == 65.0
    assert model.inverse_seconds(4, 4.5) == 4.5 * 65.0
    # Default: a packed triangle, d(d + 1)/2 = 10 elements of 2 bytes at 0.5 s per byte.
    assert model.broadcast_seconds(4) == 3.0 + 10.0
    assert model.broadcast_seconds(4, 20) == 3.0 + 20.0  # an eigen-basis: d² + d
