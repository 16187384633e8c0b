"""``spdkfac calibrate``: measure this machine's collectives, inverses and factor products.

Runs alone (inverse and factor models; communication for world size 1 is free) or under
``torchrun`` (collectives between the ranks too); rank 0 writes the JSON and the PNG.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch

from spdkfac.calibrate import (
    CalibrationPlan,
    FactorWorkload,
    calibrate,
    format_report,
    plot_calibration,
)
from spdkfac.cli.arguments import positive_float, positive_int
from spdkfac.comm import destroy_distributed, init_distributed
from spdkfac.linalg import INVERSE_METHODS
from spdkfac.models import MODEL_NAMES, build_model
from spdkfac.support.paths import output_file_problem

__all__ = ["DEFAULT_DIMS", "DEFAULT_SIZES", "add_parser", "parse_size", "run"]

# Powers of two and the points half-way between (x1.5): on the project's CPU, Cholesky at
# powers of two >= 128 is up to 40 % slower than at neighbouring sizes (cache conflicts), so
# a fit to powers of two alone overestimates typical K-FAC dims such as 144, 576, 1152.
DEFAULT_DIMS = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
DEFAULT_SIZES = tuple(4096 * 4**power for power in range(8))  # 4 KiB … 64 MiB
_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2}
_UNITS.update({"mib": 1024**2, "g": 1024**3, "gb": 1024**3, "gib": 1024**3})


def parse_size(text: str) -> int:
    """Bytes from ``"4096"``, ``"4KB"``, ``"64 MiB"``, ... (K, M, G are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4096, 4KB, 64MB)")
    value = round(float(match.group(1)) * _UNITS[unit])
    if value < 4:
        raise argparse.ArgumentTypeError(f"sizes must be >= 4 bytes (one float32), got {text!r}")
    return value


def _size_list(text: str) -> tuple[int, ...]:
    return tuple(parse_size(part) for part in text.split(",") if part.strip()) or _empty(text)


def _dim_list(text: str) -> tuple[int, ...]:
    dims = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            dims.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer dimension: {part!r}") from None
        if dims[-1] < 1:
            raise argparse.ArgumentTypeError(f"dimensions must be >= 1, got {part.strip()}")
    return tuple(dims) or _empty(text)


def _empty(text: str) -> tuple[int, ...]:
    raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")


def add_parser(verbs: Any) -> None:
    """Register the ``calibrate`` verb on an ``argparse`` sub-parser collection."""
    parser: argparse.ArgumentParser = verbs.add_parser(
        "calibrate",
        help="measure collectives, inverses and factor products; fit and save cost models",
        description=(
            "Time broadcast and all-reduce (under torchrun), damped inverses and, with "
            "--model, every layer's factor products on this machine; fit the cost models, "
            "write them as JSON for cost_model=PATH, print the fit errors and draw the fits. "
            "Larger dims and sizes are skipped, with a notice, when --max-seconds runs out."
        ),
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("spdkfac-costmodel.json"),
        help="calibration file to write (default: %(default)s)",
    )
    parser.add_argument(
        "--png", type=Path, default=None, help="plot to write (default: --out with .png)"
    )
    parser.add_argument("--no-png", action="store_true", help="do not draw the plot")
    parser.add_argument(
        "--max-seconds",
        type=positive_float,
        default=60.0,
        help="time budget for all measurements (default: %(default)s)",
    )
    parser.add_argument(
        "--dims",
        type=_dim_list,
        default=DEFAULT_DIMS,
        help="comma-separated inverse dimensions (default: 64,96,128,192,...,3072,4096)",
    )
    parser.add_argument(
        "--sizes",
        type=_size_list,
        default=DEFAULT_SIZES,
        help="comma-separated message sizes, e.g. 4KB,1MB (default: 4KB..64MB, powers of 4)",
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=5, help="timed repeats per item (default: 5)"
    )
    parser.add_argument(
        "--threads", type=positive_int, default=1, help="torch threads per rank (default: 1)"
    )
    parser.add_argument(
        "--method", choices=INVERSE_METHODS, default="cholesky", help="inverse method"
    )
    parser.add_argument(
        "--model", choices=MODEL_NAMES, default=None, help="also time this model's factors"
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=32, help="batch for --model (default: 32)"
    )
    parser.add_argument(
        "--input-size", type=positive_int, default=32, help="image side for --model"
    )
    parser.add_argument(
        "--in-channels", type=positive_int, default=3, help="image channels for --model"
    )
    parser.set_defaults(run=run)


def _check_paths(args: argparse.Namespace) -> str | None:
    """A bad output location, found before any process group or measurement.

    Only the writer (rank 0; torchrun sets ``RANK``) checks: other hosts of a multi-node
    run need not have the directory, and torchrun stops every worker when one fails.
    """
    if os.environ.get("RANK", "0") != "0":
        return None
    outputs = [args.out] + ([] if args.no_png else [args.png or args.out.with_suffix(".png")])
    for path in outputs:
        problem = output_file_problem(path)
        if problem is not None:
            return problem
    return None


def run(args: argparse.Namespace) -> int:
    """Calibrate on this process's rank; returns the process exit code."""
    problem = _check_paths(args)
    if problem is not None:
        print(f"spdkfac calibrate: error: {problem}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    comm = init_distributed()
    try:
        say = (lambda line: print(line, flush=True)) if comm.rank == 0 else None
        factors = None
        if args.model is not None:
            torch.manual_seed(0)  # every rank times the same layers and shapes
            model = build_model(
                args.model,
                num_classes=10,
                in_channels=args.in_channels,
                input_size=args.input_size,
            ).to(comm.device)
            shape = (args.batch_size, args.in_channels, args.input_size, args.input_size)
            batch = (
                torch.randn(shape, device=comm.device),
                torch.randint(0, 10, (args.batch_size,), device=comm.device),
            )
            factors = FactorWorkload(model, batch)
        if say is not None:
            say(
                f"calibrating: world size {comm.world_size}, {args.threads} thread(s) per rank, "
                f"budget {args.max_seconds:g} s"
            )
        plan = CalibrationPlan(
            dims=args.dims,
            sizes_bytes=args.sizes,
            repeats=args.repeats,
            method=args.method,
            max_seconds=args.max_seconds,
        )
        calibration = calibrate(
            comm,
            plan,
            factors=factors,
            log=say,
            extra_metadata=(
                {"model": args.model, "batch_size": args.batch_size, "input_size": args.input_size}
                if args.model is not None
                else {"model": None}
            ),
        )
        if say is not None:
            calibration.save(args.out)
            say(format_report(calibration))
            say(f"\nwrote {args.out}")
            if not args.no_png:
                png = args.png or args.out.with_suffix(".png")
                if plot_calibration(calibration, None, png):
                    say(f"wrote {png}")
    finally:
        destroy_distributed()
    return 0
