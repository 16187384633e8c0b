"""Each ``--optimizer`` runs its own defaults; every option takes effect or is refused in
one line; ``config.toml`` records what ran."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from spdkfac.cli import main
from spdkfac.cli.main import build_parser
from spdkfac.cli.train import _config_from_args
from spdkfac.models import build_model
from spdkfac.training.config import TrainConfig
from spdkfac.training.config_files import load_config_file
from spdkfac.training.optimizer_table import KFAC_ONLY, OPTIMIZER_TABLE
from spdkfac.training.setup import make_optimizers

__all__: list[str] = []

GPT = ("--model", "gpt", "--dataset", "text")


def _config(*flags: str) -> TrainConfig:
    return _config_from_args(build_parser().parse_args(["train", *GPT, *flags]))


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("gpt", vocab_size=32, block_size=8, n_layer=1, n_head=2, d_model=16)


def test_kfac_muon_runs_the_recipe_and_its_config_says_so(tmp_path: Path) -> None:
    config = _config("--optimizer", "kfac-muon")
    assert (config.lr, config.momentum, config.nesterov) == (0.0108, 0.95, True)
    kfac = config.kfac
    assert (kfac.inverse_method, kfac.kl_clip, kfac.damping) == ("one-sided", None, 0.654)
    path = tmp_path / "config.toml"
    path.write_text(config.to_toml())
    saved = load_config_file(path)
    assert saved["inverse_method"] == "one-sided" and saved["kl_clip"] == 0.0
    assert (saved["lr"], saved["momentum"]) == (0.0108, 0.95)
    assert TrainConfig.from_dict(saved) == config  # it reads back as it ran
    # What the file says is what the optimizer and the preconditioner got.
    model = _gpt()
    _, optimizer, precond = make_optimizers(config, model, steps_per_epoch=5)
    assert precond is not None and precond.config.inverse_method == "one-sided"
    assert precond.config.kl_clip is None
    muon = optimizer.parts["muon"]  # type: ignore[attr-defined]
    group = muon.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.0108, 0.95, True)


@pytest.mark.parametrize("optimizer", list(OPTIMIZER_TABLE))
def test_every_optimizer_records_what_ran_and_reads_back(optimizer: str, tmp_path: Path) -> None:
    row = OPTIMIZER_TABLE[optimizer]
    config = TrainConfig.from_dict({"model": "gpt", "dataset": "text", "optimizer": optimizer})
    for name, value in row.defaults.items():
        assert config.to_dict()[name] == value, name
    path = tmp_path / "config.toml"
    path.write_text(config.to_toml())
    saved = load_config_file(path)
    # An optimizer without K-FAC records no K-FAC option (none of them ran).
    assert (set(KFAC_ONLY) & set(saved) != set()) == row.kfac
    assert ("beta2" in saved) == (row.base in ("adamw", "muon", "eigen-adam", "eigen-adam-muon"))
    assert TrainConfig.from_dict(saved) == config


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--optimizer", "kfac-muon", "--kl-clip", "0.01"),
         "kl_clip 0.01 does not apply to optimizer 'kfac-muon' .*orthogonalization"),
        (("--optimizer", "kfac-muon", "--grafting", "adam"), "grafting 'adam' does not apply"),
        (("--optimizer", "kfac-muon", "--normalization", "diagonal"),
         "normalization 'diagonal' does not apply.*norms are AdamW's"),
        (("--optimizer", "kfac-eigen-adam", "--kl-clip", "0.001"),
         "kl_clip must be None with inverse_method='eigen-adam' \\(got 0.001\\).*Adam's own"),
        (("--optimizer", "kfac-eigen-adam", "--momentum", "0.9"),
         "momentum 0.9 does not apply.*momentum-free SGD"),
        (("--optimizer", "kfac-eigen-adam", "--inverse-method", "cholesky"),
         "inverse_method 'cholesky' does not apply.*eigen-adam form"),
        (("--optimizer", "adamw", "--momentum", "0.5"), "momentum 0.5 does not apply.*beta1"),
        (("--optimizer", "soap", "--nesterov"), "nesterov True does not apply"),
        (("--optimizer", "sgd", "--damping", "0.3"),
         r"damping 0.3 does not apply to optimizer 'sgd': it has no K-FAC"),
        (("--optimizer", "muon", "--strategy", "osawa"), "strategy 'osawa' does not apply"),
        (("--optimizer", "adamw", "--stale-switch-step", "5"), "stale_switch_step 5 does not"),
    ],
)  # fmt: skip
def test_an_option_the_optimizer_does_not_use_is_refused_in_one_line(
    flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", *GPT, *flags])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage: spdkfac train")
    assert re.search(message, lines[1]), lines[1]


def test_given_options_win_and_take_effect() -> None:
    # The form the user names reaches the preconditioner: eigen-Adam then Muon (no KL clip
    # the user never set), and two-sided K-FAC then Muon.
    for form in ("eigen-adam", "cholesky"):
        config = _config("--optimizer", "kfac-muon", "--inverse-method", form)
        _, _, precond = make_optimizers(config, _gpt(), steps_per_epoch=5)
        assert precond is not None and precond.config.inverse_method == form
        assert precond.config.kl_clip is None
    config = _config("--optimizer", "kfac-muon", "--lr", "0.02", "--momentum", "0.9",
                     "--no-nesterov", "--kl-clip", "0")  # fmt: skip
    _, optimizer, _ = make_optimizers(config, _gpt(), steps_per_epoch=5)
    group = optimizer.parts["muon"].param_groups[0]  # type: ignore[attr-defined]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (0.02, 0.9, False)
    # A value equal to what the optimizer runs is accepted (a config.toml fed back).
    assert _config("--optimizer", "adamw", "--momentum", "0.9").momentum == 0.9
    assert _config("--optimizer", "kfac", "--lr", "0.05").lr == 0.05


@pytest.mark.parametrize(
    ("values", "message"),
    [({"model": "mlp", "gpt_layers": 3}, "gpt_layers 3 applies to text datasets only"),
     ({"model": "cnn", "seq_len": 64}, "seq_len 64 applies to text"),
     ({"model": "gpt", "dataset": "text", "augment": False},
      "augment False applies to image datasets only"),
     ({"model": "gpt", "dataset": "gcide", "target_accuracy": 0.5},
      "target_accuracy 0.5 applies to image")],
)  # fmt: skip
def test_an_option_of_the_other_kind_of_data_is_refused(
    values: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_dict(values)
    defaults = {key: value for key, value in values.items() if key in ("model", "dataset")}
    TrainConfig.from_dict(defaults)  # at their defaults: fine (every recorded run has them)


@pytest.mark.parametrize("form", ["cholesky", "eigen-basis", "eigen-adam"])
def test_kfac_muon_takes_another_form_without_a_kl_clip_the_user_never_set(form: str) -> None:
    config = _config("--optimizer", "kfac-muon", "--inverse-method", form)
    assert (config.kfac.inverse_method, config.kfac.kl_clip) == (form, None)
    model = _gpt()
    _, _, precond = make_optimizers(config, model, steps_per_epoch=5)
    assert precond is not None and precond.config.inverse_method == form
