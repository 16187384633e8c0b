"""``spdkfac train``: train a built-in model on real data with SGD or distributed K-FAC."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from spdkfac.forms import FORM_METHODS, GRAFTINGS
from spdkfac.models import TORCHVISION_PREFIX, torchvision_builder
from spdkfac.planning.schedule import COMM_SCHEDULERS
from spdkfac.strategies import STRATEGY_NAMES
from spdkfac.training.config import (
    BATCHNORM_CURVATURES,
    DATASETS,
    DECAY_SCOPES,
    LR_SCHEDULES,
    OPTIMIZERS,
    WEIGHT_SHARINGS,
    TrainConfig,
    check_model_name,
    load_config_file,
)
from spdkfac.training.optimizer_table import OPTIMIZER_TABLE

__all__ = ["add_parser", "run"]

_UNSET: Any = object()


def _default_help(name: str, default: object) -> str:
    """``name``'s default as ``--help`` says it: the field's, then each ``--optimizer``
    that runs another value (fixed ones marked so)."""
    others = []
    for optimizer, row in OPTIMIZER_TABLE.items():
        value = row.defaults.get(name, default)
        fixed = name in row.fixed
        if value != default or fixed:
            others.append(f"{optimizer} {value}{' only' if fixed else ''}")
    return f"default: {default}" + (f"; {', '.join(others)}" if others else "")


_HELP: dict[str, str] = {
    "model": "model name (resnet20/32/56, cnn, mlp, wrn16-4, resnet50/152, densenet121/201, "
    "or torchvision:NAME for a torchvision.models model; gpt: a byte-level language model "
    "for --dataset text or gcide; llama: a tiny LLaMA for the same, the model --tp-size "
    "splits)",
    "dataset": f"dataset: {', '.join(DATASETS)} (text: a byte-level corpus for --model gpt "
    "or llama; gcide: the GCIDE dictionary as plain English, about 29 MB, for the same)",
    "data": "dataset directory (Fashion-MNIST default: Debian's dataset-fashion-mnist), "
    "for text a file or directory (default: Debian's fortunes, /usr/share/games/fortunes), "
    "for gcide a .dict.dz or .dict file (default: Debian's dict-gcide, "
    "/usr/share/dictd/gcide.dict.dz)",
    "image_size": "image side for imagefolder datasets",
    "seq_len": "text: context length in bytes (window of each training example)",
    "gpt_layers": "gpt, llama: transformer blocks",
    "gpt_heads": "gpt, llama: attention heads (must divide --gpt-dim)",
    "gpt_dim": "gpt, llama: width of the residual stream",
    "gpt_dropout": "gpt: dropout probability (llama: 0 only)",
    "train_limit": "image datasets: train on the first N training images only",
    "val_split": "hold out this fraction of the training data and evaluate on it instead "
    "of the test set (images: a fixed random subset, scored as val_accuracy) or the "
    "validation split (text: the training split's last stretch), e.g. for tuning; 0: off",
    "epochs": "training epochs",
    "max_steps": "stop after this many optimizer steps (checkpoints still written)",
    "eval_every": "evaluate (and write a metrics.csv row) every N optimizer steps and at "
    "the end, instead of at every epoch's end",
    "evals_per_epoch": "evaluate K times per epoch, evenly spaced (the last at the epoch's "
    "end), and at the end (default 1; not with --eval-every)",
    "batch_size": "examples per worker per optimizer step",
    "accumulation_steps": "forward/backward passes per optimizer step (gradient accumulation)",
    "optimizer": f"optimizer: {', '.join(OPTIMIZERS)} (kfac = SGD preconditioned by K-FAC, "
    "kfac-adamw = AdamW preconditioned by K-FAC, muon = torch.optim.Muon on hidden weight "
    "matrices with AdamW on embeddings, head, norms and biases, soap = SOAP from the "
    "heavyball package; the transformer recipe, K-FAC on the hidden Linear layers only, "
    "no KL clip: kfac-muon = one-sided K-FAC (A only, --damping relative to A's mean "
    "eigenvalue; --inverse-method cholesky: two-sided) then Muon, kfac-eigen-adam = Adam "
    "in K-FAC's eigen-bases, refreshed every --inv-update-steps, kfac-eigen-adam-muon = "
    "that direction then Muon's orthogonalization; AdamW on the rest). Each "
    "optimizer has its own defaults (listed with each option below; docs/cli.md tables "
    "them); an option an optimizer fixes ('only') is refused at another value",
    "lr": "peak learning rate",
    "momentum": "SGD and Muon momentum, in [0, 1) (AdamW's and SOAP's beta1 is 0.9; "
    "kfac-eigen-adam's form keeps its own)",
    "nesterov": "Nesterov momentum (SGD and Muon)",
    "weight_decay": "L2 weight decay after preconditioning (AdamW: decoupled weight decay)",
    "decay_scope": "which parameters weight decay reaches, for every optimizer: all, or "
    "matrices (the weights of linear and convolution layers; norms, biases and embeddings, "
    "a tied output head included, are not decayed)",
    "precondition_frequency": "SOAP's eigenbasis refresh interval in steps (heavyball's "
    "precondition_frequency; default: heavyball's, 2)",
    "beta2": "AdamW's second-moment decay beta2, in [0, 1), for every AdamW part (adamw, "
    "kfac-adamw, muon's AdamW part; beta1 stays 0.9)",
    "grad_clip": "clip the averaged gradients to this global L2 norm before K-FAC and the "
    "optimizer step, as torch.nn.utils.clip_grad_norm_ (0: off; a step whose norm is not "
    "finite is left as is, K-FAC skips it)",
    "lr_schedule": f"learning-rate schedule: {', '.join(LR_SCHEDULES)}",
    "warmup_epochs": "linear learning-rate warm-up, in epochs",
    "warmup_steps": "linear learning-rate warm-up, in optimizer steps (not with --warmup-epochs)",
    "milestones": "epochs where the step schedule multiplies the lr by --lr-gamma",
    "lr_gamma": "factor of the step schedule",
    "poly_power": "power p of the polynomial decay (Osawa et al.)",
    "poly_start_epoch": "epoch where the polynomial decay starts",
    "poly_end_epoch": "epoch where the polynomial decay reaches 0 (default: --epochs)",
    "lr_schedule_steps": "cosine and polynomial schedules end after this many optimizer "
    "steps instead of at --epochs (the run goes on to --epochs or --max-steps)",
    "strategy": "distributed K-FAC strategy (a row of the strategy table in the README)",
    "inverse_method": "what K-FAC computes from each factor: cholesky or eigen (damped "
    "inverses), eigen-basis (eigendecompositions, damping on the Kronecker eigenvalues), "
    "eigen-adam or one-sided (the transformer forms; --optimizer kfac-eigen-adam / kfac-muon "
    "choose them)",
    "grafting": "sgd or adam: each layer's preconditioned gradient takes the norm of SGD's "
    "step (the gradient) or Adam's (gradient / (sqrt(v) + eps)); the form gives only the "
    "direction",
    "comm_scheduler": "fifo, or priority: DDP's gradient buckets preempt pipelined factor "
    "buckets chunk by chunk, in one order on every rank",
    "damping": "K-FAC damping (the target of the damping warm-up)",
    "damping_initial": "initial damping of the warm-up (Osawa et al.)",
    "damping_warmup_steps": "steps over which damping decays from the initial value",
    "kl_clip": "K-FAC KL clip kappa: the preconditioned gradients V are scaled by "
    "min(1, sqrt(kappa / (lr^2 * <V, grad>))) (0 disables the clip)",
    "factor_decay": "running-average weight of the Kronecker factors",
    "factor_update_steps": "factor refresh interval (early phase)",
    "inv_update_steps": "inverse refresh interval (early phase)",
    "stale_switch_step": "step after which refresh intervals grow (stale statistics)",
    "stale_factor_update_steps": "factor refresh interval after the switch",
    "stale_inv_update_steps": "inverse refresh interval after the switch",
    "stale_growth_steps": "double the intervals every N steps after the switch (0: jump)",
    "weight_sharing": "how K-FAC factors layers applied at many positions of an example "
    "(convolutions, sequences): expand (every position an example) or reduce (positions "
    "averaged first; cheaper; Eschenhagen et al. 2023)",
    "factor_examples": "K-FAC statistics from the first N examples of each worker's batch "
    "only (cheaper factors, noisier estimate; default: the whole batch)",
    "batchnorm": (
        "K-FAC curvature for BatchNorm scale and shift: off (plain gradient), diagonal "
        "(Osawa et al.'s diagonal Fisher) or unit-wise (each channel's 2x2 block)"
    ),
    "normalization": (
        "K-FAC curvature for the scale and shift of every normalization layer (BatchNorm, "
        "LayerNorm, GroupNorm, RMSNorm): off (plain gradient), diagonal or unit-wise; "
        "--batchnorm alone sets it for BatchNorm (both given: they must agree)"
    ),
    "batchnorm_damping_multiplier": (
        "rho_BN: normalization blocks are damped with rho_BN * damping (Osawa et al.: > 1; "
        "their code uses 16)"
    ),
    "weight_rescaling": "rescale conv/linear weights to norm sqrt(2*d_out) when larger",
    "mixup_alpha": "running mixup Beta(alpha, alpha) (0: off)",
    "random_erasing": "probability of random erasing with zeros (0: off)",
    "label_smoothing": "label smoothing",
    "augment": "random crop and horizontal flip (image datasets)",
    "seed": "random seed",
    "threads": "torch intra-op threads per process",
    "flush_denormal": "treat subnormal floats as zero on the CPU (torch.set_flush_denormal): "
    "otherwise a transformer's softmax can slow every step by a third as training sharpens "
    "it (speed only)",
    "collective_timeout": "seconds a collective may wait for a peer before the run fails",
    "out_dir": "where metrics, summary, TensorBoard logs and checkpoints go",
    "checkpoint_every": "checkpoint every N optimizer steps (0: only at the end)",
    "resume": "continue from the latest checkpoint in --out-dir",
    "overwrite": "delete the previous run's files in --out-dir (checkpoints, metrics, summary, "
    "config, TensorBoard logs) before starting; without it (or --resume) a fresh run in an "
    "--out-dir holding another run is refused",
    "target_accuracy": "test accuracy whose time-to-reach (at the first evaluation reaching "
    "it) is reported (image datasets)",
    "fsdp": "shard the model with FSDP2 (fully_shard of its blocks, or of each child with "
    "parameters, and of the root, on a 1-D mesh over the world) instead of DDP; "
    "checkpoints through torch.distributed.checkpoint (not with --weight-rescaling, muon, "
    "soap)",
    "hsdp_replicas": "with --fsdp: HSDP, a 2-D mesh of N replicas x WORLD/N shards (N must "
    "divide the world size)",
    "tp_size": "with --fsdp: tensor parallelism over groups of N ranks (FSDP2 x TP on a "
    "(WORLD/N, N) mesh, with --hsdp-replicas R HSDP x TP on an (R, WORLD/N/R, N) one; the "
    "model split by its plan: llama only; N must divide the world size and --gpt-heads)",
    "tensorboard": "--tensorboard: write TensorBoard logs (without the tensorboard package: "
    "one notice, the run goes on); --no-tensorboard: none; by default: logs when the "
    "package is installed, nothing said otherwise",
}


def _model(text: str) -> str:
    try:
        return check_model_name(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


#: argparse settings of the options whose type is not their default's (bools aside):
#: the choice-like ones are checked by argparse, before anything else runs.
_ARGUMENTS: dict[str, dict[str, Any]] = {
    "model": {"type": _model, "metavar": "NAME"},
    "dataset": {"type": str, "choices": DATASETS},
    "optimizer": {"type": str, "choices": tuple(OPTIMIZERS)},
    "lr_schedule": {"type": str, "choices": LR_SCHEDULES},
    "decay_scope": {"type": str, "choices": DECAY_SCOPES},
    "strategy": {"type": str, "choices": STRATEGY_NAMES},
    "inverse_method": {"type": str, "choices": FORM_METHODS},
    "grafting": {"type": str, "choices": GRAFTINGS},
    "comm_scheduler": {"type": str, "choices": COMM_SCHEDULERS},
    "batchnorm": {"type": str, "choices": BATCHNORM_CURVATURES},
    "normalization": {"type": str, "choices": BATCHNORM_CURVATURES},
    "weight_sharing": {"type": str, "choices": WEIGHT_SHARINGS},
    "milestones": {"type": float, "nargs": "*"},
    "data": {"type": str},
    "tensorboard": {"action": argparse.BooleanOptionalAction},
    **{name: {"type": int} for name in ("max_steps", "threads", "stale_switch_step",
                                         "train_limit", "eval_every", "evals_per_epoch",
                                         "lr_schedule_steps", "warmup_steps", "hsdp_replicas",
                                         "factor_examples", "precondition_frequency",
                                         "tp_size")},
    **{name: {"type": float} for name in ("damping_initial", "poly_end_epoch", "kl_clip")},
}  # fmt: skip


def add_parser(verbs: Any) -> None:
    """Register the ``train`` verb."""
    parser: argparse.ArgumentParser = verbs.add_parser(
        "train",
        help="train a model on real data with SGD or distributed K-FAC",
        # A one-line usage: an error then prints it and one line naming the bad flag.
        usage="%(prog)s [--config FILE] [--OPTION VALUE ...] (--help lists the options)",
        description=(
            "Train a built-in model (an image classifier, or gpt on a byte-level text) with "
            "SGD, AdamW, Muon or SOAP (SGD and AdamW optionally preconditioned by K-FAC), "
            "data parallel under torchrun, with Osawa et al.'s large-batch schemes, atomic "
            "checkpoints and --resume. "
            "Options may come from --config FILE (TOML or YAML, keys as below with "
            "underscores); flags given on the command line win."
        ),
    )
    parser.add_argument("--config", help="TOML or YAML file of options")
    # One flag per option of the flat form (the K-FAC ones build TrainConfig.kfac), its
    # default the configuration's (KFACConfig's for K-FAC).
    for name, default in _defaults().items():
        flag = "--" + name.replace("_", "-")
        # The sentinel default tells flags given on the command line (they win over the
        # config file) from defaults.
        kwargs: dict[str, Any] = {
            "dest": name,
            "help": f"{_HELP[name]} ({_default_help(name, default)})",
            "default": _UNSET,
        }
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(_ARGUMENTS.get(name, {"type": type(default)}))
        parser.add_argument(flag, **kwargs)
    parser.set_defaults(run=run, _parser=parser)


def _defaults() -> dict[str, Any]:
    """Every option's default, in the flat form (``--config`` aside)."""
    values = TrainConfig().to_dict()
    values.pop("config")
    return values


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The config file, then the flags given on the command line; the defaults (the
    optimizer recipe's first, :meth:`TrainConfig.from_dict`) for what neither gives."""
    parser: argparse.ArgumentParser = args._parser
    values: dict[str, Any] = {}
    try:
        if args.config is not None:
            values.update(load_config_file(args.config))
        for name in _defaults():
            given = getattr(args, name, _UNSET)
            if given is not _UNSET:
                values[name] = given
        return TrainConfig.from_dict({**values, "config": args.config})
    except (FileNotFoundError, ValueError, TypeError) as error:
        parser.error(str(error))


def run(args: argparse.Namespace) -> int:
    """Validate the options (exit 2 on bad ones, before any process group) and train."""
    config = _config_from_args(args)
    from spdkfac.data.text import TextCorpusError
    from spdkfac.support.paths import make_output_dir, output_dir_problem
    from spdkfac.training.checkpoint import CheckpointError
    from spdkfac.training.optimizers import require_base
    from spdkfac.training.outdir import OutDirError
    from spdkfac.training.setup import build_schedules
    from spdkfac.training.trainer import train

    try:
        # Schedule errors exit 2 here, too. The epoch length is not known before the data
        # is read: one step per epoch checks epoch-valued options exactly; a warm-up in
        # steps against a schedule in epochs is checked as shorter than one epoch (and
        # against the real epoch length when the run starts).
        steps_per_epoch = 1
        if config.warmup_steps is not None and config.lr_schedule_steps is None:
            steps_per_epoch = config.warmup_steps + 1
        build_schedules(config, steps_per_epoch=steps_per_epoch)
        problem = output_dir_problem(config.out_dir)
        if problem is None and not config.overwrite:  # --overwrite moves it aside
            problem = output_dir_problem(Path(config.out_dir) / "checkpoints")
        if problem is not None:
            raise ValueError(f"--out-dir: {problem}")
        require_base(config.base_optimizer)  # so does a missing optimizer package
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if config.tp_size is not None and world % config.tp_size:
            raise ValueError(f"--tp-size {config.tp_size} does not divide {world} ranks")
        data_parallel = world // (config.tp_size or 1)  # the ranks HSDP splits
        if config.hsdp_replicas is not None and data_parallel % config.hsdp_replicas:
            raise ValueError(
                f"--hsdp-replicas {config.hsdp_replicas} does not divide {data_parallel} "
                "data-parallel ranks"
            )
        if config.model.lower().startswith(TORCHVISION_PREFIX):
            # A missing torchvision or model name exits 2 here, before loading any data.
            torchvision_builder(config.model[len(TORCHVISION_PREFIX) :])
        # Last, as it creates the directory (an empty one is no run's): a path no file
        # system takes exits 2 here, not at the first write.
        problem = make_output_dir(config.out_dir)
        if problem is not None:
            raise ValueError(f"--out-dir: {problem}")
    except ValueError as error:
        args._parser.error(str(error))
    try:
        train(config)
    except (CheckpointError, OutDirError, TextCorpusError) as error:
        print(f"spdkfac train: error: {error}", file=sys.stderr)
        return 1
    return 0
