"""Numeric argument checks in one place, each failing with the one-line usage error.

Every check returns the value (as ``int`` or ``float``) or raises
:class:`~phalanx.errors.ConfigError` saying what was given, what was expected and what
to do. ``bool`` is refused where a number is expected (``True`` is an ``int`` in Python).

Example:
    >>> from phalanx import check
    >>> check.positive_int("every", 8, "Pass e.g. every=8.")
    8
    >>> check.fraction("TopK(ratio", 2.0, "Pass e.g. TopK(0.01).", close=")")
    Traceback (most recent call last):
    ...
    phalanx.errors.ConfigError: TopK(ratio=2.0); expected a fraction in (0, 1]. Pass e.g. TopK(0.01).
    >>> check.parse_float("PHALANX_TIMEOUT", "90", "Set it to seconds, e.g. 60.")
    90.0
"""
from __future__ import annotations

import math

from .errors import ConfigError, usage


def _is_number(value: object, kinds: tuple[type, ...]) -> bool:
    return isinstance(value, kinds) and not isinstance(value, bool)


def integer(name: str, value: object, hint: str, *, minimum: int = 0, close: str = "") -> int:
    """An ``int`` >= ``minimum``; ``close`` ends the quoted name, e.g. ")" for ``Owner(arg``."""
    if not _is_number(value, (int,)) or value < minimum:  # type: ignore[operator]
        raise ConfigError(usage(f"{name}={value!r}{close}", f"an integer >= {minimum}", hint))
    return int(value)  # type: ignore[call-overload]


def positive_int(name: str, value: object, hint: str, *, close: str = "") -> int:
    """An ``int`` >= 1."""
    return integer(name, value, hint, minimum=1, close=close)


def number(name: str, value: object, hint: str, *, low: float = -math.inf, high: float = math.inf,
           low_open: bool = True, high_open: bool = True, expected: str | None = None, close: str = "") -> float:
    """A finite real number in the interval from ``low`` to ``high`` (open ends by default)."""
    ok = _is_number(value, (int, float)) and math.isfinite(value)  # type: ignore[arg-type]
    if ok:
        v = float(value)  # type: ignore[arg-type]
        ok = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        if expected is None:
            lo, hi = ("(" if low_open else "[") + f"{low:g}", f"{high:g}" + (")" if high_open else "]")
            expected = "a finite number > 0" if (low, high, low_open) == (0, math.inf, True) \
                else f"a number in {lo}, {hi}"
        raise ConfigError(usage(f"{name}={value!r}{close}", expected, hint))
    return float(value)  # type: ignore[arg-type]


def positive_float(name: str, value: object, hint: str, *, close: str = "") -> float:
    """A finite number > 0."""
    return number(name, value, hint, low=0.0, close=close)


def fraction(name: str, value: object, hint: str, *, close: str = "") -> float:
    """A number in (0, 1]."""
    return number(name, value, hint, low=0.0, high=1.0, high_open=False, expected="a fraction in (0, 1]",
                  close=close)


def parse_float(name: str, text: str, hint: str, *, low: float = 0.0) -> float:
    """A number > ``low`` written as text (an environment variable, a command-line value)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value > low):
        raise ConfigError(usage(f"{name}={text!r}", f"a number > {low:g}", hint))
    return value


__all__ = ["ConfigError", "usage", "fraction", "integer", "number", "parse_float", "positive_float", "positive_int"]
