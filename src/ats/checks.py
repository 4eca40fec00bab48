"""Validators shared by every layer: each returns the clean value or raises one-line `ATSError` naming the field.

`check_number` is the one rule behind them all: a real number (never a bool), finite, within an optional range.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from .errors import ATSError

# numpy's integer and floating types register as these (so no numpy import: the CLI's checks load without it)
_INTS = numbers.Integral
_NUMBERS = numbers.Real


def check_number(field: str, value, *, integer: bool = False, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False, what: str | None = None) -> float | int:
    """`value` as int (integer=True) or float, within [low, high] (open ends with low_open / high_open).

    Args:
        field: the field's name, quoted in the error.
        value: the value to check; a bool is never a number.
        integer: require an integer (int or numpy integer) instead of any finite real number.
        low: the lower bound, or None for none.
        high: the upper bound, or None for none.
        low_open: exclude `low` itself.
        high_open: exclude `high` itself.
        what: the expectation the error states (e.g. "a positive integer"); default: derived from the range.

    Returns:
        `value` as `int` (integer=True) or `float`.

    Raises:
        ATSError: if `value` is a bool, not a number of the asked kind, not finite, or outside the range.
    """
    kinds = _INTS if integer else _NUMBERS
    if isinstance(value, bool) or not isinstance(value, kinds) or (not integer and not math.isfinite(value)):
        raise ATSError(f"{field}: expected {what or ('an integer' if integer else 'a finite number')}, "
                       f"got {value!r}")
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        if high is None:
            span = f"{'an integer' if integer else 'a number'} {'>' if low_open else '>='} {low}"
        elif low is None:
            span = f"{'an integer' if integer else 'a number'} {'<' if high_open else '<='} {high}"
        else:
            span = f"a value in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ATSError(f"{field}: expected {what or span}, got {value!r}")
    return int(value) if integer else float(value)


def check_positive_int(field: str, value) -> int:
    """`value` as `int` if it is an integer >= 1; else `ATSError` naming `field`."""
    return check_number(field, value, integer=True, low=1, what="a positive integer")


def check_nonnegative_int(field: str, value) -> int:
    """`value` as `int` if it is an integer >= 0; else `ATSError` naming `field`."""
    return check_number(field, value, integer=True, low=0, what="a non-negative integer")


def check_positive_float(field: str, value) -> float:
    """`value` as `float` if it is a finite number > 0; else `ATSError` naming `field`."""
    return check_number(field, value, low=0, low_open=True, what="a positive finite number")


def check_nonnegative_float(field: str, value) -> float:
    """`value` as `float` if it is a finite number >= 0; else `ATSError` naming `field`."""
    return check_number(field, value, low=0, what="a finite number >= 0")


def check_choice(field: str, value, choices: Sequence) -> object:
    """`value` unchanged if it is one of `choices`; else `ATSError` naming `field` and the known values."""
    if value not in choices:
        raise ATSError(f"{field}: unknown value {value!r}; known: {', '.join(map(str, choices))}")
    return value


def check_nonempty(field: str, value) -> str:
    """`value` if it is a string with more than blanks in it; else `ATSError` naming `field` (an empty path would
    name the working folder, an empty list of names nothing)."""
    if not isinstance(value, str) or not value.strip():
        raise ATSError(f"{field}: expected a non-empty value, got {value!r}")
    return value
