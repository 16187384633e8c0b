"""Bad ``spdkfac train`` flags exit 2 with one error line; honest bench and progress output."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from optional_helpers import break_packages
from spdkfac.cli import main
from spdkfac.cli.main import build_parser

__all__: list[str] = []


def _train_error(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(["train", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    # The one-line usage, then one line naming the problem; never a traceback.
    assert len(lines) == 2 and lines[0].startswith("usage: spdkfac train"), err
    assert "Traceback" not in err
    return lines[1]


def test_unknown_model_exits_2_naming_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    line = _train_error(capsys, "--model", "nonexistent")
    assert "unknown model 'nonexistent'" in line and "resnet20" in line
    assert "torchvision:NAME" in line


def test_unknown_model_in_a_config_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.toml"
    config.write_text('model = "vgg"\n')
    assert "unknown model 'vgg'" in _train_error(capsys, "--config", str(config))


def test_torchvision_model_without_torchvision_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    break_packages(monkeypatch, tmp_path, ["torchvision"], "ImportError")
    line = _train_error(capsys, "--model", "torchvision:vgg11", "--data", str(tmp_path / "none"))
    assert "needs the torchvision package" in line


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--dataset", "mnist"), ("--optimizer", "adam"), ("--lr-schedule", "linear"),
     ("--strategy", "x"), ("--batchnorm", "full")],
)  # fmt: skip
def test_choice_flags_are_checked_by_argparse(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = _train_error(capsys, flag, value)
    assert f"argument {flag}: invalid choice: '{value}'" in line


@pytest.mark.parametrize("momentum", ["1", "1.5", "-0.1"])
def test_momentum_outside_0_1_exits_2(momentum: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = _train_error(capsys, "--momentum", momentum)
    assert "momentum must be a finite number >= 0 and < 1" in line


def test_help_texts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--kl-clip KL_CLIP K-FAC KL clip kappa: the preconditioned gradients V are" in text
    assert "(0 disables the clip)" in text and "omit the flag's value" not in text
    rows = "kfac-muon,kfac-eigen-adam,kfac-eigen-adam-muon"
    assert f"--optimizer {{sgd,kfac,adamw,kfac-adamw,muon,soap,{rows}}}" in text
    assert "--eval-every EVAL_EVERY" in text and "--evals-per-epoch" in text


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.usefixtures("one_thread")
def test_progress_bar_of_max_steps_shows_the_real_total(
    tiny_fashion_mnist: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 256 images, batch 16: 16 steps per epoch; the run stops after 3.
    code = main(["train", "--data", str(tiny_fashion_mnist), "--model", "mlp",
                 "--batch-size", "16", "--max-steps", "3", "--threads", "1",
                 "--no-tensorboard", "--out-dir", str(tmp_path / "out")])  # fmt: skip
    assert code == 0
    err = capsys.readouterr().err
    assert "] 3/3 loss" in err and "/16" not in err


@pytest.mark.usefixtures("one_thread")
def test_bench_does_not_claim_a_skipped_breakdown_png(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    break_packages(monkeypatch, tmp_path / "broken", ["matplotlib"], "ImportError")
    out = tmp_path / "bench"
    code = main(["bench", "--model", "mlp", "--iters", "2", "--warmup", "1", "--chunk", "1",
                 "--variants", "sgd", "--nproc", "1", "--input-size", "8", "--threads", "1",
                 "--out-dir", str(out)])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr()
    assert f"wrote {out / 'report.md'} (and results.json, traces/)" in printed.out
    assert "breakdown.png" not in printed.out and "breakdown.png skipped" in printed.err
    assert not (out / "breakdown.png").exists()


@pytest.mark.usefixtures("one_thread")
def test_bench_names_breakdown_png_when_drawn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib.pyplot")
    out = tmp_path / "bench"
    code = main(["bench", "--model", "mlp", "--iters", "2", "--warmup", "1", "--chunk", "1",
                 "--variants", "sgd", "--nproc", "1", "--input-size", "8", "--threads", "1",
                 "--out-dir", str(out)])  # fmt: skip
    assert code == 0
    assert "(and results.json, breakdown.png, traces/)" in capsys.readouterr().out
    assert (out / "breakdown.png").is_file()


def test_argparse_namespace_is_unchanged_by_the_table() -> None:
    args = build_parser().parse_args(["train", "--max-steps", "5", "--milestones", "1", "2"])
    assert isinstance(args, argparse.Namespace)
    assert args.max_steps == 5 and args.milestones == [1.0, 2.0]


@pytest.mark.parametrize(
    "argv",
    [["demo", "--epochs", "x"], ["simulate", "--workers", "x"], ["bench", "--iters", "-1"],
     ["calibrate", "--repeats", "x"], ["train", "--epochs", "x"]],
)  # fmt: skip
def test_every_verb_says_a_bad_flag_in_one_line_after_a_one_line_usage(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines  # the options were listed before the error (11-15 lines)
    assert lines[0].startswith(f"usage: spdkfac {argv[0]} ") and "--help" in lines[0]
    assert lines[1].startswith(f"spdkfac {argv[0]}: error: argument {argv[1]}")


@pytest.mark.parametrize("verb", ["demo", "simulate", "bench", "calibrate", "train"])
def test_an_unknown_flag_is_named_by_its_verb_in_one_line(
    verb: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([verb, "--no-such-flag"])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"usage: spdkfac {verb} ")
    assert lines[1] == f"spdkfac {verb}: error: unrecognized arguments: --no-such-flag"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from spdkfac import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"spdkfac {__version__}"


def test_spdkfacs_warnings_are_one_line_notes_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's GPT command: LayerNorm layers K-FAC does not take are said once, in
    words, with the flag that acts on them (not Python's file, line and source line)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    flags = ["train", "--model", "gpt", "--dataset", "text", "--data", str(corpus),
             "--optimizer", "kfac-adamw", "--batch-size", "4", "--max-steps", "1",
             "--seq-len", "16", "--gpt-dim", "16", "--gpt-layers", "1",
             "--threads", "1"]  # fmt: skip
    assert main([*flags, "--out-dir", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "not preconditioned" in line]
    assert len(notes) == 1, err
    assert notes[0].startswith("spdkfac train: note: these layers are not preconditioned")
    assert "LayerNorm (3)" in notes[0] and "--normalization" in notes[0]
    assert "UserWarning" not in err and "warnings.warn" not in err and ".py:" not in err
    # The flag it names takes them: no note then.
    assert main([*flags, "--out-dir", str(tmp_path / "b"), "--normalization", "unit-wise"]) == 0
    assert "not preconditioned" not in capsys.readouterr().err
