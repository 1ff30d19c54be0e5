"""Typed checks for user arguments: one set of rules for every boundary (engine arguments, sampling
parameters, request arguments, config.json fields).

The rules: a bool is not an int (`True` is not a block size), a string is not a number (`"0.5"` is
not a temperature), NaN and the infinities are not values. numpy scalars are accepted and
returned as Python numbers. Every check returns the normalised value or raises ValueError naming
the parameter, the allowed values and what came (its repr and type).
"""
from __future__ import annotations

import math
import numbers
import reprlib
from typing import Any, Iterable, NoReturn

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 40
_repr.maxlist = _repr.maxtuple = 8

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


def describe(value: Any) -> str:
    """A short repr plus the type: `'0.5' (str)`, `[1, 2, ...] (list)`."""
    return f"{_repr.repr(value)} ({type(value).__name__})"


def fail(name: str, allowed: str, value: Any, hint: str = "") -> NoReturn:
    raise ValueError(f"{name} must be {allowed}{f' ({hint})' if hint else ''}, got {describe(value)}")


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _range_text(kind: str, lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    lo_s, hi_s = (f"{x:g}" if isinstance(x, float) else str(x) for x in (lo, hi))
    if lo is not None and hi is not None:
        return f"{kind} in {'(' if lo_open else '['}{lo_s}, {hi_s}]"
    if lo is not None:
        return f"{kind} {'>' if lo_open else '>='} {lo_s}"
    return kind if hi is None else f"{kind} <= {hi_s}"


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None, *,
              optional: bool = False, hint: str = "") -> Any:
    """An int (not a bool) in [lo, hi]; None too when `optional`. `hint` says what values mean."""
    if optional and value is None:
        return None
    if not is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        fail(name, ("None or " if optional else "") + _range_text("an int", lo, hi), value, hint)
    return int(value)


def check_real(name: str, value: Any, lo: float | None = None, hi: float | None = None, *,
               lo_open: bool = False, optional: bool = False, hint: str = "") -> Any:
    """A finite number (int or float, not a bool or a string) in [lo, hi], or (lo, hi] when `lo_open`."""
    if optional and value is None:
        return None
    ok = is_real(value) and math.isfinite(value) and (
        lo is None or (value > lo if lo_open else value >= lo)) and (hi is None or value <= hi)
    if not ok:
        fail(name, ("None or " if optional else "") + _range_text("a finite number", lo, hi, lo_open), value, hint)
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    """True or False: not "no", not 0 (a typo'd string would otherwise be truthy)."""
    if not isinstance(value, bool):
        fail(name, "True or False", value)
    return value


def check_choice(name: str, value: Any, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        fail(name, f"one of {choices}", value)
    return value


def check_int_list(name: str, value: Any, lo: int | None = None) -> list[int]:
    """A list or tuple of ints >= lo (a str or bytes is not a list of ids)."""
    if not isinstance(value, (list, tuple)):
        fail(name, f"a list of {_range_text('ints', lo, None)}", value)
    if all(type(t) is int for t in value) and (lo is None or not value or min(value) >= lo):
        return list(value)  # the common case, fast: plain ints (a bool's type is bool, not int)
    return [check_int(f"{name}[{i}]", item, lo) for i, item in enumerate(value)]
