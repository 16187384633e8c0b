"""One rank of the benchmark: every variant's model, trained in alternating chunks, profiled."""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn

from spdkfac.bench.costs import (
    describe_cost_model,
    factor_dims,
    fit_live_cost_model,
    unpack_seconds,
)
from spdkfac.bench.report import write_bench_outputs
from spdkfac.bench.results import BenchResults, VariantResult
from spdkfac.bench.variants import VARIANTS
from spdkfac.calibrate import describe_device
from spdkfac.comm import (
    BucketLaunches,
    Communicator,
    barrier,
    destroy_distributed,
    gather_events,
    init_distributed,
    timed_allreduce_hook,
)
from spdkfac.comm.fsdp import fully_shard_model
from spdkfac.config import KFACConfig, resolve_config
from spdkfac.costmodel import CostModel, resolve_cost_model
from spdkfac.data.text import VOCAB_SIZE
from spdkfac.layers import FactorOptions
from spdkfac.models import ModelKind, build_model, model_kind
from spdkfac.preconditioner import KFACPreconditioner
from spdkfac.profiling import Event, Phase, Profiler, breakdown, span_name
from spdkfac.strategies import AutoStrategy
from spdkfac.support.checks import check_number
from spdkfac.training.loop import StepHooks, cross_entropy_pass, train_step
from spdkfac.training.setup import configure_cpu

__all__ = ["LAYOUTS", "BenchOptions", "Progress", "run_worker"]

#: ``--layout`` values: every variant's model under DDP, or sharded by FSDP2.
LAYOUTS: tuple[str, ...] = ("ddp", "fsdp")

#: ``progress(done, total, text)``, called on rank 0 after every iteration.
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """Everything a rank needs to run the benchmark (the CLI's flags).

    ``fusion_warmup_steps`` None means ``max(1, warmup)``: the ``optimal`` fusion policy
    measures that many factor steps, then plans, so (with factors refreshed every step) the
    plan is in place exactly when the measured iterations begin.
    """

    model: str = "resnet32"
    variants: tuple[str, ...] = ("sgd", "d-kfac", "spd-kfac")
    iters: int = 30
    warmup: int = 3
    chunk: int = 5
    batch_size: int = 32
    threads: int = 1
    flush_denormal: bool = True
    factor_update_steps: int = 1
    inv_update_steps: int = 1
    fusion_warmup_steps: int | None = None
    layout: str = "ddp"
    lr: float = 0.01
    damping: float = check_number("damping", KFACConfig().damping)  # the library's default
    factor_examples: int | None = None
    input_size: int = 32
    in_channels: int = 3
    num_classes: int = 10
    seed: int = 0
    cost_model: str | None = None
    trace_iters: int = 5
    out_dir: str = "bench-out"
    link: str = "loopback"
    command: str = "spdkfac bench"
    timeout: float = 1800.0

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")

    @property
    def planning_steps(self) -> int:
        """Factor steps the ``optimal`` policy measures before planning."""
        return self.fusion_warmup_steps or max(1, self.warmup)


@dataclass(frozen=True)
class _Workload:
    """How a kind of model is built and fed synthetic data in the benchmark."""

    model_args: Callable[[BenchOptions], dict[str, Any]]
    batch: Callable[[BenchOptions, torch.Generator], tuple[Tensor, Tensor]]
    describe: Callable[[BenchOptions], str]


def _random_tokens(options: BenchOptions, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    shape = (options.batch_size, options.input_size)
    inputs = torch.randint(0, VOCAB_SIZE, shape, generator=generator)
    targets = torch.randint(0, VOCAB_SIZE, shape, generator=generator)
    return inputs, targets


def _random_images(options: BenchOptions, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    shape = (options.batch_size, options.in_channels, options.input_size, options.input_size)
    inputs = torch.randn(*shape, generator=generator)
    targets = torch.randint(0, options.num_classes, (options.batch_size,), generator=generator)
    return inputs, targets


#: Image models read random images with random labels; text models (``--input-size`` is
#: the sequence length) random byte ids with random next-byte targets.
_WORKLOADS: dict[ModelKind, _Workload] = {
    "image": _Workload(
        lambda o: {"num_classes": o.num_classes, "in_channels": o.in_channels,
                   "input_size": o.input_size},
        _random_images,
        lambda o: f"{o.in_channels}x{o.input_size}x{o.input_size} synthetic",
    ),
    "text": _Workload(
        lambda o: {"vocab_size": VOCAB_SIZE, "block_size": o.input_size},
        _random_tokens,
        lambda o: f"{o.input_size} random token ids (vocabulary {VOCAB_SIZE}) per example",
    ),
}  # fmt: skip


def _workload(options: BenchOptions) -> _Workload:
    return _WORKLOADS[model_kind(options.model)]


def _build(options: BenchOptions) -> nn.Module:
    return build_model(options.model, **_workload(options).model_args(options))


class _VariantRun:
    """One variant's model copy, optimizer, preconditioner, profiler and timings."""

    def __init__(
        self, name: str, options: BenchOptions, comm: Communicator, costs: CostModel | str
    ) -> None:
        self.name = name
        self._warmup = options.warmup
        #: Iterations ``strategy="auto"`` spent trying candidates (before the warm-up).
        self.trials = 0
        self._iters = options.iters
        self.target = options.iters
        torch.manual_seed(options.seed)  # the same initial weights for every variant
        model = _build(options)
        self.launches = BucketLaunches()
        ddp = None
        if options.layout == "fsdp":  # sharded in place, before K-FAC is built on it
            fully_shard_model(model, world_size=comm.world_size, device_type=comm.device.type)
        elif comm.world_size > 1:
            ddp = nn.parallel.DistributedDataParallel(model)
        model = ddp or model
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=options.lr, momentum=0.9)
        kwargs = VARIANTS[name].kfac
        self.precond: KFACPreconditioner | None = None
        if kwargs is not None:
            self.precond = KFACPreconditioner(
                model,
                # The row's strategy and overrides, all of them (validated by the config).
                config=resolve_config(None, kwargs),
                factor_update_steps=options.factor_update_steps,
                inv_update_steps=options.inv_update_steps,
                fusion_warmup_steps=options.planning_steps,
                optimizer=self.optimizer,  # the KL clip reads its (constant) lr
                damping=options.damping,
                factor_options=FactorOptions(examples=options.factor_examples),
                cost_model=costs,
                profile=True,
            )
            self.profiler = self.precond.profiler
        else:
            self.profiler = Profiler(enabled=True, rank=comm.rank)
        self._tuned = self.precond is not None and isinstance(
            self.precond.config.selection, AutoStrategy
        )
        owned = None if self.precond is None else self.precond.gradient_launches
        if owned is not None:  # the preconditioner's own hook records launches
            self.launches = owned
        elif ddp is not None:
            ddp.register_comm_hook(None, timed_allreduce_hook(self.launches))
        self.times: list[float] = []
        self._forward = self._backward_done = 0.0
        self._hooks = StepHooks(
            before_forward=self._forward_begins, before_update=self._backward_ends
        )

    def _forward_begins(self) -> None:
        self.launches.clear()
        self._forward = time.perf_counter()

    def _backward_ends(self) -> None:
        self._backward_done = time.perf_counter()

    def iteration(self, inputs: Tensor, targets: Tensor) -> float:
        """One training iteration, recorded as spans; returns its wall time."""
        passes = [cross_entropy_pass(self.model, inputs, targets)]
        trying = self.trying
        began = time.perf_counter()
        train_step(self.model, self.optimizer, self.precond, passes, hooks=self._hooks)
        ended = time.perf_counter()
        forward, backward_done = self._forward, self._backward_done
        last_launch = self.launches.last
        record = self.profiler.record
        if last_launch is not None:
            # What DDP could not overlap: from its last bucket's launch until backward()
            # returned, having waited for every bucket.
            record(
                span_name(Phase.GRAD_COMM, "wait"), min(last_launch, backward_done), backward_done
            )
        record(span_name(Phase.FORWARD_BACKWARD), forward, backward_done)
        record(span_name(Phase.ITERATION), began, ended)
        self.times.append(ended - began)
        if trying:  # the deciding iteration is a trial too
            self.trials = len(self.times)
            self.target = self.trials + self._iters
        if len(self.times) == self.warmup:
            self.profiler.clear()  # statistics and traces start after the warm-up
        return ended - began

    @property
    def trying(self) -> bool:
        """Whether ``strategy="auto"`` is still trying candidates."""
        return self._tuned and self.precond is not None and self.precond.strategy_choice is None

    @property
    def warmup(self) -> int:
        """Leading iterations left out of the statistics: trials, then the warm-up."""
        return self.trials + self._warmup

    def result(self, times: list[list[float]], events: list[Event], iters: int) -> VariantResult:
        """This variant's entry of ``results.json`` (rank 0, after gathering)."""
        precond = self.precond
        plan = precond.fusion_plan if precond is not None else None
        return VariantResult(
            name=self.name,
            times=tuple(tuple(rank_times) for rank_times in times),
            warmup=self.warmup,
            breakdown=breakdown(events, iters - self._warmup),
            plan="" if precond is None else _describe(precond),
            fusion_buckets=None if plan is None else len(plan.buckets),
            skipped_steps=0 if precond is None else precond.skipped_steps,
        )


def _describe(precond: KFACPreconditioner) -> str:
    choice = precond.strategy_choice
    schedule = precond.comm_schedule
    if schedule is not None:
        return f"{precond.plan.describe()}; {schedule.describe()}"
    if choice is None:
        return precond.plan.describe()
    tried = ", ".join(
        f"{name} {1e3 * t:.1f} ms" + (" (dropped)" if name in choice.dropped else "")
        for name, t in choice.seconds.items()
    )
    return (
        f"chose {choice.chosen} after {choice.rounds} round(s) (amortized on the slowest rank: "
        f"{tried}); {precond.plan.describe()}"
    )


def _machine(options: BenchOptions, comm: Communicator) -> dict[str, str]:
    return {
        "cpu": describe_device(torch.device("cpu")),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "ranks": f"{comm.world_size} (gloo)",
        "threads per rank": str(options.threads),
        "subnormal floats": "flushed to zero" if options.flush_denormal else "kept",
    }


def _settings(options: BenchOptions) -> dict[str, str]:
    return {
        "iterations per variant": f"{options.iters} (first {options.warmup} are warm-up)",
        "chunk": f"{options.chunk} (variants take turns)",
        "factor/inverse update steps": (
            f"{options.factor_update_steps}/{options.inv_update_steps}"
        ),
        "fusion planned after": f"{options.planning_steps} factor steps",
        "input": _workload(options).describe(options),
        "SGD": f"lr {options.lr}, momentum 0.9; K-FAC damping {options.damping}"
        + (
            ""
            if options.factor_examples is None
            else f", statistics from {options.factor_examples} examples per rank"
        ),
    }


def _resolve_costs(
    options: BenchOptions, comm: Communicator, model: nn.Module
) -> tuple[CostModel | str, dict[str, str]]:
    if options.cost_model is not None:
        # The preconditioner gets the path (rank 0 loads it and shares it); the report
        # shows what that file gives this world size.
        shown = resolve_cost_model(options.cost_model, comm.world_size)
        return options.cost_model, describe_cost_model(shown, f"file {options.cost_model}")
    fitted = fit_live_cost_model(comm, factor_dims(model))
    source = "fitted at start on this link and the model's factor dims (rank 0's)"
    return fitted, describe_cost_model(fitted, source)


def _train(
    runs: list[_VariantRun], options: BenchOptions, rank: int, progress: Progress | None
) -> None:
    generator = torch.Generator().manual_seed(1000 * options.seed + rank)
    inputs, targets = _workload(options).batch(options, generator)
    total, done = options.iters * len(runs), 0
    while any(len(run.times) < run.target for run in runs):
        for run in runs:
            turn = min(options.chunk, run.target - len(run.times))
            # auto's trials run uninterrupted, as in training: its clock would otherwise
            # count the other variants' turns into the first iteration of each of its own.
            while turn > 0 or run.trying:
                seconds = run.iteration(inputs, targets)
                turn -= 1
                done += 1
                if progress is not None:
                    progress(done, total, f"{run.name} {1e3 * seconds:.0f} ms")


def run_worker(options: BenchOptions, progress: Progress | None = None) -> int:
    """Run the benchmark on this rank (all ranks call it); rank 0 writes the outputs.

    Joins the process group described by the environment (torchrun or the launcher), or
    runs alone when there is none. Returns the exit code.
    """
    with configure_cpu(options.threads, flush_denormal=options.flush_denormal):
        return _run_worker(options, progress)


def _run_worker(options: BenchOptions, progress: Progress | None) -> int:
    comm = init_distributed("gloo", timeout=timedelta(seconds=options.timeout))
    try:
        if options.layout == "fsdp" and comm.world_size == 1:  # no collective yet
            raise ValueError("layout 'fsdp' needs at least 2 ranks (FSDP2 shards over them)")
        probe = _build(options)
        costs, cost_info = _resolve_costs(options, comm, probe)
        unpack = unpack_seconds(probe)
        runs = [_VariantRun(name, options, comm, costs) for name in options.variants]
        _train(runs, options, comm.rank, progress if comm.rank == 0 else None)
        variants: list[VariantResult] = []
        traces: dict[str, list[Event]] = {}
        for run in runs:  # every rank gathers in the same order
            events = gather_events(run.profiler.events(), comm)
            local = torch.tensor(run.times, dtype=torch.float64)
            times = [t.tolist() for t in comm.all_gather(local).wait()]
            variants.append(run.result(times, events, options.iters))
            traces[run.name] = events
        if comm.rank == 0:
            results = BenchResults(
                command=options.command,
                model=options.model,
                world_size=comm.world_size,
                batch_size=options.batch_size,
                link=options.link,
                variants=tuple(variants),
                settings=_settings(options),
                machine=_machine(options, comm),
                cost_model=cost_info,
                factor_unpack=unpack,
                layout=options.layout,
            )
            outputs = write_bench_outputs(
                results,
                traces,
                options.out_dir,
                trace_iterations=options.trace_iters,
                log=lambda line: print(line, file=sys.stderr),
            )
            print(outputs.describe(), flush=True)
        barrier(comm)
    finally:
        destroy_distributed()
    return 0
