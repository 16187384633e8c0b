"""Argument parsing and dispatch for the ``spdkfac`` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from spdkfac.cli import bench, calibrate, demo, simulate, train

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``spdkfac`` parser with one sub-parser per verb."""
    parser = argparse.ArgumentParser(
        prog="spdkfac", description="Distributed K-FAC training for PyTorch."
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    demo.add_parser(verbs)
    calibrate.add_parser(verbs)
    bench.add_parser(verbs)
    train.add_parser(verbs)
    simulate.add_parser(verbs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv``) and run the chosen verb; returns the exit code.

    Bad arguments exit with code 2 (argparse); a missing input file prints one line naming
    it and returns 1 instead of a traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        result: int = args.run(args)
    except FileNotFoundError as error:
        print(f"spdkfac {args.verb}: error: {error}", file=sys.stderr)
        return 1
    return result
