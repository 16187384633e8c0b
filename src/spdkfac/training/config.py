"""The ``spdkfac train`` configuration: one frozen dataclass, validated, file round trip."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spdkfac.checks import check_choice, check_int, check_number
from spdkfac.layers.batchnorm import BATCHNORM_MODES
from spdkfac.optional import (
    OptionalPackageError,
    install_hint,
    optional_import,
    require,
    unavailable_reason,
)
from spdkfac.strategies import ALGORITHMS

__all__ = [
    "BATCHNORM_CURVATURES",
    "DATASETS",
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "RESUMABLE_CHANGES",
    "TrainConfig",
    "incompatible_fields",
    "load_config_file",
]

DATASETS: tuple[str, ...] = ("fashion-mnist", "cifar10", "imagefolder")
OPTIMIZERS: tuple[str, ...] = ("sgd", "kfac")
LR_SCHEDULES: tuple[str, ...] = ("constant", "step", "cosine", "polynomial")
#: ``--batchnorm`` values: "off" (plain gradient) or a mode of ``KFACPreconditioner``.
BATCHNORM_CURVATURES: tuple[str, ...] = ("off", *BATCHNORM_MODES)
#: Fields a resumed run may change; any other difference refuses the checkpoint.
RESUMABLE_CHANGES: frozenset[str] = frozenset(
    {"epochs", "max_steps", "out_dir", "resume", "checkpoint_every", "threads",
     "tensorboard", "target_accuracy", "data", "config", "collective_timeout"}
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a training run (see ``spdkfac train --help`` for each)."""

    model: str = "resnet20"
    dataset: str = "fashion-mnist"
    data: str | None = None
    image_size: int = 32
    epochs: int = 10
    max_steps: int | None = None
    batch_size: int = 128
    accumulation_steps: int = 1
    optimizer: str = "kfac"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    lr_schedule: str = "cosine"
    warmup_epochs: float = 0.0
    milestones: tuple[float, ...] = ()
    lr_gamma: float = 0.1
    poly_power: float = 2.0
    poly_start_epoch: float = 0.0
    poly_end_epoch: float | None = None
    strategy: str = "spd-kfac"
    damping: float = 0.003
    damping_initial: float | None = None
    damping_warmup_steps: int = 0
    kl_clip: float | None = 0.001
    factor_decay: float = 0.95
    factor_update_steps: int = 1
    inv_update_steps: int = 10
    stale_switch_step: int | None = None
    stale_factor_update_steps: int = 10
    stale_inv_update_steps: int = 100
    stale_growth_steps: int = 0
    batchnorm: str = "off"
    batchnorm_damping_multiplier: float = 1.0
    weight_rescaling: bool = False
    mixup_alpha: float = 0.0
    random_erasing: float = 0.0
    label_smoothing: float = 0.0
    augment: bool = True
    seed: int = 0
    threads: int | None = None
    collective_timeout: float = 600.0
    out_dir: str = "runs/train"
    checkpoint_every: int = 0
    resume: bool = False
    target_accuracy: float = 0.92
    tensorboard: bool = True
    config: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_choice("dataset", self.dataset, DATASETS)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_choice("strategy", self.strategy, ALGORITHMS)
        check_choice("batchnorm", self.batchnorm, BATCHNORM_CURVATURES)
        check_number("batchnorm_damping_multiplier", self.batchnorm_damping_multiplier)
        for name in ("epochs", "batch_size", "accumulation_steps", "image_size",
                     "factor_update_steps", "inv_update_steps",
                     "stale_factor_update_steps", "stale_inv_update_steps"):  # fmt: skip
            check_int(name, getattr(self, name), low=1)
        for name in ("damping_warmup_steps", "checkpoint_every", "seed", "stale_growth_steps"):
            check_int(name, getattr(self, name), low=0)
        for name in ("max_steps", "threads", "stale_switch_step"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), low=1)
        for name in ("lr", "damping", "factor_decay", "lr_gamma", "poly_power",
                     "collective_timeout"):  # fmt: skip
            check_number(name, getattr(self, name))
        for name in ("momentum", "weight_decay", "warmup_epochs", "mixup_alpha",
                     "poly_start_epoch"):  # fmt: skip
            check_number(name, getattr(self, name), low_inclusive=True)
        for name in ("random_erasing", "label_smoothing", "target_accuracy"):
            check_number(name, getattr(self, name), low_inclusive=True, high=1.0)
        check_number("factor_decay", self.factor_decay, high=1.0)
        for name in ("kl_clip", "damping_initial", "poly_end_epoch"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name))
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov needs momentum > 0, got momentum=0")
        for milestone in self.milestones:
            check_number("milestones", milestone)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (tuples as lists), for checkpoints and TOML."""
        values = dataclasses.asdict(self)
        values["milestones"] = list(self.milestones)
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError`` naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown training option(s): {', '.join(unknown)}")
        cleaned = dict(values)
        if "milestones" in cleaned:
            cleaned["milestones"] = tuple(cleaned["milestones"])
        return cls(**cleaned)

    def to_toml(self) -> str:
        """The configuration as a TOML document (None values are omitted)."""
        lines = []
        for key, value in self.to_dict().items():
            if value is None or key == "config":
                continue
            lines.append(f"{key} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"


def incompatible_fields(saved: dict[str, Any], current: TrainConfig) -> list[str]:
    """Fields whose value differs between a checkpoint's config and this run's."""
    now = current.to_dict()
    return sorted(
        key
        for key in set(saved) | set(now)
        if key not in RESUMABLE_CHANGES and saved.get(key) != now.get(key)
    )


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (``.toml``) or YAML (``.yaml``/``.yml``) file of training options.

    Raises:
        FileNotFoundError: The file does not exist (the message names it).
        ValueError: It cannot be parsed, or YAML is asked for without PyYAML installed.
    """
    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"config file {source} does not exist")
    text = source.read_text()
    try:
        if source.suffix in (".yaml", ".yml"):
            try:
                yaml = require("yaml", "a YAML config file")
            except OptionalPackageError as error:
                raise ValueError(f"{source}: {error}") from None
            loaded = yaml.safe_load(text) or {}
        else:
            loaded = _parse_toml(text)
    except ValueError:
        raise
    except Exception as error:
        raise ValueError(f"{source}: cannot be parsed ({error})") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{source}: expected a table of options, got {type(loaded).__name__}")
    return {str(key).replace("-", "_"): value for key, value in loaded.items()}


def _parse_toml(text: str) -> Any:
    # tomllib is in the standard library from Python 3.11; tomli is its 3.10 backport.
    for name in ("tomllib", "tomli"):
        module = optional_import(name)
        if module is not None:
            return module.loads(text)
    raise ValueError(
        f"TOML configs on Python 3.10 need tomli ({unavailable_reason('tomli')}): "
        f"{install_hint('tomli')}"
    )


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
