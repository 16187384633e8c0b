"""Optional packages (issue #22): a missing or broken one never breaks what does not need it.

Each optional import site is run with its package broken two ways: raising
``RuntimeError`` on import (PyPI's torchvision beside the CPU torch wheel) and raising
``ImportError`` (a missing package). Then every CLI verb runs with all of them broken.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import spdkfac.support.optional
from optional_helpers import ALL_OPTIONAL, ERRORS, break_packages
from spdkfac.bench.report import write_outputs
from spdkfac.bench.results import BenchResults, VariantResult
from spdkfac.calibrate import CalibrationPlan, calibrate, plot_calibration
from spdkfac.cli.main import main
from spdkfac.comm import LocalCommunicator
from spdkfac.data import load_image_folder
from spdkfac.models import build_model
from spdkfac.models.imagenet import ImageNetResNet
from spdkfac.profiling import Event
from spdkfac.sim import model_by_name
from spdkfac.support.optional import (
    OptionalPackageError,
    import_failure,
    install_hint,
    optional_import,
    require,
    skip_notice,
)
from spdkfac.training.config import load_config_file
from spdkfac.training.metrics import open_tensorboard

KINDS = sorted(ERRORS)


# -- the helper module ------------------------------------------------------------------


@pytest.mark.parametrize("error", KINDS)
def test_any_import_failure_is_not_available_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: str
) -> None:
    break_packages(monkeypatch, tmp_path, ["spdkfac_fake_pkg"], error)
    assert optional_import("spdkfac_fake_pkg") is None
    assert optional_import("spdkfac_fake_pkg.sub") is None
    failure = import_failure("spdkfac_fake_pkg")
    assert failure is not None and failure.startswith(error)
    with pytest.raises(OptionalPackageError) as info:
        require("spdkfac_fake_pkg", "the frobnicator")
    message = str(info.value)
    assert message.startswith("the frobnicator needs the spdkfac_fake_pkg package")
    assert "pip install spdkfac_fake_pkg" in message
    if error == "RuntimeError":
        assert "fails to import (RuntimeError: operator spdkfac_fake_pkg::nms" in message
    else:
        assert "spdkfac_fake_pkg is not installed" in message
    # Both kinds: callers that report bad options (ValueError) report this one too.
    assert isinstance(info.value, ImportError) and isinstance(info.value, ValueError)


def test_a_failure_is_cached_until_the_module_appears(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "spdkfac_counted"
    package.mkdir()
    attempts = tmp_path / "attempts"
    (package / "__init__.py").write_text(
        f"open({str(attempts)!r}, 'a').write('x')\nraise RuntimeError('broken')\n"
    )
    break_packages(monkeypatch, tmp_path / "none", [], "RuntimeError")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert optional_import("spdkfac_counted") is None
    assert optional_import("spdkfac_counted") is None
    assert attempts.read_text() == "x"  # imported (and failed) once
    spdkfac.support.optional.clear_cache()
    assert optional_import("spdkfac_counted") is None
    assert attempts.read_text() == "xx"
    (package / "__init__.py").write_text("VALUE = 3\n")
    monkeypatch.setitem(sys.modules, "spdkfac_counted", None)  # fails again: halted import
    assert optional_import("spdkfac_counted") is None
    monkeypatch.delitem(sys.modules, "spdkfac_counted")
    spdkfac.support.optional.clear_cache()
    module = optional_import("spdkfac_counted")
    assert module is not None and module.VALUE == 3
    assert import_failure("spdkfac_counted") is None
    monkeypatch.delitem(sys.modules, "spdkfac_counted")


def test_torchvision_hint_keeps_torch_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    hint = install_hint("torchvision.models")
    assert "pip install torch==2.13.0 torchvision==0.28.*" in hint
    assert "--index-url https://download.pytorch.org/whl/cpu" in hint
    assert "built for the installed torch 2.13.0+cpu" in hint
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    assert "pip install torch==2.9.1 torchvision==0.24.* (" in install_hint("torchvision")
    assert install_hint("PIL.Image") == "pip install pillow"
    assert install_hint("yaml") == "pip install pyyaml"
    assert install_hint("torch.utils.tensorboard") == "pip install tensorboard"


# -- each import site, its package broken -------------------------------------------------


@pytest.mark.parametrize("error", KINDS)
def test_torchvision_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: str) -> None:
    break_packages(monkeypatch, tmp_path, ["torchvision"], error)
    assert isinstance(build_model("resnet50", num_classes=5, in_channels=3), ImageNetResNet)
    for name in ("resnet50", "resnet152", "densenet121", "densenet201", "resnet20"):
        assert model_by_name(name).source == "spdkfac"
    for ask in (
        lambda: build_model("torchvision:resnet50", in_channels=3),
        lambda: model_by_name("torchvision:resnet50"),
    ):
        with pytest.raises(OptionalPackageError, match="needs the torchvision package") as info:
            ask()
        assert f"torch=={torch.__version__.partition('+')[0]}" in str(info.value)


@pytest.mark.parametrize("error", KINDS)
def test_simulate_resnet50_with_torchvision_broken(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: str,
) -> None:
    break_packages(monkeypatch, tmp_path, ["torchvision"], error)
    assert main(["simulate", "--model", "resnet50", "--workers", "64", "--preset", "paper"]) == 0
    assert "spd-kfac" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["simulate", "--model", "torchvision:resnet50", "--workers", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "model torchvision:resnet50 needs the torchvision package" in err


@pytest.mark.parametrize("error", KINDS)
def test_matplotlib_sites(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: str,
) -> None:
    break_packages(monkeypatch, tmp_path / "broken", ["matplotlib"], error)
    plan = CalibrationPlan(dims=(8, 16), sizes_bytes=(4096,), repeats=1)
    calibration = calibrate(LocalCommunicator(), plan)
    assert not plot_calibration(calibration, None, tmp_path / "fit.png")
    out = capsys.readouterr().out
    assert out.count("skipped") == 1 and "matplotlib" in out
    assert not (tmp_path / "fit.png").exists()
    # The benchmark report: no breakdown.png, and report.md does not claim one.
    results = BenchResults(
        command="spdkfac bench", model="mlp", world_size=1, batch_size=4, link="none",
        variants=(VariantResult("sgd", ((0.1, 0.1, 0.1),), 1, {"FF&BP": 0.1}),),
    )  # fmt: skip
    notices: list[str] = []
    report = write_outputs(
        results, {"sgd": [Event("kfac/iteration/all", 0, 1.0, 0.1)]}, tmp_path / "bench",
        trace_iterations=2, log=notices.append,
    )  # fmt: skip
    assert notices == [skip_notice("matplotlib", "breakdown.png")]
    assert "breakdown.png skipped" in notices[0]
    assert "breakdown.png" not in report.read_text()
    assert not (tmp_path / "bench" / "breakdown.png").exists()
    assert (tmp_path / "bench" / "results.json").is_file()


@pytest.mark.parametrize("error", KINDS)
def test_pillow_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: str) -> None:
    tree = tmp_path / "tree"
    (tree / "cat").mkdir(parents=True)
    (tree / "cat" / "a.png").write_bytes(b"not read")
    break_packages(monkeypatch, tmp_path / "broken", ["PIL"], error)
    with pytest.raises(ImportError, match="needs the Pillow package") as info:
        load_image_folder(tree, size=4)
    assert "pip install pillow" in str(info.value)


@pytest.mark.parametrize("error", KINDS)
def test_tensorboard_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: str) -> None:
    break_packages(monkeypatch, tmp_path / "broken", ["tensorboard"], error)
    notices: list[str] = []
    assert open_tensorboard(tmp_path, notices.append) is None
    assert len(notices) == 1
    assert notices[0].startswith("TensorBoard logging skipped: tensorboard ")
    assert "pip install tensorboard" in notices[0]
    assert not (tmp_path / "tensorboard").exists()


@pytest.mark.parametrize("error", KINDS)
def test_yaml_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: str) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("epochs: 1\n")
    (tmp_path / "run.toml").write_text("epochs = 1\n")
    break_packages(monkeypatch, tmp_path / "broken", ["yaml"], error)
    with pytest.raises(ValueError, match=r"run\.yaml: a YAML config file needs the PyYAML") as info:
        load_config_file(config)
    assert "pip install pyyaml" in str(info.value)
    assert load_config_file(tmp_path / "run.toml") == {"epochs": 1}  # TOML needs no package


# -- every CLI verb, every optional package broken ----------------------------------------


def test_every_verb_runs_with_every_optional_package_broken(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tiny_fashion_mnist: Path,
) -> None:
    break_packages(monkeypatch, tmp_path / "broken", ALL_OPTIONAL, "RuntimeError")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    data = ["--data", str(tiny_fashion_mnist), "--threads", "1"]

    assert main(["simulate", "--model", "resnet50,densenet121", "--workers", "64"]) == 0

    calib = tmp_path / "calib.json"
    assert main(["calibrate", "--out", str(calib), "--dims", "8,16", "--sizes", "4096",
                 "--repeats", "1", "--threads", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert json.loads(calib.read_text())["format"]
    assert "matplotlib is installed but fails to import" in out
    assert not calib.with_suffix(".png").exists() and "wrote " + str(calib) in out
    assert "calib.png" not in out.replace(f"the plot {calib.with_suffix('.png')} skipped", "")

    train_out = tmp_path / "train"
    # TensorBoard asked for: its notice, then the run goes on; by default nothing is said.
    train = ["train", *data, "--model", "mlp", "--epochs", "1", "--batch-size", "64"]
    assert main([*train, "--out-dir", str(train_out), "--tensorboard"]) == 0
    captured = capsys.readouterr()
    notices = (captured.out + captured.err).count("TensorBoard logging skipped")
    assert notices == 1
    assert (train_out / "summary.json").is_file() and not (train_out / "tensorboard").exists()
    assert main([*train, "--out-dir", str(tmp_path / "quiet")]) == 0
    captured = capsys.readouterr()
    assert "TensorBoard" not in captured.out + captured.err

    (tmp_path / "run.yaml").write_text("epochs: 1\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(tmp_path / "run.yaml")])
    assert exit_info.value.code == 2
    assert "needs the PyYAML package" in capsys.readouterr().err

    bench_out = tmp_path / "bench"
    assert main(["bench", "--model", "mlp", "--iters", "2", "--warmup", "1", "--chunk", "1",
                 "--variants", "sgd", "--nproc", "1", "--input-size", "8",
                 "--out-dir", str(bench_out)]) == 0  # fmt: skip
    assert (bench_out / "report.md").is_file() and not (bench_out / "breakdown.png").exists()
    assert "breakdown.png" not in (bench_out / "report.md").read_text()

    demo_out = tmp_path / "demo"
    assert main(["demo", *data, "--epochs", "1", "--batch-size", "64", "--model", "mlp",
                 "--out-dir", str(demo_out)]) == 0  # fmt: skip
    assert "| spd-kfac |" in capsys.readouterr().out
    assert (demo_out / "table.md").is_file() and not (demo_out / "accuracy.png").exists()
    assert os.environ.get("WORLD_SIZE") is None
