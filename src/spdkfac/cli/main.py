"""Argument parsing and dispatch for the ``spdkfac`` command."""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import TextIO

from spdkfac import __version__
from spdkfac.cli import bench, calibrate, demo, simulate, train

__all__ = ["ONE_LINE_USAGE", "build_parser", "main"]

#: Every verb's usage line: an error prints it and one line naming the problem (the
#: options are listed by ``--help``, not before every error).
ONE_LINE_USAGE = "%(prog)s [--OPTION VALUE ...] (--help lists the options)"


def build_parser() -> argparse.ArgumentParser:
    """The ``spdkfac`` parser with one sub-parser per verb."""
    parser = argparse.ArgumentParser(
        prog="spdkfac", description="Distributed K-FAC training for PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"spdkfac {__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb in (demo, calibrate, bench, train, simulate):
        verb.add_parser(verbs)
    for sub in verbs.choices.values():
        if sub.usage is None:
            sub.usage = ONE_LINE_USAGE
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv``) and run the chosen verb; returns the exit code.

    Bad arguments exit with code 2 (argparse); a missing input file prints one line naming
    it and returns 1 instead of a traceback.
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the verb's one-line usage and error, not the top-level parser's
        _verb_parser(parser, args.verb).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        with _notes(args.verb):
            result: int = args.run(args)
    except FileNotFoundError as error:
        print(f"spdkfac {args.verb}: error: {error}", file=sys.stderr)
        return 1
    return result


def _verb_parser(parser: argparse.ArgumentParser, verb: str) -> argparse.ArgumentParser:
    """The sub-parser of ``verb`` in ``parser`` (built by :func:`build_parser`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub: argparse.ArgumentParser = action.choices[verb]
            return sub
    return parser


@contextlib.contextmanager
def _notes(verb: str) -> Iterator[None]:
    """Within the block: spdkfac's own warnings (``"spdkfac: ..."``) are printed as one line
    in words, ``spdkfac VERB: note: ...``, without Python's file, line and source line;
    other warnings as Python prints them."""
    shown = warnings.showwarning

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        text = str(message)
        if text.startswith("spdkfac: "):
            print(f"spdkfac {verb}: note: {text.removeprefix('spdkfac: ')}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown
