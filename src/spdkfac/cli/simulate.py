"""``spdkfac simulate``: project D-KFAC, MPD-KFAC, SPD-KFAC, Osawa et al.'s owner-computes
K-FAC and ``layer-paths`` onto clusters we do not have."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from spdkfac.cli.arguments import positive_int
from spdkfac.config import KFACConfig
from spdkfac.forms import FORM_METHODS
from spdkfac.planning.schedule import SCHEDULER_POLICIES
from spdkfac.sim import (
    DEFAULT_STRATEGIES,
    MAX_RANK_PROGRAMS,
    MAX_WORKERS,
    PRESETS,
    SIM_MODEL_NAMES,
    STRATEGY_TABLE,
    Hardware,
    MeasuredCompute,
    ProfiledCompute,
    SimulationRun,
    StrategyResult,
    Workload,
    markdown_report,
    model_by_name,
    parse_comm_schedulers,
    parse_strategies,
    rank_programs,
    resolve_hardware,
    results_to_json,
    simulate_strategy,
    trace_workload,
    write_trace,
)
from spdkfac.sim.fsdp import LAYOUTS, fsdp_section
from spdkfac.sim.paper import PAPER_TABLE_III
from spdkfac.sim.tensor_parallel import check_tensor_parallel
from spdkfac.sim.tensor_parallel_report import tensor_parallel_section
from spdkfac.strategies import AUTO_CANDIDATES
from spdkfac.support.paths import output_file_problem

__all__ = ["add_parser", "run"]

_Loaded = TypeVar("_Loaded")


def _strategies(text: str) -> tuple[str, ...]:
    try:
        return parse_strategies(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _comm_schedulers(text: str) -> tuple[str, ...]:
    try:
        return parse_comm_schedulers(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _workers(text: str) -> tuple[int, ...]:
    values = []
    for part in (piece.strip() for piece in text.split(",")):
        if part:
            values.append(positive_int(part))
    if any(value > MAX_WORKERS for value in values):
        raise argparse.ArgumentTypeError(
            f"at most {MAX_WORKERS} workers, got {max(values)} (the simulator's bound)"
        )
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma list of worker counts, got {text!r}")
    return tuple(dict.fromkeys(values))


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def _models(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(part.strip().lower() for part in text.split(",") if part.strip()))
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma list of models, got {text!r}")
    for name in names:
        try:
            model_by_name(name)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return names


def add_parser(verbs: Any) -> None:
    """Register the ``simulate`` verb on an ``argparse`` sub-parser collection."""
    parser: argparse.ArgumentParser = verbs.add_parser(
        "simulate",
        help="simulate D-KFAC, MPD-KFAC, SPD-KFAC, Osawa et al., layer-paths and ablations on P "
        "workers",
        description=(
            "Trace the model's layer shapes on the meta device, plan every strategy with the "
            "real planners and simulate one iteration per rank with a discrete-event model "
            "(compute stream, FIFO collectives sharing each rank's link, α-β costs). Prints "
            "iteration times, the profiler's breakdown and the factor + inverse memory of "
            "the most loaded rank per strategy and worker count."
        ),
    )
    add = parser.add_argument
    add(
        "--model",
        type=_models,
        default=("resnet50",),
        help=(
            f"comma list of models ({', '.join(SIM_MODEL_NAMES)}, or torchvision:NAME for a "
            "torchvision.models model); default resnet50"
        ),
    )
    add(
        "--batch-size",
        type=positive_int,
        default=None,
        help="examples per worker (default: the SPD-KFAC paper's for resnet50/resnet152/"
        "densenet201, 32/8/16; else 32)",
    )
    add("--input-size", type=positive_int, default=None, help="image side (default per model)")
    add("--workers", type=_workers, default=(64,), help="comma list of world sizes (default 64)")
    add(
        "--preset",
        choices=tuple(PRESETS),
        default="paper",
        help="hardware: cpu (this machine), paper (the SPD-KFAC paper's cluster: its α-β "
        "at 64 GPUs, a ring across 4-GPU nodes elsewhere), or the paper's GPUs on "
        f"{', '.join(name for name in PRESETS if name not in ('cpu', 'paper'))} (8-GPU "
        "nodes, abci's 4; see docs/cli.md)",
    )
    add(
        "--cost-model",
        default=None,
        metavar="PATH",
        help="calibration JSON (spdkfac calibrate) replacing the preset's inverse, "
        "collectives and factor times",
    )
    add(
        "--measured",
        default=None,
        metavar="PATH",
        help="per-op and per-layer times measured on one worker (benchmarks/sim/"
        "measure_sim_compute.py) for the model, batch and input size simulated",
    )
    add(
        "--profiled",
        default=None,
        metavar="TRACE",
        help="Chrome trace of a profiled K-FAC run of the model (spdkfac bench's "
        "traces/VARIANT.json): its measured pieces replace the compute models",
    )
    add(
        "--strategies",
        type=_strategies,
        default=DEFAULT_STRATEGIES,
        help=f"comma list of {', '.join(STRATEGY_TABLE)}, auto (the fastest of "
        f"{', '.join(AUTO_CANDIDATES)}) (default {','.join(DEFAULT_STRATEGIES)})",
    )
    add(
        "--overlap",
        type=_fraction,
        default=None,
        help="share of link rate a collective keeps while its ranks compute (default: the "
        "preset's, 1 = free overlap)",
    )
    add(
        "--single-queue",
        action="store_true",
        help="every collective in one FIFO queue (Horovod) instead of a factor channel",
    )
    add(
        "--comm-scheduler",
        type=_comm_schedulers,
        default=("fifo",),
        metavar="LIST",
        help="comma list of fifo (gradient and factor buckets on two channels sharing the "
        "link), priority (one planned order in which gradient chunks preempt factor "
        "chunks: spdkfac.planning.schedule), or both; non-fifo results are labelled "
        "STRATEGY+SCHEDULER (default fifo)",
    )
    add(
        "--inverse-method",
        choices=FORM_METHODS,
        default="cholesky",
        help="the run's inverse_method: what each inversion computes and broadcasts "
        "(cholesky/eigen: damped inverses as packed triangles; eigen-basis: "
        "eigendecompositions, d²+d elements), priced by the form's compute scale and wire "
        "size (default cholesky)",
    )
    add("--factor-update-steps", type=positive_int, default=1, help="factor refresh interval")
    add("--inv-update-steps", type=positive_int, default=1, help="inverse refresh interval")
    add(
        "--layout",
        choices=LAYOUTS,
        default="ddp",
        help="ddp (default) or fsdp: also project every strategy under FSDP2 (per-unit "
        "parameter all-gathers and gradient reduce-scatters in place of the all-reduce, "
        "K-FAC's step-time gradient gathers; spdkfac.sim.fsdp), a table after the report",
    )
    add(
        "--tp-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="also project every strategy under FSDP2 x TP in N-rank groups (llama; N "
        "divides every --workers) next to FSDP2: tables after the report (sim.tensor_parallel)",
    )
    add("--json", action="store_true", help="print one JSON object keyed by strategy")
    add("--trace", default=None, metavar="PATH", help="Chrome trace of the first run (ranks 0-7)")
    add("--out", default=None, metavar="PATH", help="also write the markdown report here")
    parser.set_defaults(run=run)


class _VerbError(Exception):
    """Stops the verb with one line on stderr and an exit code (2: unusable arguments)."""

    def __init__(self, message: object, code: int = 1) -> None:
        super().__init__(str(message))
        self.code = code


def _input_file(path: str, flag: str, load: Callable[[str], _Loaded]) -> _Loaded:
    """``load(path)``, refusing a path that is not a regular file (exit 2) or a file that
    is not what ``flag`` takes (exit 1). A missing file is left to the caller's handler."""
    if Path(path).exists() and not Path(path).is_file():
        raise _VerbError(f"{flag} {path}: not a file (a directory?); give the JSON file", 2)
    try:
        return load(path)
    except (IsADirectoryError, PermissionError, ValueError) as error:
        raise _VerbError(error) from None


def _hardware(args: argparse.Namespace) -> Hardware:
    try:
        hardware = resolve_hardware(args.preset, args.cost_model)
    except ValueError as error:
        raise _VerbError(error) from None
    if args.overlap is not None:
        hardware = replace(hardware, overlap=args.overlap)
    if args.single_queue:
        hardware = replace(hardware, single_queue=True)
    return hardware


def _workload(args: argparse.Namespace, model: str) -> tuple[Workload, int]:
    """The model's traced workload and batch; a size it cannot take exits 2."""
    entry = model_by_name(model, input_size=args.input_size)
    paper = PAPER_TABLE_III.get(entry.name)
    batch = args.batch_size or (paper[0] if paper else 32)
    try:
        workload = trace_workload(
            entry.build,
            entry.input_shape,
            batch_size=batch,
            name=entry.name,
            device="meta",
            vocab_size=entry.vocab_size,
            config=KFACConfig(inverse_method=args.inverse_method),
        )
    except (ValueError, RuntimeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
        size = "x".join(str(n) for n in entry.input_shape)
        size += "-token" if entry.vocab_size is not None else ""
        raise _VerbError(f"model {entry.name} cannot take {size} inputs: {reason}", 2) from None
    return workload, batch


def _check_size(hardware: Hardware, workers: int, model: str) -> None:
    """Refuse (exit 2) a run whose ranks all differ and would take too long."""
    programs = rank_programs(hardware, workers)
    if programs is not None and programs > MAX_RANK_PROGRAMS:
        raise _VerbError(
            f"{workers} workers of {model}: every rank differs (rank spread or jitter of "
            f"{hardware.name}), so one iteration kind simulates {programs} rank programs "
            f"(at most {MAX_RANK_PROGRAMS}, about 30 s per 1,000); use fewer workers",
            2,
        )


def _label(strategy: str, scheduler: str) -> str:
    """A result's key: the strategy, suffixed by a scheduler that orders the traffic
    (not fifo)."""
    ordered = SCHEDULER_POLICIES[scheduler].orders_traffic
    return f"{strategy}+{scheduler}" if ordered else strategy


def run(args: argparse.Namespace) -> int:
    """Run the ``simulate`` verb; returns the exit code."""
    try:
        return _run(args)
    except _VerbError as error:
        print(f"spdkfac simulate: error: {error}", file=sys.stderr)
        return error.code


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse (exit 2) an output path that cannot be written, before simulating."""
    for flag, path in (("--out", args.out), ("--trace", args.trace)):
        problem = None if path is None else output_file_problem(path)
        if problem is not None:
            raise _VerbError(f"{flag} {path}: {problem}", 2)


def _notes(args: argparse.Namespace, hardware: Hardware) -> list[str]:
    """The report's notes: the command, the preset and the options that change results."""
    notes = [
        f"command: `spdkfac simulate {' '.join(sys.argv[2:])}`"
        if sys.argv[1:2] == ["simulate"]
        else "command: spdkfac simulate",
        f"preset: {hardware.description}; overlap {hardware.overlap:g}"
        + ("; one collective queue" if hardware.single_queue else ""),
        f"factor/inverse update steps: {args.factor_update_steps}/{args.inv_update_steps}",
    ]
    if args.comm_scheduler != ("fifo",):
        notes.append(f"comm schedulers: {', '.join(args.comm_scheduler)}")
    if args.inverse_method != KFACConfig.inverse_method:
        notes.append(f"inverse method: {args.inverse_method}")
    if args.layout != "ddp":
        notes.append(f"layout: {args.layout} (FSDP2 tables after the report)")
    return notes


def _run(args: argparse.Namespace) -> int:
    _check_outputs(args)
    hardware = _hardware(args)
    measured = profiled = None
    if args.measured is not None:
        measured = _input_file(args.measured, "--measured", MeasuredCompute.load)
    if args.profiled is not None:
        profiled = _input_file(args.profiled, "--profiled", ProfiledCompute.load)
    runs: list[SimulationRun] = []
    fsdp: list[tuple[Workload, Hardware, dict[str, StrategyResult]]] = []
    for model in args.model:
        workload, batch = _workload(args, model)
        model_hardware = hardware
        try:
            if measured is not None and measured.model == workload.model:
                workload, model_hardware = measured.apply(workload, hardware)
            if profiled is not None:
                workload, model_hardware = profiled.apply(workload, model_hardware)
        except ValueError as error:
            raise _VerbError(error) from None
        for workers in args.workers:
            _check_size(model_hardware, workers, workload.model)
            try:
                check_tensor_parallel(workload, workers, args.tp_size)
            except ValueError as error:
                raise _VerbError(error, 2) from None
        for workers in args.workers:
            results = {
                _label(name, scheduler): simulate_strategy(
                    workload,
                    model_hardware,
                    workers,
                    name,
                    factor_update_steps=args.factor_update_steps,
                    inv_update_steps=args.inv_update_steps,
                    comm_scheduler=scheduler,
                )
                for name in args.strategies
                for scheduler in args.comm_scheduler
            }
            runs.append(SimulationRun(workload.model, batch, workers, hardware.name, results))
            fsdp.append((workload, model_hardware, results))
    report = markdown_report(runs, title="spdkfac simulate", notes=_notes(args, hardware))
    try:  # a strategy that is no row ("auto") exits 2
        if args.layout == "fsdp":
            report += "".join(fsdp_section(*run) for run in fsdp)
        if args.tp_size is not None:
            steps = args.factor_update_steps
            report += "".join(tensor_parallel_section(*run, args.tp_size, steps) for run in fsdp)
    except ValueError as error:
        raise _VerbError(error, 2) from None
    if args.out is not None:
        Path(args.out).write_text(report + "\n")
    if args.trace is not None:
        write_trace(args.trace, runs)
    if args.json:
        print(json.dumps(results_to_json(runs), indent=1))
    else:
        print(report)
    return 0
