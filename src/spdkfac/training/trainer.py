"""The training loop of ``spdkfac train``: data parallel SGD or K-FAC, resumable bit for bit.

All randomness of a step (augmentation, mixup, dropout) is drawn from generators seeded
by ``(seed, rank, step)``, and the data order from ``DistributedSampler(seed)`` and the
epoch, so a resumed run only needs the step counter and the running-mixup batch to
continue exactly where the checkpoint left off.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import BatchSampler, DistributedSampler

from spdkfac.comm import Communicator, destroy_distributed, init_distributed
from spdkfac.data.augment import RunningMixup, random_crop_flip, random_erasing, soft_cross_entropy
from spdkfac.training.checkpoint import atomic_write_bytes
from spdkfac.training.config import TrainConfig
from spdkfac.training.faults import FaultPlan
from spdkfac.training.loop import StepHooks, evaluate_accuracy, train_step
from spdkfac.training.lr_schedules import apply_to_optimizer
from spdkfac.training.metrics import (
    EpochMetrics,
    TrainSummary,
    format_summary,
    open_tensorboard,
    summarize,
    write_outputs,
)
from spdkfac.training.persistence import restore_checkpoint, save_checkpoint
from spdkfac.training.progress import ProgressBar
from spdkfac.training.replicas import replicas_identical, state_tensors
from spdkfac.training.rescaling import rescale_weights_
from spdkfac.training.setup import load_datasets, make_model, make_optimizers

__all__ = ["EpochMetrics", "TrainSummary", "train"]


def _seed(config: TrainConfig, rank: int, step: int) -> int:
    return (config.seed * 1_000_003 + rank * 7_919 + step * 104_729) % (2**63 - 1)


class _Run:
    """State of one training run on one rank."""

    def __init__(self, config: TrainConfig, comm: Communicator, log: Callable[[str], None]):
        self.config = config
        self.comm = comm
        self.log = log if comm.rank == 0 else (lambda _: None)
        self.out_dir = Path(config.out_dir)
        self.checkpoints = self.out_dir / "checkpoints"
        self.train_set, self.test_set, self.num_classes, channels, size = load_datasets(config)
        torch.manual_seed(config.seed)
        self.module = make_model(config, self.num_classes, channels, size)
        self.model: nn.Module = self.module
        if comm.world_size > 1:
            self.model = nn.parallel.DistributedDataParallel(self.module)
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            self.train_set, num_replicas=comm.world_size, rank=comm.rank, seed=config.seed
        )
        self.steps_per_epoch = -(-len(self.sampler) // config.batch_size)
        self.lr_fn, self.optimizer, self.precond = make_optimizers(
            config, self.model, self.steps_per_epoch
        )
        self.mixup = RunningMixup(config.mixup_alpha) if config.mixup_alpha > 0 else None
        self.faults = FaultPlan.from_env()
        self.hooks = StepHooks(before_update=self._before_update)
        self.step = 0
        self.epoch_losses: list[float] = []  # this rank's losses so far in this epoch
        self.train_seconds = 0.0
        self.iteration_seconds: list[float] = []
        self.metrics: list[EpochMetrics] = []

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        save_checkpoint(
            self.checkpoints,
            self.comm,
            self.config,
            step=self.step,
            train_seconds=self.train_seconds,
            metrics=[asdict(m) for m in self.metrics],
            module=self.module,
            optimizer=self.optimizer,
            preconditioner=self.precond,
            rank_state={
                "mixup": None if self.mixup is None else self.mixup.state_dict(),
                "epoch_losses": list(self.epoch_losses),
            },
        )

    def restore(self) -> None:
        restored = restore_checkpoint(
            self.checkpoints,
            self.comm,
            self.config,
            module=self.module,
            optimizer=self.optimizer,
            preconditioner=self.precond,
        )
        if restored is None:
            self.log(f"no checkpoint in {self.checkpoints}; starting from scratch")
            return
        self.step = restored.step
        self.train_seconds = restored.train_seconds
        self.metrics = [EpochMetrics(**row) for row in restored.metrics]
        rank_state = restored.rank_state or {}
        if self.mixup is not None and rank_state.get("mixup") is not None:
            self.mixup.load_state_dict(rank_state["mixup"])
        self.epoch_losses = [float(x) for x in rank_state.get("epoch_losses", [])]
        if restored.world_size != self.comm.world_size:
            self.log(
                f"resuming a {restored.world_size}-rank checkpoint on {self.comm.world_size} "
                "ranks: factors and inverses are replicated and inverse placement is "
                "re-planned, but the data order differs, so the run is not bit-identical "
                "to the original"
            )
        self.log(f"resumed from {restored.directory} at step {self.step}")

    # ------------------------------------------------------------------ one step
    def _batch(self, indices: list[int]) -> tuple[Tensor, Tensor, Tensor | None]:
        config = self.config
        images, labels = (t[indices] for t in self.train_set.tensors)
        generator = torch.Generator().manual_seed(_seed(config, self.comm.rank, self.step))
        torch.manual_seed(_seed(config, self.comm.rank, self.step) + 1)
        if config.augment:
            images = random_crop_flip(images, generator, padding=4 if images.shape[-1] >= 32 else 2)
        if config.random_erasing > 0:
            images = random_erasing(images, generator, p=config.random_erasing)
        soft = None
        if self.mixup is not None:
            images, soft = self.mixup(images, labels, generator, num_classes=self.num_classes)
        return images, labels, soft

    def _loss(self, logits: Tensor, labels: Tensor, soft: Tensor | None) -> Tensor:
        smoothing = self.config.label_smoothing
        if soft is not None:
            return soft_cross_entropy(logits, soft, label_smoothing=smoothing)
        return F.cross_entropy(logits, labels, label_smoothing=smoothing)

    def _pass(self, images: Tensor, labels: Tensor, soft: Tensor | None, part: Tensor) -> Tensor:
        logits = self.model(images[part])
        return self._loss(logits, labels[part], None if soft is None else soft[part])

    def _before_update(self) -> None:
        self.faults.before_update(self.step, self.comm.rank)

    def train_step(self, indices: list[int]) -> float:
        config = self.config
        images, labels, soft = self._batch(indices)
        images = self.faults.poison_batch(images, self.step, self.comm.rank)
        chunks = torch.arange(len(labels)).chunk(config.accumulation_steps)
        passes = [partial(self._pass, images, labels, soft, part) for part in chunks]
        outcome = train_step(self.model, self.optimizer, self.precond, passes, hooks=self.hooks)
        if outcome.applied and config.weight_rescaling:
            rescale_weights_(self.module)
        self.step += 1
        # torch.optim.SGD applies the lr outside its momentum buffer, which is exactly
        # Osawa et al.'s momentum-proportional-to-lr rule: only the lr needs setting.
        apply_to_optimizer(self.optimizer, self.step, lr=self.lr_fn)
        return outcome.mean_loss


def train(config: TrainConfig, *, log: Callable[[str], None] = print) -> TrainSummary:
    """Run (or resume) a training run on this process's rank; rank 0 writes the outputs."""
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    comm = init_distributed(timeout=timedelta(seconds=config.collective_timeout))
    try:
        run = _Run(config, comm, log)
        if comm.rank == 0:
            run.out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(run.out_dir / "config.toml", config.to_toml().encode())
        if config.resume:
            run.restore()
        return _loop(run)
    finally:
        destroy_distributed()


def _loop(run: _Run) -> TrainSummary:
    config, comm = run.config, run.comm
    board = None
    if config.tensorboard and comm.rank == 0:
        board = open_tensorboard(run.out_dir, run.log)
    total_steps = config.epochs * run.steps_per_epoch
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    run.log(
        f"{config.optimizer}{'/' + config.strategy if config.optimizer == 'kfac' else ''} "
        f"{config.model} on {config.dataset}: {comm.world_size} worker(s) x batch "
        f"{config.batch_size}, {run.steps_per_epoch} steps/epoch, {total_steps} steps"
    )
    while run.step < total_steps:
        epoch, position = divmod(run.step, run.steps_per_epoch)
        run.sampler.set_epoch(epoch)
        batches = list(BatchSampler(run.sampler, config.batch_size, drop_last=False))
        bar = ProgressBar(len(batches), f"epoch {epoch + 1}", enabled=comm.rank == 0)
        started = time.perf_counter()
        if position == 0:
            run.epoch_losses = []
        losses = run.epoch_losses
        epoch_seconds = 0.0
        for indices in batches[position:]:
            if run.step >= total_steps:
                break
            tick = time.perf_counter()
            losses.append(run.train_step(indices))
            run.iteration_seconds.append(time.perf_counter() - tick)
            epoch_seconds += run.iteration_seconds[-1]
            bar.update(run.step - epoch * run.steps_per_epoch, f"loss {losses[-1]:.4f}")
            if config.checkpoint_every and run.step % config.checkpoint_every == 0:
                run.train_seconds += time.perf_counter() - started
                run.save()
                started = time.perf_counter()
        run.train_seconds += time.perf_counter() - started
        if run.step % run.steps_per_epoch == 0 or run.step >= total_steps:
            finite = [x for x in losses if math.isfinite(x)]  # skipped (NaN) steps left out
            mean = comm.all_reduce_average(torch.tensor([sum(finite) / max(len(finite), 1)]))
            images, labels = run.test_set.tensors
            accuracy = evaluate_accuracy(run.model, images, labels, comm)
            row = EpochMetrics(
                epoch=-(-run.step // run.steps_per_epoch),
                step=run.step,
                train_loss=float(mean.wait()),
                test_accuracy=accuracy,
                epoch_seconds=epoch_seconds,
                train_seconds=run.train_seconds,
                lr=float(run.optimizer.param_groups[0]["lr"]),
                skipped_steps=0 if run.precond is None else run.precond.skipped_steps,
            )
            run.metrics.append(row)
            bar.close(f"loss {row.train_loss:.4f} test acc {accuracy:.4f}")
            if board is not None:
                for key in ("train_loss", "test_accuracy", "lr"):
                    board.add_scalar(key, getattr(row, key), row.epoch)
    run.save()
    summary = summarize(
        run.metrics,
        target_accuracy=config.target_accuracy,
        iteration_seconds=run.iteration_seconds,
        steps=run.step,
        world_size=comm.world_size,
    )
    summary.replicas_identical = _replicas_identical(run)
    if not summary.replicas_identical and comm.rank == 0:
        print("spdkfac train: warning: parameters or factors differ across ranks", file=sys.stderr)
    if comm.rank == 0 and run.metrics:
        write_outputs(run.out_dir, summary)
        run.log(format_summary(summary, config.target_accuracy))
    if board is not None:
        board.close()
    return summary


def _replicas_identical(run: _Run) -> bool:
    """Whether parameters and K-FAC state are bitwise equal on every rank.

    Buffers are left out: DDP re-broadcasts them from rank 0 at every forward, so BatchNorm
    running statistics legitimately differ between ranks after the last one.
    """
    tensors: list[Tensor] = list(run.module.parameters())
    if run.precond is not None:
        tensors += state_tensors(run.precond.state_dict())
    return replicas_identical(run.comm, tensors)
