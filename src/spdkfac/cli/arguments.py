"""Argument types shared by the verbs: validated numbers for ``argparse``.

Each parses the text, then validates it with :mod:`spdkfac.support.checks`; argparse reports a
failure as ``argument --flag: value must be ..., got ...``.
"""

from __future__ import annotations

import argparse

from spdkfac.support.checks import check_int, check_number

__all__ = ["non_negative_int", "positive_float", "positive_int"]


def _int(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    try:
        return check_int("value", value, low=low)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_int(text: str) -> int:
    """An int >= 1."""
    return _int(text, 1)


def non_negative_int(text: str) -> int:
    """An int >= 0."""
    return _int(text, 0)


def positive_float(text: str) -> float:
    """A finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    try:
        return check_number("value", value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
