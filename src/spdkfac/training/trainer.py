"""The training loop of ``spdkfac train``: data parallel SGD or K-FAC, resumable bit for bit.

All randomness of a step (augmentation, mixup, a text window's offset, dropout) is drawn
from generators seeded by ``(seed, rank, step)``, and the data order from
``DistributedSampler(seed)`` and the epoch, so a resumed run only needs the step counter
and the running-mixup batch to continue exactly where the checkpoint left off. What
differs between image classification and language modelling is the run's
:class:`~spdkfac.training.tasks.Task`. The run evaluates after the steps its
:class:`~spdkfac.training.evaluation.EvalSchedule` names (evaluation changes no training
state), each time adding a row to ``metrics.csv``; its training clock leaves evaluations
and checkpoints out.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import BatchSampler, DistributedSampler

from spdkfac.comm import Communicator, barrier, destroy_distributed, init_distributed
from spdkfac.comm.fsdp import fully_shard_model
from spdkfac.data.augment import RunningMixup
from spdkfac.training.checkpoint import atomic_write_bytes
from spdkfac.training.config import TrainConfig
from spdkfac.training.evaluation import EvalSchedule, TrainClock
from spdkfac.training.faults import FaultPlan
from spdkfac.training.loop import StepHooks, train_step
from spdkfac.training.lr_schedules import apply_to_optimizer
from spdkfac.training.metrics import (
    EpochMetrics,
    TrainSummary,
    epoch_at,
    format_summary,
    open_tensorboard,
    summarize,
    write_metrics_csv,
    write_outputs,
)
from spdkfac.training.outdir import claim_out_dir, clear_previous_run
from spdkfac.training.persistence import CheckpointPayload, restore_checkpoint, save_checkpoint
from spdkfac.training.progress import ProgressBar
from spdkfac.training.replicas import replicas_identical, state_tensors
from spdkfac.training.rescaling import rescale_weights_
from spdkfac.training.setup import configure_cpu, make_optimizers
from spdkfac.training.sharded import restore_sharded_checkpoint, save_sharded_checkpoint
from spdkfac.training.tasks import task_for

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
        self.task = task_for(config)
        self.data = self.task.load(config)
        torch.manual_seed(config.seed)
        self.module = self.task.build_model(config, self.data)
        self.model: nn.Module = self.module
        # The ranks that read different batches: under --tp-size, one per (dp) group.
        self.data_comm: Communicator = comm
        if config.tp_size is not None:
            self.data_comm = _tensor_parallel(self.module, config, comm)
        elif comm.world_size > 1 and config.fsdp:  # sharded in place: model is module
            fully_shard_model(
                self.module,
                world_size=comm.world_size,
                device_type=comm.device.type,
                replicas=config.hsdp_replicas,
            )
        elif comm.world_size > 1:
            self.model = nn.parallel.DistributedDataParallel(self.module)
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            self.data.train,
            num_replicas=self.data_comm.world_size,
            rank=self.data_comm.rank,
            seed=config.seed,
        )
        self.steps_per_epoch = -(-len(self.sampler) // config.batch_size)
        self.lr_fn, self.optimizer, self.precond = make_optimizers(
            config, self.model, self.steps_per_epoch
        )
        self.mixup = RunningMixup(config.mixup_alpha) if config.mixup_alpha > 0 else None
        self.faults = FaultPlan.from_env()
        self.hooks = StepHooks(before_update=self._before_update)
        self.step = 0
        self.saved_step: int | None = None
        self.losses: list[float] = []  # this rank's losses since the last scheduled evaluation
        self.clock = TrainClock()
        self.eval_seconds = 0.0
        self.iteration_seconds: list[float] = []
        self.metrics: list[EpochMetrics] = []
        self.board: Any = None

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        payload = CheckpointPayload(
            config=self.config,
            step=self.step,
            train_seconds=self.clock.seconds,
            metrics=[m.row() for m in self.metrics],
            module=self.module,
            optimizer=self.optimizer,
            preconditioner=self.precond,
            rank_state={
                "mixup": None if self.mixup is None else self.mixup.state_dict(),
                "losses": list(self.losses),
                "eval_seconds": self.eval_seconds,
            },
        )
        # --fsdp: through DCP, each rank its shards (on one process too: one format).
        save = save_sharded_checkpoint if self.config.fsdp else save_checkpoint
        save(self.checkpoints, self.comm, payload)
        self.saved_step = self.step

    def restore(self) -> None:
        restore = restore_sharded_checkpoint if self.config.fsdp else restore_checkpoint
        restored = restore(
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
        self.step = self.saved_step = restored.step
        self.clock = TrainClock(restored.train_seconds)
        self.metrics = [EpochMetrics.from_row(row) for row in restored.metrics]
        rank_state = restored.rank_state or {}
        if self.mixup is not None and rank_state.get("mixup") is not None:
            self.mixup.load_state_dict(rank_state["mixup"])
        # "epoch_losses": checkpoints written when rows were per epoch only (the same list).
        losses = rank_state.get("losses", rank_state.get("epoch_losses", []))
        self.losses = [float(x) for x in losses]
        self.eval_seconds = float(rank_state.get("eval_seconds", 0.0))
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
        seed = _seed(config, self.data_comm.rank, self.step)  # equal on tensor-parallel peers
        generator = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed + 1)
        return self.task.batch(self.data, indices, generator, config, self.mixup)

    def _pass(self, inputs: Tensor, targets: Tensor, soft: Tensor | None, part: Tensor) -> Tensor:
        logits = self.model(inputs[part])
        return self.task.loss(
            logits, targets[part], None if soft is None else soft[part], self.config
        )

    def _before_update(self) -> None:
        self.faults.before_update(self.step, self.comm.rank)

    def train_step(self, indices: list[int]) -> float:
        config = self.config
        inputs, targets, soft = self._batch(indices)
        if inputs.is_floating_point():  # token ids cannot hold the NaNs of a "nan" fault
            inputs = self.faults.poison_batch(inputs, self.step, self.comm.rank)
        chunks = torch.arange(len(targets)).chunk(config.accumulation_steps)
        passes = [partial(self._pass, inputs, targets, soft, part) for part in chunks]
        outcome = train_step(
            self.model,
            self.optimizer,
            self.precond,
            passes,
            hooks=self.hooks,
            grad_clip=config.grad_clip,
        )
        if outcome.applied and config.weight_rescaling:
            rescale_weights_(self.module)
        self.step += 1
        # torch.optim.SGD applies the lr outside its momentum buffer, which is exactly
        # Osawa et al.'s momentum-proportional-to-lr rule: only the lr needs setting
        # (AdamW, too, only needs its lr).
        apply_to_optimizer(self.optimizer, self.step, lr=self.lr_fn)
        return outcome.mean_loss


def train(config: TrainConfig, *, log: Callable[[str], None] = print) -> TrainSummary:
    """Run (or resume) a training run on this process's rank; rank 0 writes the outputs.
    The process's thread count and subnormal-float mode are as before once it returns."""
    with configure_cpu(config.threads, flush_denormal=config.flush_denormal):
        return _train(config, log)


def _train(config: TrainConfig, log: Callable[[str], None]) -> TrainSummary:
    comm = init_distributed(timeout=timedelta(seconds=config.collective_timeout))
    try:
        # Before anything is read: a fresh run never mixes with another run's files.
        clear = claim_out_dir(
            config.out_dir, comm, resume=config.resume, overwrite=config.overwrite
        )
        run = _Run(config, comm, log)
        if comm.rank == 0:
            if clear:  # only now that the data and model are ready
                removed = clear_previous_run(run.out_dir)
                run.log(f"--overwrite: deleted the previous run's {', '.join(removed)}")
            run.out_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(run.out_dir / "config.toml", config.to_toml().encode())
        if clear:
            barrier(comm)  # no rank writes there before the old run is gone
        if config.resume:
            run.restore()
        return _loop(run)
    finally:
        destroy_distributed()


def _loop(run: _Run) -> TrainSummary:
    config, comm = run.config, run.comm
    if config.tensorboard is not False and comm.rank == 0:
        # Asked for (--tensorboard): a missing package is said; by default it is not.
        run.board = open_tensorboard(run.out_dir, run.log if config.tensorboard else _quiet)
    total_steps = config.epochs * run.steps_per_epoch
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    schedule = EvalSchedule.from_config(
        config, steps_per_epoch=run.steps_per_epoch, total_steps=total_steps
    )
    run.log(
        f"{config.optimizer}{'/' + config.kfac.strategy if config.uses_kfac else ''} "
        f"{config.model} on {config.dataset}: {comm.world_size} worker(s) x batch "
        f"{config.batch_size}, {run.steps_per_epoch} steps/epoch, {total_steps} steps"
        + (f", {_sharding(config, run.module)}" if config.fsdp and comm.world_size > 1 else "")
    )
    run.clock.start()
    while run.step < total_steps:
        _epoch(run, schedule)
    run.clock.stop()
    if run.saved_step != run.step:
        run.save()
    final = run.task.final_scores(run.model, run.data, run.data_comm)
    summary = summarize(
        run.metrics,
        scores=run.task.summary_scores(run.metrics, final, config),
        iteration_seconds=run.iteration_seconds,
        steps=run.step,
        world_size=comm.world_size,
        train_seconds=run.clock.seconds,
        eval_seconds=run.eval_seconds,
    )
    summary.replicas_identical = _replicas_identical(run)
    if not summary.replicas_identical and comm.rank == 0:
        print("spdkfac train: warning: parameters or factors differ across ranks", file=sys.stderr)
    if comm.rank == 0 and run.metrics:
        write_outputs(run.out_dir, summary)
        run.log(format_summary(summary, run.task.headline(summary.scores, config)))
    if run.board is not None:
        run.board.close()
    return summary


def _quiet(_: str) -> None:
    """A log that says nothing."""


def _epoch(run: _Run, schedule: EvalSchedule) -> None:
    """Train the rest of the current epoch (up to the run's last step), evaluating where
    ``schedule`` says."""
    config = run.config
    epoch, position = divmod(run.step, run.steps_per_epoch)
    run.sampler.set_epoch(epoch)
    batches = list(BatchSampler(run.sampler, config.batch_size, drop_last=False))
    # The bar counts the steps this epoch will run: fewer in the last one of --max-steps.
    length = min(len(batches), schedule.total_steps - epoch * run.steps_per_epoch)
    bar = ProgressBar(length, f"epoch {epoch + 1}", enabled=run.comm.rank == 0)
    epoch_seconds, scores, closing = 0.0, "", ""
    for indices in batches[position:length]:
        tick = time.perf_counter()
        loss = run.train_step(indices)
        run.losses.append(loss)
        run.iteration_seconds.append(time.perf_counter() - tick)
        epoch_seconds += run.iteration_seconds[-1]
        closing = f"loss {loss:.4f} {scores}"
        if schedule.due(run.step):
            with run.clock.paused():
                row = _evaluate(run, epoch_seconds, reset=schedule.scheduled(run.step))
            scores = run.task.describe(row.scores)
            closing = f"loss {row.train_loss:.4f} {scores}"
        bar.update(run.step - epoch * run.steps_per_epoch, closing)
        if config.checkpoint_every and run.step % config.checkpoint_every == 0:
            with run.clock.paused():
                run.save()
    bar.close(closing)


def _evaluate(run: _Run, epoch_seconds: float, *, reset: bool) -> EpochMetrics:
    """Score the model (a collective), add and write a row; ``reset`` starts the next
    interval of training losses."""
    started = time.perf_counter()
    comm = run.comm
    finite = [x for x in run.losses if math.isfinite(x)]  # skipped (NaN) steps left out
    mean = comm.all_reduce_average(torch.tensor([sum(finite) / max(len(finite), 1)]))
    scores = run.task.evaluate(run.model, run.data, run.data_comm)
    row = EpochMetrics(
        epoch=epoch_at(run.step, run.steps_per_epoch),
        step=run.step,
        train_loss=float(mean.wait()),
        scores=scores,
        epoch_seconds=epoch_seconds,
        train_seconds=run.clock.seconds,
        lr=float(run.optimizer.param_groups[0]["lr"]),
        skipped_steps=0 if run.precond is None else run.precond.skipped_steps,
    )
    run.metrics.append(row)
    if reset:
        run.losses = []
    if comm.rank == 0:
        write_metrics_csv(run.out_dir, run.metrics)
    if run.board is not None:
        for key, value in {"train_loss": row.train_loss, **scores, "lr": row.lr}.items():
            run.board.add_scalar(key, value, row.step)
    run.eval_seconds += time.perf_counter() - started
    return row


def _replicas_identical(run: _Run) -> bool:
    """Whether parameters and K-FAC state are bitwise equal on every rank.

    Buffers are left out: DDP re-broadcasts them from rank 0 at every forward, so BatchNorm
    running statistics legitimately differ between ranks after the last one.
    """
    # Under --fsdp each rank holds its rows of a DTensor: compared whole (a collective).
    tensors: list[Tensor] = [_whole(p) for p in run.module.parameters()]
    if run.precond is not None:
        tensors += state_tensors(run.precond.state_dict())
    return replicas_identical(run.comm, tensors)


def _sharding(config: TrainConfig, module: nn.Module) -> str:
    """How the run is sharded, and the mesh its parameters are on (the widest)."""
    replicas, tp = config.hsdp_replicas, config.tp_size
    if tp is not None:
        sharded = "FSDP2" if replicas is None else f"HSDP ({replicas} replicas)"
        how = f"{sharded} x TP ({tp} tensor-parallel ranks per group)"
    else:
        how = "FSDP2" if replicas is None else f"HSDP ({replicas} replicas, FSDP2)"
    meshes = [p.device_mesh for p in module.parameters() if isinstance(p, DTensor)]
    if not meshes:
        return how
    shape = max((tuple(mesh.mesh.shape) for mesh in meshes), key=len)
    return f"{how} on a {' x '.join(map(str, shape))} mesh"


def _tensor_parallel(module: nn.Module, config: TrainConfig, comm: Communicator) -> Communicator:
    """``module`` split by its tensor-parallel plan and sharded by FSDP2 (``--tp-size``);
    returns the data-parallel communicator."""
    from spdkfac.comm.tensor_parallel_plan import shard_tensor_parallel

    assert config.tp_size is not None
    return shard_tensor_parallel(
        module,
        config.model,
        tp_size=config.tp_size,
        device_type=comm.device.type,
        replicas=config.hsdp_replicas,
    )


def _whole(parameter: Tensor) -> Tensor:
    full = getattr(parameter, "full_tensor", None)
    return full() if full is not None else parameter
