"""Validators of option values: each raises ``ValueError`` naming the option and the value."""

from __future__ import annotations

import math
from collections.abc import Collection

__all__ = ["check_choice", "check_int", "check_number"]


def check_number(
    name: str,
    value: object,
    *,
    low: float = 0.0,
    low_inclusive: bool = False,
    high: float | None = None,
    high_inclusive: bool = True,
) -> float:
    """``value`` as a finite float within the bounds (default: ``> 0``).

    Raises:
        ValueError: ``"<name> must be ..., got <value>"`` for a bool, a non-number, a
            non-finite number or one outside the bounds.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    number = float(value)
    too_low = number < low or (number == low and not low_inclusive)
    too_high = high is not None and (number > high or (number == high and not high_inclusive))
    if not math.isfinite(number) or too_low or too_high:
        bound = f">= {low:g}" if low_inclusive else f"> {low:g}"
        if high is not None:
            bound += f" and {'<=' if high_inclusive else '<'} {high:g}"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return number


def check_int(name: str, value: object, *, low: int = 1) -> int:
    """``value`` as an int ``>= low`` (bools refused).

    Raises:
        ValueError: ``"<name> must be an int >= <low>, got <value>"``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def check_choice(name: str, value: object, choices: Collection[object]) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
