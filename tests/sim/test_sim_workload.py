"""Meta-device tracing: layer counts, shapes and the order of hooks."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

from spdkfac.models import build_model, optional_torchvision_models
from spdkfac.sim import (
    FactorHook,
    GradReady,
    MeasuredCompute,
    cpu_preset,
    measure_compute,
    model_by_name,
    trace_workload,
    workload_for,
)


def test_resnet50_layers_and_parameters() -> None:
    workload = workload_for("resnet50", batch_size=32)
    kinds = [layer.kind for layer in workload.layers]
    assert kinds.count("conv2d") == 53 and kinds.count("linear") == 1
    assert len(workload.layers) == 54
    assert workload.parameter_count == 25_557_032  # torchvision's ResNet-50
    first, fc = workload.layers[0], workload.layers[-1]
    assert (first.name, first.a_dim, first.g_dim, first.rows) == (
        "conv1",
        3 * 7 * 7,
        64,
        32 * 112 * 112,
    )
    assert (fc.name, fc.a_dim, fc.g_dim, fc.rows) == ("fc", 2049, 1000, 32)
    conv2 = workload.layer("layer1.0.conv2")
    assert (conv2.a_dim, conv2.g_dim, conv2.rows) == (64 * 9, 64, 32 * 56 * 56)
    assert workload.layer("layer4.2.conv2").a_dim == 512 * 9
    # ~4.1 GMAC per image forward, twice that backward: ~24.5 GFLOP per image in all.
    assert sum(op.flops for op in workload.ops()) / 32 == pytest.approx(24.3e9, rel=0.03)
    assert next(op for op in workload.ops() if op.name == "aten.convolution").gemm_side == 64


def test_other_imagenet_models() -> None:
    resnet152 = workload_for("resnet152", batch_size=2)
    assert len(resnet152.layers) == 156 and resnet152.parameter_count == 60_192_808
    densenet = workload_for("densenet201", batch_size=2)
    assert len(densenet.layers) == 201 and densenet.parameter_count == 20_013_928
    assert densenet.layers[-1].name == "classifier"


def test_hooks_follow_execution_order() -> None:
    workload = workload_for("resnet32", batch_size=4)
    assert len(workload.layers) == 34
    a_hooks = [i.layer for i in workload.forward if isinstance(i, FactorHook)]
    assert a_hooks == [layer.name for layer in workload.layers]
    assert workload.g_order[0] == "fc" and workload.g_order[-1] == "conv1"
    ready = [i.parameter for i in workload.backward if isinstance(i, GradReady)]
    assert ready[0].startswith("fc.") and ready[-1] == "conv1.weight"
    assert sorted(ready) == sorted(name for name, _ in workload.parameters)


def test_tracing_a_real_device_times_ops() -> None:
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    workload = trace_workload(model, (6,), batch_size=4, name="tiny", device="cpu", repeats=2)
    assert [layer.name for layer in workload.layers] == ["0", "2"]
    assert (workload.layers[0].a_dim, workload.layers[0].g_dim) == (7, 5)
    assert all(op.seconds is not None and op.seconds >= 0 for op in workload.ops())
    assert model[0].weight.device.type == "cpu"


def test_unknown_model_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        model_by_name("no-such-net")
    with pytest.raises(ValueError, match="batch_size"):
        trace_workload(lambda: nn.Linear(2, 2), (2,), batch_size=0)
    assert model_by_name("wrn16-4").input_shape == (3, 32, 32)
    assert model_by_name("resnet50", input_size=128).input_shape == (3, 128, 128)
    with torch.device("meta"):
        assert isinstance(model_by_name("densenet201").build(), nn.Module)


def test_measured_compute_round_trip(tmp_path: Path) -> None:
    torch.set_num_threads(1)

    def build() -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 3))

    measured = measure_compute(build, (3, 2, 2), batch_size=4, name="tiny", repeats=2)
    assert set(measured.factor_seconds) == {"1", "3"}
    path = measured.save(tmp_path / "tiny.json")
    loaded = MeasuredCompute.load(path)
    assert loaded == measured
    workload = trace_workload(build, (3, 2, 2), batch_size=4, name="tiny")
    timed, hardware = loaded.apply(workload, cpu_preset())
    assert [op.seconds for op in timed.ops()] == list(measured.op_seconds)
    layer = timed.layer("1")
    assert hardware.factor_seconds(timed, layer, "A") == measured.factor_seconds["1"][0]
    with pytest.raises(ValueError, match="batch"):
        loaded.apply(trace_workload(build, (3, 2, 2), batch_size=8, name="tiny"), cpu_preset())
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match=r"bad\.json"):
        MeasuredCompute.load(tmp_path / "bad.json")


class _BrokenTorchvision(importlib.abc.MetaPathFinder):
    """Imports of torchvision fail as PyPI's wheel does beside the CPU torch wheel."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname.split(".")[0] == "torchvision":
            raise RuntimeError("operator torchvision::nms does not exist")
        return None


def test_a_torchvision_that_fails_to_import_counts_as_absent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_BrokenTorchvision(), *sys.meta_path])
    assert optional_torchvision_models() is None
    entry = model_by_name("resnet50")
    assert entry.source == "spdkfac"
    with pytest.raises(ValueError, match="unknown model name 'vgg99'"):
        build_model("vgg99")
