"""``TrainConfig.kfac``: the library's K-FAC options nested in the training configuration,
one set of defaults for both, and the flat form files and checkpoints have always held."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spdkfac.cli.main import build_parser
from spdkfac.cli.train import _config_from_args
from spdkfac.config import KFACConfig
from spdkfac.layers import FactorOptions
from spdkfac.schedules import damping_warmup, stale_interval
from spdkfac.training.config import KFACSchedules, TrainConfig, load_config_file

__all__: list[str] = []

REPORTS = Path(__file__).resolve().parents[2] / "benchmarks" / "reports"

#: The flat form's keys (flags, config files, checkpoints), as before the nesting.
FLAT_KEYS = {
    "model", "dataset", "data", "image_size", "seq_len", "gpt_layers", "gpt_heads", "gpt_dim",
    "gpt_dropout", "train_limit", "val_split", "epochs", "max_steps", "eval_every",
    "evals_per_epoch", "batch_size", "accumulation_steps", "optimizer", "lr", "momentum",
    "nesterov", "weight_decay", "lr_schedule", "warmup_epochs", "warmup_steps", "milestones",
    "beta2", "grad_clip", "grafting", "decay_scope", "precondition_frequency",
    "lr_gamma", "poly_power", "poly_start_epoch", "poly_end_epoch", "lr_schedule_steps",
    "strategy", "inverse_method", "comm_scheduler", "damping", "damping_initial",
    "damping_warmup_steps", "kl_clip", "factor_decay", "factor_update_steps",
    "inv_update_steps", "stale_switch_step", "stale_factor_update_steps",
    "stale_inv_update_steps", "stale_growth_steps", "weight_sharing", "factor_examples",
    "batchnorm", "normalization", "batchnorm_damping_multiplier", "weight_rescaling",
    "mixup_alpha",
    "random_erasing", "label_smoothing", "augment", "seed", "threads", "flush_denormal",
    "collective_timeout", "fsdp", "hsdp_replicas", "tp_size", "out_dir", "checkpoint_every",
    "resume",
    "overwrite", "target_accuracy", "tensorboard", "config",
}  # fmt: skip

#: ``benchmarks/reports/gpt_text_2workers/runs/adamw+spd-kfac-0/config.toml`` as written
#: then (flat, without the options added since: inverse_method, comm_scheduler, ...).
OLD_CONFIG_TOML = """\
model = "gpt"
dataset = "text"
image_size = 32
seq_len = 128
gpt_layers = 2
gpt_heads = 4
gpt_dim = 128
gpt_dropout = 0.0
epochs = 10
max_steps = 300
eval_every = 25
batch_size = 16
accumulation_steps = 1
optimizer = "kfac-adamw"
lr = 0.003
momentum = 0.9
nesterov = false
weight_decay = 0.0005
lr_schedule = "constant"
warmup_epochs = 0.0
milestones = []
lr_gamma = 0.1
poly_power = 2.0
poly_start_epoch = 0.0
strategy = "spd-kfac"
damping = 0.01
damping_warmup_steps = 0
kl_clip = 0.001
factor_decay = 0.95
factor_update_steps = 5
inv_update_steps = 50
stale_factor_update_steps = 10
stale_inv_update_steps = 100
stale_growth_steps = 0
batchnorm = "off"
batchnorm_damping_multiplier = 1.0
weight_rescaling = false
mixup_alpha = 0.0
random_erasing = 0.0
label_smoothing = 0.0
augment = true
seed = 0
threads = 1
collective_timeout = 600.0
out_dir = "benchmarks/reports/gpt_text_2workers/runs/adamw+spd-kfac-0"
checkpoint_every = 0
resume = false
target_accuracy = 0.92
tensorboard = false
"""


def test_the_library_and_every_verb_share_one_set_of_kfac_defaults() -> None:
    assert TrainConfig().kfac == KFACConfig()
    assert _config_from_args(build_parser().parse_args(["train"])).kfac == KFACConfig()
    assert (KFACConfig().damping, KFACConfig().inv_update_steps) == (0.1, 10)
    parser = build_parser()
    demo = parser.parse_args(["demo"])
    bench = parser.parse_args(["bench"])
    defaults = KFACConfig()
    # The demo runs its own measured recipe (flags, as a user would pass them).
    recipe = (demo.damping, demo.kl_clip, demo.factor_update_steps, demo.inv_update_steps)
    assert recipe == (0.3, 1e-3, 10, 10)
    assert demo.strategy == defaults.strategy
    assert bench.damping == defaults.damping
    # The benchmark times every phase at every iteration: its refresh intervals are 1.
    assert (bench.factor_update_steps, bench.inv_update_steps) == (1, 1)


def test_the_transformer_recipe_has_its_own_defaults_and_given_values_win(
    tmp_path: Path,
) -> None:
    """``--optimizer kfac-muon`` / ``kfac-eigen-adam`` take the recipe's damping and refresh
    intervals where neither a flag nor the config file gives them; other optimizers keep
    the library's."""

    def kfac(*flags: str) -> KFACConfig:
        return _config_from_args(build_parser().parse_args(["train", *flags])).kfac

    muon = kfac("--optimizer", "kfac-muon")
    assert (muon.damping, muon.factor_update_steps, muon.inv_update_steps) == (0.654, 5, 50)
    eigen = kfac("--optimizer", "kfac-eigen-adam")
    assert (eigen.damping, eigen.factor_update_steps, eigen.inv_update_steps) == (0.1, 10, 10)
    assert kfac("--optimizer", "kfac-adamw") == KFACConfig()
    given = kfac("--optimizer", "kfac-muon", "--damping", "0.05", "--inv-update-steps", "25")
    assert (given.damping, given.factor_update_steps, given.inv_update_steps) == (0.05, 5, 25)
    path = tmp_path / "run.toml"
    path.write_text('optimizer = "kfac-muon"\nfactor_update_steps = 2\n')
    from_file = kfac("--config", str(path))
    assert (from_file.damping, from_file.factor_update_steps) == (0.654, 2)
    assert TrainConfig.from_dict({"optimizer": "kfac-muon"}).kfac.damping == 0.654
    # A run's saved configuration holds every value: it reads back as it ran.
    saved = TrainConfig.from_dict({"optimizer": "kfac-muon", "damping": 0.1}).to_dict()
    assert TrainConfig.from_dict(saved).kfac.damping == 0.1


def test_the_flat_form_keeps_its_keys_and_round_trips() -> None:
    config = TrainConfig(
        model="mlp",
        kfac=KFACConfig(
            damping=0.3,
            batchnorm="unit-wise",
            grafting="adam",
            factor_options=FactorOptions(examples=8),
        ),
        kfac_schedules=KFACSchedules(damping_initial=1.0, damping_warmup_steps=5),
    )
    flat = config.to_dict()
    assert set(flat) == FLAT_KEYS
    assert (flat["damping"], flat["batchnorm"], flat["factor_examples"]) == (0.3, "unit-wise", 8)
    assert flat["grafting"] == "adam"
    assert flat["damping_initial"] == 1.0 and TrainConfig().to_dict()["batchnorm"] == "off"
    assert TrainConfig.from_dict(flat) == config
    with pytest.raises(ValueError, match=r"unknown training option.*kfac"):
        TrainConfig.from_dict({"kfac": {"damping": 0.3}})


def test_a_config_file_written_before_the_nesting_reads_as_it_did(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text(OLD_CONFIG_TOML)
    values = load_config_file(path)
    config = TrainConfig.from_dict(values)
    kfac = config.kfac
    assert (kfac.damping, kfac.factor_update_steps, kfac.inv_update_steps) == (0.01, 5, 50)
    assert (kfac.strategy, kfac.batchnorm, kfac.kl_clip) == ("spd-kfac", None, 0.001)
    # Options the file predates take their defaults.
    assert (kfac.inverse_method, kfac.comm_scheduler, kfac.weight_sharing) == (
        "cholesky", "fifo", "expand",
    )  # fmt: skip
    assert config.flush_denormal and config.val_split == 0.0
    assert {key: config.to_dict()[key] for key in values} == values


def test_no_kl_clip_survives_the_config_file(tmp_path: Path) -> None:
    """``--kl-clip 0`` (None) is written as 0, not left out: left out, the file read back
    as the default clip (and refused the eigen-adam form, which needs none)."""
    config = TrainConfig.from_dict({"optimizer": "kfac", "momentum": 0.0, "kl_clip": 0,
                                    "inverse_method": "eigen-adam"})  # fmt: skip
    assert config.kfac.kl_clip is None
    path = tmp_path / "config.toml"
    path.write_text(config.to_toml())
    assert "kl_clip = 0.0" in path.read_text().splitlines()
    assert TrainConfig.from_dict(load_config_file(path)) == config


#: What the transformer recipe's runs recorded before ``config.toml`` held what ran: an
#: option the optimizer ignored at the value it did not use. Such a file is refused,
#: naming it, never read as a run that did not happen.
_MISRECORDED = {"kfac-muon": "kl_clip 0.001", "kfac-eigen-adam": "momentum 0.9"}


def test_every_recorded_run_config_still_loads() -> None:
    paths = sorted(REPORTS.glob("**/runs/*/config.toml"))
    if not paths:
        pytest.skip(f"no recorded run configurations under {REPORTS}")
    for path in paths:
        values = load_config_file(path)
        misrecorded = _MISRECORDED.get(values["optimizer"])
        if misrecorded is not None and values.get(misrecorded.split()[0]) != 0:
            with pytest.raises(ValueError, match=f"{misrecorded} does not apply"):
                TrainConfig.from_dict(values)
            continue
        assert {key: TrainConfig.from_dict(values).to_dict()[key] for key in values} == values


def test_kfac_options_the_run_cannot_save_are_refused() -> None:
    with pytest.raises(ValueError, match="no option for kfac's inverse_dtype"):
        TrainConfig(kfac=KFACConfig(inverse_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="factor_options"):
        TrainConfig(kfac=KFACConfig(factor_options=FactorOptions(method="reference")))
    with pytest.raises(ValueError, match=r"damping must be numbers.*kfac_schedules"):
        TrainConfig(kfac=KFACConfig(damping=lambda step: 0.1))
    with pytest.raises(ValueError, match="kfac must be a KFACConfig"):
        TrainConfig(kfac={"damping": 0.1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stale_inv_update_steps"):
        KFACSchedules(stale_inv_update_steps=0)
    with pytest.raises(ValueError, match="damping"):
        TrainConfig.from_dict({"damping": 0})


def test_the_schedules_turn_the_nested_options_into_functions_of_the_step() -> None:
    kfac = KFACConfig(damping=0.1, factor_update_steps=2, inv_update_steps=10)
    assert KFACSchedules().applied_to(kfac) == kfac
    schedules = KFACSchedules(damping_initial=1.0, damping_warmup_steps=10, stale_switch_step=20,
                              stale_factor_update_steps=8, stale_inv_update_steps=40,
                              stale_growth_steps=10)  # fmt: skip
    applied = schedules.applied_to(kfac)
    damping = damping_warmup(1.0, 0.1, 10)
    factor = stale_interval(2, 8, 20, growth_steps=10)
    inverse = stale_interval(10, 40, 20, growth_steps=10)
    for step in (0, 5, 10, 19, 20, 30, 45, 100):
        assert applied.damping_at(step) == damping(step)
        assert applied.intervals_at(step) == (factor(step), inverse(step))
    assert (applied.kl_clip, applied.strategy) == (kfac.kl_clip, kfac.strategy)
