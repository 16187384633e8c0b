"""``spdkfac train``: train a built-in model on real data with SGD or distributed K-FAC."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from spdkfac.training.config import (
    BATCHNORM_CURVATURES,
    DATASETS,
    LR_SCHEDULES,
    OPTIMIZERS,
    TrainConfig,
    load_config_file,
)

__all__ = ["add_parser", "run"]

_UNSET: Any = object()

_HELP: dict[str, str] = {
    "model": "model name (resnet20/32/56, cnn, mlp, wrn16-4, resnet50/152, densenet121/201, "
    "or torchvision:NAME for a torchvision.models model)",
    "dataset": f"dataset: {', '.join(DATASETS)}",
    "data": "dataset directory (Fashion-MNIST default: Debian's dataset-fashion-mnist)",
    "image_size": "image side for imagefolder datasets",
    "epochs": "training epochs",
    "max_steps": "stop after this many optimizer steps (checkpoints still written)",
    "batch_size": "examples per worker per optimizer step",
    "accumulation_steps": "forward/backward passes per optimizer step (gradient accumulation)",
    "optimizer": f"optimizer: {', '.join(OPTIMIZERS)} (kfac = SGD preconditioned by K-FAC)",
    "lr": "peak learning rate",
    "momentum": "SGD momentum",
    "nesterov": "Nesterov momentum",
    "weight_decay": "L2 weight decay (added after preconditioning)",
    "lr_schedule": f"learning-rate schedule: {', '.join(LR_SCHEDULES)}",
    "warmup_epochs": "linear learning-rate warm-up, in epochs",
    "milestones": "epochs where the step schedule multiplies the lr by --lr-gamma",
    "lr_gamma": "factor of the step schedule",
    "poly_power": "power p of the polynomial decay (Osawa et al.)",
    "poly_start_epoch": "epoch where the polynomial decay starts",
    "poly_end_epoch": "epoch where the polynomial decay reaches 0 (default: --epochs)",
    "strategy": "distributed K-FAC strategy: spd-kfac, mpd-kfac or d-kfac",
    "damping": "K-FAC damping (the target of the damping warm-up)",
    "damping_initial": "initial damping of the warm-up (Osawa et al.)",
    "damping_warmup_steps": "steps over which damping decays from the initial value",
    "kl_clip": "K-FAC KL clip (omit the flag's value with 0 to disable)",
    "factor_decay": "running-average weight of the Kronecker factors",
    "factor_update_steps": "factor refresh interval (early phase)",
    "inv_update_steps": "inverse refresh interval (early phase)",
    "stale_switch_step": "step after which refresh intervals grow (stale statistics)",
    "stale_factor_update_steps": "factor refresh interval after the switch",
    "stale_inv_update_steps": "inverse refresh interval after the switch",
    "stale_growth_steps": "double the intervals every N steps after the switch (0: jump)",
    "batchnorm": (
        "K-FAC curvature for BatchNorm scale and shift: off (plain gradient), diagonal "
        "(Osawa et al.'s diagonal Fisher) or unit-wise (each channel's 2x2 block)"
    ),
    "batchnorm_damping_multiplier": (
        "rho_BN: BatchNorm blocks are damped with rho_BN * damping (Osawa et al.: > 1; "
        "their code uses 16)"
    ),
    "weight_rescaling": "rescale conv/linear weights to norm sqrt(2*d_out) when larger",
    "mixup_alpha": "running mixup Beta(alpha, alpha) (0: off)",
    "random_erasing": "probability of random erasing with zeros (0: off)",
    "label_smoothing": "label smoothing",
    "augment": "random crop and horizontal flip",
    "seed": "random seed",
    "threads": "torch intra-op threads per process",
    "collective_timeout": "seconds a collective may wait for a peer before the run fails",
    "out_dir": "where metrics, summary, TensorBoard logs and checkpoints go",
    "checkpoint_every": "checkpoint every N optimizer steps (0: only at the end)",
    "resume": "continue from the latest checkpoint in --out-dir",
    "target_accuracy": "test accuracy whose time-to-reach is reported",
    "tensorboard": "write TensorBoard logs when the tensorboard package is installed",
}


def add_parser(verbs: Any) -> None:
    """Register the ``train`` verb."""
    parser: argparse.ArgumentParser = verbs.add_parser(
        "train",
        help="train a model on real data with SGD or distributed K-FAC",
        description=(
            "Train a built-in model with SGD or SGD + K-FAC, data parallel under torchrun, "
            "with Osawa et al.'s large-batch schemes, atomic checkpoints and --resume. "
            "Options may come from --config FILE (TOML or YAML, keys as below with "
            "underscores); flags given on the command line win."
        ),
    )
    parser.add_argument("--config", help="TOML or YAML file of options")
    defaults = TrainConfig()
    for spec in dataclasses.fields(TrainConfig):
        if spec.name == "config":
            continue
        flag = "--" + spec.name.replace("_", "-")
        default = getattr(defaults, spec.name)
        # The sentinel default tells flags given on the command line (they win over the
        # config file) from defaults.
        kwargs: dict[str, Any] = {
            "dest": spec.name,
            "help": f"{_HELP[spec.name]} (default: {default})",
            "default": _UNSET,
        }
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif spec.name == "batchnorm":
            kwargs.update(type=str, choices=BATCHNORM_CURVATURES)
        elif spec.name == "milestones":
            kwargs.update(type=float, nargs="*")
        elif spec.name in ("max_steps", "threads", "stale_switch_step"):
            kwargs["type"] = int
        elif spec.name in ("damping_initial", "poly_end_epoch", "kl_clip"):
            kwargs["type"] = float
        elif spec.name == "data":
            kwargs["type"] = str
        else:
            kwargs["type"] = type(default)
        parser.add_argument(flag, **kwargs)
    parser.set_defaults(run=run, _parser=parser)


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the config file, then the flags given on the command line."""
    parser: argparse.ArgumentParser = args._parser
    values = TrainConfig().to_dict()
    values.pop("config")
    try:
        if args.config is not None:
            values.update(load_config_file(args.config))
        for spec in dataclasses.fields(TrainConfig):
            given = getattr(args, spec.name, _UNSET)
            if spec.name != "config" and given is not _UNSET:
                values[spec.name] = given
        if values.get("kl_clip") == 0:
            values["kl_clip"] = None
        return TrainConfig.from_dict({**values, "config": args.config})
    except (FileNotFoundError, ValueError, TypeError) as error:
        parser.error(str(error))


def run(args: argparse.Namespace) -> int:
    """Validate the options (exit 2 on bad ones, before any process group) and train."""
    config = _config_from_args(args)
    from spdkfac.training.checkpoint import CheckpointError
    from spdkfac.training.setup import build_schedules
    from spdkfac.training.trainer import train

    try:
        build_schedules(config, steps_per_epoch=1)  # schedule errors exit 2 here, too
    except ValueError as error:
        args._parser.error(str(error))
    try:
        train(config)
    except CheckpointError as error:
        print(f"spdkfac train: error: {error}", file=sys.stderr)
        return 1
    return 0
