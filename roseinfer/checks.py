"""Value checks shared by the configs and the params: a bad value fails at once with an error that names it.

A wrong type is a TypeError, a wrong value a ValueError, and the message says what is allowed.
Two Python traps are closed on purpose: `True` is an int (so `block_size=True` would be a
block of one token) and `float("nan")` fails every comparison (so `not x < 0` lets it through);
both are refused wherever a number is expected, and so is infinity.
"""

from __future__ import annotations

import math


def is_int(x) -> bool:
    """An int that is not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    """An int or float that is finite as a float (not a bool, not inf or nan, not 10**400)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def check_int(name: str, value, low: int = 1, none_ok: bool = False) -> None:
    """An int >= low (or None, if allowed)."""
    allowed = f"an int >= {low}" + (" or None" if none_ok else "")
    if value is None and none_ok:
        return
    if not is_int(value):
        raise TypeError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be {allowed}, got {value}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def check_number(name: str, value, low: float, high: float, allowed: str, low_open: bool = False) -> None:
    """A number in [low, high) (or (low, high] with `low_open`); nan fails both comparisons and is refused."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")
    ok = low < value <= high if low_open else low <= value < high
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value}")
