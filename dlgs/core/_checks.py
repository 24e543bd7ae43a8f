"""The two argument checks every option of dlgs goes through.

One wording everywhere: a value of the wrong type raises
``TypeError``, a value out of range (NaN and infinities included) raises
``ValueError``, and both messages name the parameter and the accepted range,
e.g. ``density must be a finite float in (0, 1], got nan``.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

__all__ = ["check_float", "check_int"]

Number = Union[int, float]


def _range(low: Optional[Number], high: Optional[Number], low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low!r}, {high!r}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low!r}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high!r}"
    return ""


def check_float(
    name: str,
    value: Any,
    *,
    low: Optional[Number] = None,
    high: Optional[Number] = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Check that ``value`` is a finite int or float within the bounds.

    ``low_open`` / ``high_open`` exclude the bound itself. ``bool`` is refused
    (``True`` is an int to Python but never a meant density or threshold).

    Raises:
        TypeError: not an int or float, or a bool.
        ValueError: NaN, an infinity, or out of range.
    """
    accepted = " ".join(filter(None, ("a finite float", _range(low, high, low_open, high_open))))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {accepted}, got {type(value).__name__}")
    ok = math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise ValueError(f"{name} must be {accepted}, got {value!r}")


def check_int(name: str, value: Any, low: int, *, none_ok: bool = False) -> None:
    """Check that ``value`` is an int ``>= low`` (or None when ``none_ok``).

    Raises:
        TypeError: not an int, or a bool.
        ValueError: below ``low``.
    """
    if none_ok and value is None:
        return
    accepted = f"{'None or ' if none_ok else ''}an int >= {low}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {accepted}, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be {accepted}, got {value!r}")
