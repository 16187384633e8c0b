"""Time to result, fairly tuned: K-FAC against tuned SGD, AdamW, Muon and SOAP.

AlgoPerf-style: fixed workloads and targets, the same number of tuning trials for every
optimizer from a declared search space, chosen on a validation split carved from the
training data. The image workload: 3 seeds of each chosen configuration timed to fixed
targets (wall time of training, evaluation excluded), under ``torchrun``. The text workload
(revision 4, :mod:`study.steps`): scored in steps to a target its baselines set (AlgoPerf's
rule), in phases target-tune, target-seeds, pilot and score, one process per run and
``--parallel`` runs side by side. Every trial is one ``spdkfac train`` run recorded in
``OUT/trials.jsonl``; run the same command again to continue a study that stopped
(finished trials are skipped, an unfinished one starts over; stop it with Ctrl-C or
SIGTERM, which also end the running trials' processes). ``OUT/report.md`` gives the
protocol, the ratio lines, the results of every phase, plots and every trial.

    python benchmarks/study_time_to_accuracy.py --out benchmarks/reports/study_time_to_accuracy
    python benchmarks/study_time_to_accuracy.py --workloads text --parallel 2 \
        --out benchmarks/reports/study_time_to_accuracy     # text revision 4
    python benchmarks/study_time_to_accuracy.py --smoke --out /tmp/study-smoke   # a pilot
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from pathlib import Path

from study.driver import ALL_PHASES, run_study
from study.runner import ProcessLauncher, kill_running
from study.store import ProtocolMismatchError
from study.workloads import build_plan


def _names(text: str) -> tuple[str, ...]:
    return tuple(part for part in text.split(",") if part)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/reports/study_time_to_accuracy")
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny models and budgets (tests, pilots); its own protocol",
    )
    parser.add_argument(
        "--workloads",
        type=_names,
        default=("fashion-mnist", "text"),
        help="comma-separated: fashion-mnist, text",
    )
    parser.add_argument(
        "--optimizers",
        type=_names,
        default=None,
        help="comma-separated subset of the optimizers (default: all)",
    )
    parser.add_argument(
        "--trials",
        type=int,
        default=6,
        help="tuning trials per optimizer (a workload may declare more: text, 8)",
    )
    parser.add_argument(
        "--seeds",
        type=lambda t: tuple(int(s) for s in _names(t)),
        default=(1, 2, 3),
        help="seeds of the final runs",
    )
    parser.add_argument("--workers", type=int, default=2, help="processes per run (torchrun)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=3 * 3600,
        help="seconds a run may take before it is killed and recorded as such",
    )
    parser.add_argument(
        "--phase",
        choices=(*ALL_PHASES, "all", "report"),
        default="all",
        help="tune only, target-setting runs only (workloads whose baselines set the "
        "target), final runs only, a phase of the steps-scored workloads (target-tune, "
        "target-seeds, pilot, score, then cost: text revision 4), all in order, or only "
        "rewrite the report",
    )
    parser.add_argument(
        "--parallel",
        type=int,
        default=1,
        help="steps-scored workloads: trials run side by side, one process and one thread "
        "each (their scores are steps, which the machine's load does not change)",
    )
    parser.add_argument("--fashion-data", help="Fashion-MNIST directory (default: Debian's)")
    parser.add_argument(
        "--text-data",
        help="the text workload's dictionary, a gcide.dict.dz or .dict (default: Debian's "
        "dict-gcide)",
    )
    return parser


def _exit_on_signal(number: int, frame: object) -> None:
    kill_running()  # trials running side by side, in threads this signal does not reach
    sys.exit(128 + number)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    common = {
        "smoke": args.smoke,
        "trials": args.trials,
        "seeds": args.seeds,
        "workers": args.workers,
        "fashion_data": args.fashion_data,
        "text_data": args.text_data,
    }
    try:
        plan = build_plan(workloads=args.workloads, optimizers=args.optimizers, **common)
    except ValueError as error:
        parser.error(str(error))
    if args.parallel < 1:
        parser.error(f"--parallel must be >= 1, got {args.parallel}")
    phases = {"all": ALL_PHASES, "report": ()}.get(args.phase, (args.phase,))
    command = shlex.join(["python", sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    try:
        run_study(
            plan,
            args.out,
            ProcessLauncher(args.workers),
            timeout=args.timeout,
            phases=phases,
            command=command,
            single=ProcessLauncher(1),
            parallel=args.parallel,
            report_plan=build_plan(optimizers=args.optimizers, **common),  # every workload
        )
    except ProtocolMismatchError as error:
        print(f"study: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    # SIGTERM/SIGHUP become an exception, so the running trial's whole torchrun session is
    # killed on the way out (see study.runner.ProcessLauncher) instead of left running.
    for signal_number in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signal_number, _exit_on_signal)
    sys.exit(main())
