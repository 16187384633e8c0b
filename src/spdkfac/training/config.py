"""The ``spdkfac train`` configuration: one frozen dataclass, validated, file round trip.

Its K-FAC options are a nested :class:`~spdkfac.config.KFACConfig` (``kfac``: the
library's options and defaults, defined once) and Osawa et al.'s schedules over them
(``kfac_schedules``); files and checkpoints hold the flat form, one key per
``spdkfac train`` flag (:mod:`spdkfac.training.kfac_options` translates).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from functools import cache
from typing import Any, get_args

from spdkfac.config import KFACConfig
from spdkfac.models import BUILTIN_MODEL_NAMES, TORCHVISION_PREFIX, ModelKind, model_kind
from spdkfac.support.checks import check_choice, check_int, check_number, plain_scalar
from spdkfac.training.config_files import load_config_file, toml_value
from spdkfac.training.kfac_options import (
    BATCHNORM_CURVATURES,
    KFAC_FLAGS,
    KFACSchedules,
    check_train_kfac,
    kfac_from_flat,
    kfac_to_flat,
)
from spdkfac.training.optimizer_table import (
    OPTIMIZER_TABLE,
    check_optimizer_options,
    optimizer_defaults,
)
from spdkfac.training.recipe import DEFAULT_BETA2, check_recipe
from spdkfac.training.sharding_checks import check_sharding
from spdkfac.types import WeightSharing

__all__ = [
    "BATCHNORM_CURVATURES",
    "DATASETS",
    "DATASET_KINDS",
    "DECAY_SCOPES",
    "KFAC_OPTIMIZERS",
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "RESUMABLE_CHANGES",
    "WEIGHT_SHARINGS",
    "KFACSchedules",
    "TrainConfig",
    "check_model_name",
    "incompatible_fields",
    "load_config_file",
]

#: What each dataset holds, matched against :func:`spdkfac.models.model_kind`.
DATASET_KINDS: dict[str, ModelKind] = {
    "fashion-mnist": "image", "cifar10": "image", "imagefolder": "image", "text": "text",
    "gcide": "text",
}  # fmt: skip
DATASETS: tuple[str, ...] = tuple(DATASET_KINDS)
#: ``--optimizer``: its base optimizer ("kfac" alone is SGD preconditioned by K-FAC); the
#: rows are :data:`~spdkfac.training.optimizer_table.OPTIMIZER_TABLE`'s.
OPTIMIZERS: dict[str, str] = {name: row.base for name, row in OPTIMIZER_TABLE.items()}
#: The ``--optimizer`` values whose base optimizer K-FAC preconditions.
KFAC_OPTIMIZERS = frozenset(name for name, row in OPTIMIZER_TABLE.items() if row.kfac)
LR_SCHEDULES: tuple[str, ...] = ("constant", "step", "cosine", "polynomial")
#: ``--decay-scope``: which parameters weight decay reaches (see
#: :func:`spdkfac.training.optimizers.decay_groups`).
DECAY_SCOPES: tuple[str, ...] = ("all", "matrices")
#: ``--weight-sharing`` values (``KFACPreconditioner``'s ``weight_sharing``).
WEIGHT_SHARINGS: tuple[str, ...] = get_args(WeightSharing)
#: Fields a resumed run may change; any other difference refuses the checkpoint.
RESUMABLE_CHANGES: frozenset[str] = frozenset(
    {"epochs", "max_steps", "out_dir", "resume", "overwrite", "checkpoint_every", "threads",
     "flush_denormal", "tensorboard", "target_accuracy", "data", "config", "collective_timeout",
     "eval_every", "evals_per_epoch", "comm_scheduler"}
)  # fmt: skip


#: Options that mean nothing to a run on the other kind of data (refused away from their
#: defaults there): by the kind the run's dataset holds.
_KIND_ONLY: dict[ModelKind, tuple[str, ...]] = {
    "image": ("seq_len", "gpt_layers", "gpt_heads", "gpt_dim", "gpt_dropout"),
    "text": ("image_size", "augment", "target_accuracy"),
}


def check_model_name(name: object) -> str:
    """``name`` if it names a built-in model or ``torchvision:NAME``; else ``ValueError``.

    Whether torchvision is installed and has ``NAME`` is checked when the model is built
    (``spdkfac train`` does it before any process group exists).
    """
    if isinstance(name, str):
        key = name.lower()
        if key in BUILTIN_MODEL_NAMES:
            return name
        if key.startswith(TORCHVISION_PREFIX) and len(key) > len(TORCHVISION_PREFIX):
            return name
    raise ValueError(
        f"unknown model {name!r}; choose one of {', '.join(BUILTIN_MODEL_NAMES)} or "
        f"{TORCHVISION_PREFIX}NAME for a torchvision.models model"
    )


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that defines a training run (see ``spdkfac train --help`` for each).

    ``kfac`` holds the K-FAC options (:class:`~spdkfac.config.KFACConfig`, with its
    defaults; only those ``spdkfac train`` has a flag for may differ from them, so that
    the run's files hold it whole), ``kfac_schedules`` the damping warm-up and stale
    refresh intervals over them. :meth:`from_dict` reads the flat form of the flags.
    """

    model: str = "resnet20"
    dataset: str = "fashion-mnist"
    data: str | None = None
    image_size: int = 32
    seq_len: int = 128
    gpt_layers: int = 2
    gpt_heads: int = 4
    gpt_dim: int = 128
    gpt_dropout: float = 0.0
    train_limit: int | None = None
    val_split: float = 0.0
    epochs: int = 10
    max_steps: int | None = None
    eval_every: int | None = None
    evals_per_epoch: int | None = None
    batch_size: int = 128
    optimizer: str = "kfac"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    decay_scope: str = "all"
    beta2: float = DEFAULT_BETA2
    grad_clip: float = 0.0
    precondition_frequency: int | None = None
    lr_schedule: str = "cosine"
    warmup_epochs: float = 0.0
    warmup_steps: int | None = None
    milestones: tuple[float, ...] = ()
    lr_gamma: float = 0.1
    poly_power: float = 2.0
    poly_start_epoch: float = 0.0
    poly_end_epoch: float | None = None
    lr_schedule_steps: int | None = None
    kfac: KFACConfig = field(default_factory=KFACConfig)
    kfac_schedules: KFACSchedules = field(default_factory=KFACSchedules)
    weight_rescaling: bool = False
    mixup_alpha: float = 0.0
    random_erasing: float = 0.0
    label_smoothing: float = 0.0
    augment: bool = True
    seed: int = 0
    threads: int | None = None
    flush_denormal: bool = True
    collective_timeout: float = 600.0
    fsdp: bool = False
    hsdp_replicas: int | None = None
    tp_size: int | None = None
    out_dir: str = "runs/train"
    checkpoint_every: int = 0
    resume: bool = False
    overwrite: bool = False
    target_accuracy: float = 0.92
    tensorboard: bool | None = None
    config: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self._plain_numbers()
        check_model_name(self.model)
        check_choice("dataset", self.dataset, DATASETS)
        check_choice("optimizer", self.optimizer, tuple(OPTIMIZERS))
        check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_choice("decay_scope", self.decay_scope, DECAY_SCOPES)
        check_train_kfac(self.kfac)
        if not isinstance(self.kfac_schedules, KFACSchedules):
            raise ValueError(f"kfac_schedules must be a KFACSchedules, got {self.kfac_schedules!r}")
        for name in ("epochs", "batch_size", "image_size", "seq_len", "gpt_layers", "gpt_heads",
                     "gpt_dim"):  # fmt: skip
            check_int(name, getattr(self, name), low=1)
        for name in ("checkpoint_every", "seed"):
            check_int(name, getattr(self, name), low=0)
        for name in ("max_steps", "threads", "train_limit", "eval_every", "evals_per_epoch",
                     "lr_schedule_steps", "precondition_frequency"):  # fmt: skip
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), low=1)
        if self.warmup_steps is not None:
            check_int("warmup_steps", self.warmup_steps, low=0)
        for name in ("lr", "lr_gamma", "poly_power", "collective_timeout"):
            check_number(name, getattr(self, name))
        for name in ("weight_decay", "warmup_epochs", "mixup_alpha", "poly_start_epoch",
                     "grad_clip"):  # fmt: skip
            check_number(name, getattr(self, name), low_inclusive=True)
        for name in ("momentum", "val_split", "beta2"):
            check_number(
                name, getattr(self, name), low_inclusive=True, high=1.0, high_inclusive=False
            )
        for name in ("random_erasing", "label_smoothing", "target_accuracy", "gpt_dropout"):
            check_number(name, getattr(self, name), low_inclusive=True, high=1.0)
        if self.poly_end_epoch is not None:
            check_number("poly_end_epoch", self.poly_end_epoch)
        if self.tensorboard is not None and not isinstance(self.tensorboard, bool):
            raise ValueError(f"tensorboard must be true, false or unset, got {self.tensorboard!r}")
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov needs momentum > 0, got momentum=0")
        for milestone in self.milestones:
            check_number("milestones", milestone)
        if self.warmup_steps is not None and self.warmup_epochs > 0:
            raise ValueError(
                f"give warmup_epochs ({self.warmup_epochs}) or warmup_steps "
                f"({self.warmup_steps}), not both"
            )
        if self.resume and self.overwrite:
            raise ValueError(
                "give resume (continue the run in out_dir) or overwrite (delete it), not both"
            )
        if self.eval_every is not None and self.evals_per_epoch is not None:
            raise ValueError(
                f"give eval_every ({self.eval_every}) or evals_per_epoch "
                f"({self.evals_per_epoch}), not both"
            )
        self._check_kinds()
        check_sharding(self)
        check_optimizer_options(self.optimizer, self.to_dict(), _field_defaults())
        check_recipe(self)

    def _plain_numbers(self) -> None:
        """Store numpy scalars and 0-d tensors as the Python numbers they hold (TOML and
        ``weights_only`` checkpoints take only those)."""
        for option in fields(self):
            value = getattr(self, option.name)
            if isinstance(value, tuple):
                plain: object = tuple(plain_scalar(v) for v in value)
            else:
                plain = plain_scalar(value)
            if plain is not value:
                object.__setattr__(self, option.name, plain)

    def _check_kinds(self) -> None:
        reads, holds = model_kind(self.model), DATASET_KINDS[self.dataset]
        if reads != holds:
            raise ValueError(
                f"model {self.model!r} reads {reads} but dataset {self.dataset!r} holds "
                f"{holds}; pair image models with image datasets and gpt or llama with --dataset "
                "text or gcide"
            )
        if holds == "text":
            if self.gpt_dim % self.gpt_heads:
                raise ValueError(
                    f"gpt_dim ({self.gpt_dim}) must be a multiple of gpt_heads ({self.gpt_heads})"
                )
            if self.gpt_dropout >= 1.0:
                raise ValueError(f"gpt_dropout must be < 1, got {self.gpt_dropout}")
            if self.gpt_dropout and self.model.lower() == "llama":
                raise ValueError(f"gpt_dropout {self.gpt_dropout}: llama has no dropout")
            for name in ("mixup_alpha", "random_erasing"):
                if getattr(self, name) > 0:
                    raise ValueError(f"{name} is an image augmentation; it needs 0 for text")
            if self.train_limit is not None:
                raise ValueError("train_limit applies to image datasets only")
        defaults = _field_defaults()
        for name in _KIND_ONLY[holds]:
            if getattr(self, name) != defaults[name]:
                other = "text" if holds == "image" else "image"
                raise ValueError(
                    f"{name} {getattr(self, name)!r} applies to {other} datasets only; "
                    f"dataset {self.dataset!r} holds {holds}"
                )

    @property
    def uses_kfac(self) -> bool:
        """Whether K-FAC preconditions the base optimizer."""
        return self.optimizer in KFAC_OPTIMIZERS

    @property
    def accumulation_steps(self) -> int:
        """Forward/backward passes per optimizer step (``kfac.accumulation_steps``: K-FAC
        averages the passes' statistics; the same for every optimizer)."""
        return self.kfac.accumulation_steps

    @property
    def base_optimizer(self) -> str:
        """The optimizer that applies the update: ``"sgd"``, ``"adamw"``, ``"muon"`` (Muon on
        hidden weight matrices, AdamW on the rest), ``"soap"`` (heavyball's SOAP) or
        ``"eigen-adam"`` (the direction of K-FAC's ``eigen-adam`` form as it is on the
        hidden layers, AdamW on the rest) or ``"eigen-adam-muon"`` (that direction
        orthogonalized by Muon without momentum on the hidden weight matrices, as it is on
        their biases, AdamW on the rest)."""
        return OPTIMIZERS[self.optimizer]

    def to_dict(self) -> dict[str, Any]:
        """The flat form: one plain value per ``spdkfac train`` option (tuples as lists),
        for checkpoints and TOML."""
        values: dict[str, Any] = {}
        for spec in dataclasses.fields(self):
            if spec.name == "kfac":
                values.update(kfac_to_flat(self.kfac))
            elif spec.name == "kfac_schedules":
                values.update(dataclasses.asdict(self.kfac_schedules))
            else:
                values[spec.name] = getattr(self, spec.name)
        values["milestones"] = list(self.milestones)
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError`` naming them. A
        missing option takes the ``optimizer``'s default
        (:data:`~spdkfac.training.optimizer_table.OPTIMIZER_TABLE`), else the field's."""
        values = {**optimizer_defaults(values.get("optimizer", cls.optimizer)), **values}
        own = {f.name for f in dataclasses.fields(cls)} - {"kfac", "kfac_schedules"}
        scheduled = {f.name for f in dataclasses.fields(KFACSchedules)}
        unknown = sorted(set(values) - own - scheduled - set(KFAC_FLAGS))
        if unknown:
            raise ValueError(f"unknown training option(s): {', '.join(unknown)}")
        cleaned = {key: value for key, value in values.items() if key in own}
        if "milestones" in cleaned:
            cleaned["milestones"] = tuple(cleaned["milestones"])
        return cls(
            **cleaned,
            kfac=kfac_from_flat(values),
            kfac_schedules=KFACSchedules(
                **{key: value for key, value in values.items() if key in scheduled}
            ),
        )

    def to_toml(self) -> str:
        """The configuration as a TOML document: what the run uses (None values, and the
        K-FAC options of an optimizer without K-FAC, are left out)."""
        row, lines = OPTIMIZER_TABLE[self.optimizer], []
        for key, value in self.to_dict().items():
            if value is None or key == "config" or not row.applies(key):
                continue
            lines.append(f"{key} = {toml_value(value)}")
        return "\n".join(lines) + "\n"


@cache
def _field_defaults() -> dict[str, Any]:
    """:class:`TrainConfig`'s field defaults in the flat form (without building one)."""
    values: dict[str, Any] = {}
    for spec in fields(TrainConfig):
        if spec.name == "kfac":
            values.update(kfac_to_flat(KFACConfig()))
        elif spec.name == "kfac_schedules":
            values.update(dataclasses.asdict(KFACSchedules()))
        else:
            values[spec.name] = spec.default
    values["milestones"] = list(values["milestones"])
    return values


def incompatible_fields(saved: dict[str, Any], current: TrainConfig) -> list[str]:
    """Fields whose value differs between a checkpoint's config and this run's.

    A field the checkpoint does not name (written before the field existed) counts as its
    default value.
    """
    now, defaults = current.to_dict(), TrainConfig().to_dict()
    return sorted(
        key
        for key in set(saved) | set(now)
        if key not in RESUMABLE_CHANGES and saved.get(key, defaults.get(key)) != now.get(key)
    )
