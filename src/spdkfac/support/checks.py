"""Validators of option values: each raises ``ValueError`` naming the option and the value."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any, cast

from torch import nn

from spdkfac.types import SkipEntry

__all__ = [
    "check_candidates",
    "check_choice",
    "check_int",
    "check_number",
    "check_skip_layers",
    "plain_scalar",
]


def plain_scalar(value: object) -> object:
    """A scalar of an array library (a numpy scalar, a 0-d tensor or array) as the Python
    number it holds; anything else as it is (a bool stays a bool, so it is refused).

    Duck-typed (``ndim == 0`` and ``item()``), so numpy need not be imported.
    """
    if type(value) in (bool, int, float):  # numpy.float64 is a float subclass: converted
        return value
    item = getattr(value, "item", None)
    if getattr(value, "ndim", None) == 0 and callable(item):
        try:
            return item()
        except (RuntimeError, TypeError, ValueError):  # e.g. a tensor on the meta device
            return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def check_number(
    name: str,
    value: object,
    *,
    low: float = 0.0,
    low_inclusive: bool = False,
    high: float | None = None,
    high_inclusive: bool = True,
) -> float:
    """``value`` as a finite Python float within the bounds (default: ``> 0``).

    A numpy scalar or a 0-d tensor is a number too (its value is returned as a float).

    Raises:
        ValueError: ``"<name> must be ..., got <value>"`` for a bool, a non-number (a
            tensor or array with elements is not one), a non-finite number or one outside
            the bounds.
    """
    plain = plain_scalar(value)
    if isinstance(plain, bool) or not isinstance(plain, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    number = float(plain)
    too_low = number < low or (number == low and not low_inclusive)
    too_high = high is not None and (number > high or (number == high and not high_inclusive))
    if not math.isfinite(number) or too_low or too_high:
        bound = f">= {low:g}" if low_inclusive else f"> {low:g}"
        if high is not None:
            bound += f" and {'<=' if high_inclusive else '<'} {high:g}"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return number


def check_int(name: str, value: object, *, low: int = 1) -> int:
    """``value`` as a Python int ``>= low`` (bools refused; a numpy integer or an integer
    0-d tensor is an int too).

    Raises:
        ValueError: ``"<name> must be an int >= <low>, got <value>"``.
    """
    plain = plain_scalar(value)
    if isinstance(plain, bool) or not isinstance(plain, int) or plain < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return int(plain)


def check_choice(name: str, value: object, choices: Collection[object]) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_candidates(value: object, table: Mapping[str, Any]) -> tuple[str, ...]:
    """``auto_candidates``: a non-empty sequence of K-FAC rows of the strategy ``table``,
    as a tuple."""
    if isinstance(value, str) or not isinstance(value, (tuple, list)) or not value:
        raise ValueError(f"auto_candidates must be a non-empty tuple of names, got {value!r}")
    candidates = tuple(value)
    for name in candidates:
        if name not in table or table[name].base is None:
            raise ValueError(
                f"auto_candidates entry {name!r} is not a K-FAC row of the strategy table "
                f"({sorted(k for k, row in table.items() if row.base is not None)})"
            )
    return candidates


def check_skip_layers(value: object) -> tuple[SkipEntry, ...]:
    """``skip_layers``: a sequence of module names, regular expressions or module types."""
    if isinstance(value, (str, type)):
        raise ValueError(f"skip_layers must be a sequence of names or types, got {value!r}")
    try:
        entries = tuple(cast(Iterable[object], value))
    except TypeError:
        raise ValueError(f"skip_layers must be a sequence, got {value!r}") from None
    for entry in entries:
        if not isinstance(entry, str) and not (
            isinstance(entry, type) and issubclass(entry, nn.Module)
        ):
            raise ValueError(
                f"skip_layers entries must be module names or nn.Module types, got {entry!r}"
            )
        if isinstance(entry, str) and entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as error:
                raise ValueError(f"skip_layers entry {entry!r} is not a regex: {error}") from None
    return cast(tuple[SkipEntry, ...], entries)
