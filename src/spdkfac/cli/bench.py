"""``spdkfac bench``: SGD and the distributed K-FAC variants side by side, with breakdowns."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from spdkfac.bench.launch import LIVE_PROGRESS_ENV, MASTER_PORT, launch_ranks
from spdkfac.bench.link import MeasuredLink
from spdkfac.bench.linkprobe import probe_cluster
from spdkfac.bench.netns import Cluster, available, check_rate, emulated_cluster
from spdkfac.bench.report import record_link
from spdkfac.bench.runner import LAYOUTS, BenchOptions, run_worker
from spdkfac.bench.variants import ONE_VARIANT, PRESETS, VARIANTS, parse_variants
from spdkfac.cli.arguments import non_negative_int, positive_float, positive_int
from spdkfac.config import KFACConfig
from spdkfac.models import MODEL_NAMES, TEXT_MODELS
from spdkfac.support.paths import output_dir_problem
from spdkfac.training.progress import ProgressBar

__all__ = ["add_parser", "run"]

# Options forwarded verbatim from the launcher to its ranks (``--dest-with-dashes``).
_FORWARDED = (
    "model", "iters", "warmup", "chunk", "batch_size", "threads", "factor_update_steps",
    "inv_update_steps", "fusion_warmup_steps", "lr", "damping", "input_size", "in_channels",
    "seed", "cost_model", "trace_iters", "out_dir", "timeout", "factor_examples",
    "flush_denormal", "layout",
)  # fmt: skip
_PROBE_TIMEOUT = 120.0  # one measurement of the emulated link takes ~10 s on 2 ranks here


def _variants(text: str) -> tuple[str, ...]:
    try:
        return parse_variants(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _rate(text: str) -> str:
    try:
        return check_rate(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_parser(verbs: Any) -> None:
    """Register the ``bench`` verb on an ``argparse`` sub-parser collection."""
    presets = "; ".join(f"{name} = {','.join(names)}" for name, names in PRESETS.items())
    parser: argparse.ArgumentParser = verbs.add_parser(
        "bench",
        help="time SGD, D-KFAC, MPD-KFAC, SPD-KFAC and ablations side by side",
        description=(
            "Train every variant's own copy of a built-in model (same initialisation) on "
            "synthetic data, variants taking turns in chunks, and write report.md (median, "
            "IQR, ratios, the paper's Fig. 9 breakdown and Fig. 10 exposed factor "
            "communication), breakdown.png, results.json and Chrome traces. Under torchrun "
            "each process is a rank; otherwise it starts --nproc ranks itself, on loopback "
            "or (--link, as root) in an emulated cluster."
        ),
    )
    add = parser.add_argument
    add(
        "--model",
        choices=(*MODEL_NAMES, *TEXT_MODELS),
        default="resnet32",
        help="built-in model (gpt: a language model on random token ids)",
    )
    add(
        "--variants",
        type=_variants,
        default=PRESETS["main"],
        help=f"comma list of {', '.join(VARIANTS)} or presets ({presets}; a preset wins "
        "over the variant of its name, variant:NAME is the variant alone); default main",
    )
    add(
        "--layout",
        choices=LAYOUTS,
        default="ddp",
        help="every variant's model under DistributedDataParallel (ddp) or sharded by FSDP2 "
        "(fsdp: fully_shard of each unit and the root; needs 2 or more ranks)",
    )
    add("--iters", type=positive_int, default=30, help="iterations per variant (with warm-up)")
    add("--warmup", type=non_negative_int, default=3, help="iterations per variant not counted")
    add("--chunk", type=positive_int, default=5, help="iterations per turn")
    add("--batch-size", type=positive_int, default=32, help="batch size per rank")
    add("--threads", type=positive_int, default=1, help="torch threads per rank")
    add(
        "--flush-denormal",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="treat subnormal floats as zero (torch.set_flush_denormal; default on)",
    )
    # Every phase at every iteration (the breakdown's terms), not the library's intervals.
    add("--factor-update-steps", type=positive_int, default=1, help="K-FAC factor interval")
    add("--inv-update-steps", type=positive_int, default=1, help="K-FAC inverse interval")
    add(
        "--fusion-warmup-steps",
        type=positive_int,
        default=None,
        help="factor steps the optimal fusion measures before planning (default: --warmup)",
    )
    add("--lr", type=positive_float, default=0.01, help="SGD learning rate")
    damping = KFACConfig().damping
    add("--damping", type=positive_float, default=damping, help=f"K-FAC damping ({damping})")
    add(
        "--factor-examples",
        type=positive_int,
        default=None,
        help="K-FAC statistics from the first N examples of each rank's batch (default all)",
    )
    add(
        "--input-size",
        type=positive_int,
        default=32,
        help="height and width of the input (gpt: sequence length)",
    )
    add("--in-channels", type=positive_int, default=3, help="channels of the input")
    add("--seed", type=int, default=0, help="random seed (weights and data)")
    add("--cost-model", default=None, help="calibration JSON (default: fit on the live link)")
    add("--trace-iters", type=positive_int, default=5, help="iterations kept in each trace")
    add("--out-dir", default="bench-out", help="output directory (default: %(default)s)")
    add("--nproc", type=positive_int, default=2, help="ranks to start without torchrun")
    add("--link", type=_rate, default=None, help="emulated cluster link rate, e.g. 1gbit (root)")
    add("--timeout", type=positive_float, default=1800.0, help="hard limit in seconds")
    add("--link-label", default=None, help=argparse.SUPPRESS)
    add("--command-line", default=None, help=argparse.SUPPRESS)
    parser.set_defaults(run=run, bench_parser=parser)


def _forwarded_flags(args: argparse.Namespace) -> list[str]:
    # A variant named like a preset (osawa, auto) travels as variant:NAME, or the ranks
    # would expand the preset.
    names = [ONE_VARIANT + name if name in PRESETS else name for name in args.variants]
    flags = ["--variants", ",".join(names)]
    for dest in _FORWARDED:
        value = getattr(args, dest)
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def _command_line(args: argparse.Namespace) -> str:
    """What the user typed, when this process was started as ``spdkfac bench``."""
    if args.command_line:
        return str(args.command_line)
    if sys.argv[1:2] == ["bench"]:
        program = "python -m spdkfac" if sys.argv[0].endswith("__main__.py") else "spdkfac"
        if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's own flags are not visible here
            program = f"torchrun (world size {os.environ.get('WORLD_SIZE')}) -m spdkfac"
        return f"{program} {shlex.join(sys.argv[1:])}"
    return f"spdkfac bench {shlex.join(_forwarded_flags(args))}"


def _options(args: argparse.Namespace, link: str) -> BenchOptions:
    return BenchOptions(
        **{dest: getattr(args, dest) for dest in _FORWARDED},
        variants=tuple(args.variants),
        link=link,
        command=_command_line(args),
    )


class _Progress:
    """Rank 0's progress bar, created at the first report (when the total is known)."""

    def __init__(self) -> None:
        self._bar: ProgressBar | None = None
        live = os.environ.get(LIVE_PROGRESS_ENV)
        self._live = None if live is None else live == "1"

    def __call__(self, done: int, total: int, text: str) -> None:
        if self._bar is None:
            self._bar = ProgressBar(total, "bench", live=self._live)
        self._bar.update(done, text)
        if done >= total:
            self._bar.close(text)


def run(args: argparse.Namespace) -> int:
    """Run ``spdkfac bench`` as a rank (under torchrun or the launcher) or launch the ranks."""
    if args.iters <= args.warmup:
        args.bench_parser.error(f"--iters ({args.iters}) must exceed --warmup ({args.warmup})")
    if args.cost_model is not None and not Path(args.cost_model).is_file():
        raise FileNotFoundError(f"--cost-model: no such file: {args.cost_model}")
    problem = output_dir_problem(args.out_dir)
    if problem is not None:  # before any rank runs, not once the benchmark is done
        args.bench_parser.error(f"--out-dir: {problem}")
    ranks = int(os.environ.get("WORLD_SIZE", args.nproc))
    if args.layout == "fsdp" and ranks < 2:  # before any rank or process group starts
        args.bench_parser.error(f"--layout fsdp needs 2 or more ranks, got {ranks}")
    if "WORLD_SIZE" in os.environ:
        label = args.link_label or f"as launched by torchrun ({os.environ['WORLD_SIZE']} ranks)"
        return run_worker(_options(args, label), _Progress())
    if args.nproc == 1:
        if args.link is not None:
            args.bench_parser.error("--link needs --nproc >= 2")
        return run_worker(_options(args, "none (1 rank)"), _Progress())
    if args.link is not None and not available():
        print(
            "spdkfac bench: --link needs root and iproute2 (ip, tc) to build the emulated "
            "cluster; run as root, or drop --link to benchmark on loopback",
            file=sys.stderr,
        )
        return 2
    if args.link is None:
        return _launch(args, "loopback (127.0.0.1)", None, args.timeout)
    with emulated_cluster(args.nproc, args.link) as cluster:
        return _run_on_link(args, cluster)


def _launch(args: argparse.Namespace, label: str, cluster: Cluster | None, timeout: float) -> int:
    flags = [*_forwarded_flags(args), "--link-label", label, "--command-line", _command_line(args)]
    print(
        f"spdkfac bench: {args.nproc} ranks, link {label}, variants {','.join(args.variants)}",
        file=sys.stderr,
        flush=True,
    )
    return launch_ranks(flags, nproc=args.nproc, cluster=cluster, timeout=timeout)


def _run_on_link(args: argparse.Namespace, cluster: Cluster) -> int:
    """Measure the emulated link, benchmark on it, measure it again, and record both
    measurements in ``results.json`` and ``report.md`` (the label quotes the first)."""
    deadline = time.monotonic() + float(args.timeout)

    def remaining(cap: float = float("inf")) -> float:
        return max(1.0, min(cap, deadline - time.monotonic()))

    print(f"spdkfac bench: measuring the emulated {args.link} link", file=sys.stderr, flush=True)
    before = probe_cluster(cluster, timeout=remaining(_PROBE_TIMEOUT))
    if before is None:
        print("spdkfac bench: could not measure the emulated link", file=sys.stderr)
        return 1
    link = MeasuredLink(cluster.shape, before)
    code = _launch(args, link.label(), cluster, remaining())
    if code != 0:
        return code
    after = probe_cluster(cluster, timeout=remaining(_PROBE_TIMEOUT), port=MASTER_PORT + 2)
    if after is None:
        print(
            "spdkfac bench: could not measure the link after the run; the report keeps the "
            "measurement before it",
            file=sys.stderr,
        )
    report = record_link(args.out_dir, replace(link, after=after))
    print(f"spdkfac bench: recorded the measured link in {report}", file=sys.stderr)
    return 0
