"""Observations: the one way official tests compare what the learner's code produced.

    expect_equal(actual, expected, message)
    expect_close(actual, expected, message, rtol=..., atol=...)
    expect_raises(exc_type, fn, *args, match=..., message=...)
    expect_prediction(actual, expected, message, rtol=..., atol=...)

Self-grading (no recorder): each compares at once and raises AssertionError with the message,
the expected and the got value (both normalized to plain data, shown as Python literals).
A graded prediction is the exception: its failure says which way and roughly how far the answer
is off, never the expected value, which only the instructor's autograde run prints (its output
is nbgrader's feedback after grading; the solution notebook has it too).

Recording (batch grading and its trusted reference run; grader/plugin.py installs a `Recorder`
per run and marks each test's start and end): each call also appends an observation of the
*actual* value, normalized to JSON at once (a later mutation cannot change it), to the test's
log. The grading kit (grader/batch/kit.py) replaces every expected argument and message with `...`,
never evaluated: then nothing is compared in the learner's process, only recorded, and the
trusted parent compares the log with the reference run's (grader/batch/compare.py).
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable

from grader.delegation import DelegationError

SENTINEL = Ellipsis  # the kit's stand-in for an expected value or a message: record only
KINDS = ("equal", "close", "raises", "prediction")
AUTOGRADE = "autograde"  # NBGRADER_EXECUTION in the instructor's autograde run (not in Validate)


# ---- normalized values -------------------------------------------------------------------------

def normalize(value: Any) -> Any:
    """`value` as JSON-safe plain data: what is compared, recorded and shown.

    Lists and tuples become lists; dicts {"$dict": [[key, value], ...]} sorted; sets {"$set": [...]};
    non-finite floats {"$float": "nan"}; tensors and arrays {"$tensor": {dtype, shape, values}};
    enums {"$enum": "RequestStatus.RUNNING"}; dataclasses {"$object": name, "fields": {...}};
    anything else {"$type": name, "$repr": repr}. Subclasses of int, str, list ... lose their class.
    """
    if value is None or isinstance(value, bool):
        return None if value is None else bool(value)
    if isinstance(value, enum.Enum):
        return {"$enum": f"{type(value).__name__}.{value.name}"}
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, float):
        f = float.__float__(value)
        return f if math.isfinite(f) else {"$float": repr(f)}
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (list, tuple)):
        return [normalize(v) for v in value]
    if isinstance(value, dict):
        pairs = [[normalize(k), normalize(v)] for k, v in value.items()]
        return {"$dict": sorted(pairs, key=lambda kv: json.dumps(kv[0], sort_keys=True))}
    if isinstance(value, (set, frozenset)):
        return {"$set": sorted((normalize(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))}
    if hasattr(value, "tolist") and hasattr(value, "shape") and hasattr(value, "dtype"):  # torch / numpy
        values = value.tolist()
        return {"$tensor": {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
                            "values": normalize(values)}} if isinstance(values, list) else normalize(values)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: normalize(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"$object": type(value).__name__, "fields": fields}
    return {"$type": type(value).__qualname__, "$repr": repr(value)[:300]}


def same(a: Any, b: Any) -> bool:
    """Equality of normalized values: bools are not numbers, 1 == 1.0, structures element by element."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _numbers(value: Any) -> tuple[list[int], list[float]] | None:
    """(shape, flat values) of a normalized number, tensor or nested list of numbers; None otherwise."""
    if isinstance(value, dict) and "$tensor" in value:
        return _numbers(value["$tensor"]["values"]) if value["$tensor"]["shape"] else None
    if isinstance(value, dict) and "$float" in value:
        return [], [float(value["$float"])]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [], [float(value)]
    if isinstance(value, list):
        parts = [_numbers(v) for v in value]
        if any(p is None for p in parts) or len({tuple(p[0]) for p in parts}) > 1:
            return None
        inner = parts[0][0] if parts else []
        return [len(value), *inner], [x for p in parts for x in p[1]]
    return None


def index_in(flat: int, shape: list[int]) -> str:
    """The index of element `flat` in a row-major `shape`, as a learner writes it: [3] or [1, 2]."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size) if size else (flat, 0)
        index.append(i)
    return "[" + ", ".join(str(i) for i in reversed(index)) + "]"


def close(actual: Any, expected: Any, rtol: float, atol: float) -> tuple[bool, str]:
    """(close?, where not): same shape and |a - e| <= atol + rtol * |e| everywhere (NaN is never close)."""
    got, want = _numbers(actual), _numbers(expected)
    if got is None or want is None:
        return False, "not numbers"
    if got[0] != want[0]:
        return False, f"shape {got[0]}, expected shape {want[0]}"
    for i, (a, e) in enumerate(zip(got[1], want[1])):
        if not abs(a - e) <= atol + rtol * abs(e):
            where = f"element {index_in(i, want[0])} of shape {want[0]}: " if want[0] else ""
            return False, f"{where}{a!r}, expected {e!r}, |difference| {abs(a - e):.3g} > {atol + rtol * abs(e):.3g}"
    return True, ""


# ---- predictions: which way, never the value -----------------------------------------------------

def prediction_ok(actual: Any, expected: Any, rtol: float, atol: float) -> bool:
    """Numbers (or lists of them) within the tolerance; anything else (names, tuples of names) equal."""
    return close(actual, expected, rtol, atol)[0] if _numbers(expected) is not None else same(actual, expected)


def how_far(a: float, e: float) -> str:
    """Which way `a` misses `e` and a band of how far, never `e`: "too low by more than 10%"."""
    if not math.isfinite(a):
        return "not a finite number"
    if a == e:
        return "right"
    way = "too high" if a > e else "too low"
    if e == 0:
        return way
    if a != 0 and (a > 0) != (e > 0):
        return "the wrong sign"
    off = abs(a - e) / abs(e)
    ratio = abs(a / e)
    if ratio >= 10 or ratio <= 0.1:
        return f"{way} by more than a factor 10"
    if ratio >= 2 or ratio <= 0.5:
        return f"{way} by more than a factor 2"
    return f"{way} by {'more than 10%' if off > 0.1 else 'less than 10%'}"


def _tolerance(rtol: float, atol: float) -> str:
    parts = ([f"{rtol * 100:.3g}%"] if rtol else []) + ([f"+-{atol:g}"] if atol else [])
    return "passes when exact" if not parts else "passes within " + " + ".join(parts)


def prediction_hint(actual: Any, expected: Any, rtol: float, atol: float) -> str:
    """Where a prediction misses, element by element, without the expected value."""
    got, want = _numbers(actual), _numbers(expected)
    if want is not None:
        if got is None:
            return "not a number (or a list of numbers) as asked"
        if got[0] != want[0]:
            return f"shape {got[0]}, the question asks for shape {want[0]}"
        misses = [(i, how_far(a, e)) for i, (a, e) in enumerate(zip(got[1], want[1]))
                  if not abs(a - e) <= atol + rtol * abs(e)]
        tol = _tolerance(rtol, atol)
        if not want[0]:
            return f"{misses[0][1]} ({tol})"
        return "; ".join(f"element {index_in(i, want[0])}: {far}" for i, far in misses) + f" ({tol} each)"
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        return "; ".join(f"element [{i}]: {'right' if same(a, e) else 'wrong'}"
                         for i, (a, e) in enumerate(zip(actual, expected)))
    if isinstance(expected, list) and isinstance(actual, list):
        return f"{len(actual)} items, the question asks for {len(expected)}"
    return "not the answer"


def explain_prediction(message: str, expected: Any, got: Any, rtol: float, atol: float) -> str:
    """A prediction's failure text: the question, your answer, which way it is off. The expected value only
    in the instructor's autograde run, whose output nbgrader hands back as feedback after grading."""
    text = (f"{message}\n  got:      {render(got)}\n  {prediction_hint(got, expected, rtol, atol)}; the expected "
            f"value is not shown before grading")
    if os.environ.get("NBGRADER_EXECUTION") == AUTOGRADE:
        text += f"\n  expected: {render(expected)} (nbgrader feedback)"
    return text


# ---- showing values ----------------------------------------------------------------------------

def render(value: Any, limit: int = 600) -> str:
    """A normalized value as a short Python-like literal."""
    text = _render(value)
    return text if len(text) <= limit else text[:limit] + " ..."


def _render(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_render(x) for x in v) + "]"
    if isinstance(v, dict):
        if "$dict" in v:
            return "{" + ", ".join(f"{_render(k)}: {_render(x)}" for k, x in v["$dict"]) + "}"
        if "$set" in v:
            return "{" + ", ".join(_render(x) for x in v["$set"]) + "}" if v["$set"] else "set()"
        if "$float" in v:
            return v["$float"]
        if "$enum" in v:
            return v["$enum"]
        if "$tensor" in v:
            t = v["$tensor"]
            return f"tensor({_render(t['values'])}, dtype={t['dtype']}, shape={t['shape']})"
        if "$object" in v:
            return f"{v['$object']}(" + ", ".join(f"{k}={_render(x)}" for k, x in v["fields"].items()) + ")"
        if "$type" in v:
            return v["$repr"]
        if "raised" in v:
            return (f"returned {_render(v.get('returned'))}" if v["raised"] is None
                    else f"raised {v['raised'][0].removeprefix('builtins.')}: {v['text']}")
        if "exc" in v:
            return f"raises {v['exc'].removeprefix('builtins.')}" + (f" matching {v['match']!r}" if v["match"] else "")
    return repr(v)


def _difference(expected: Any, got: Any, path: str = "") -> str | None:
    """The path to where two normalized values first differ, and what is there: a list index, a dict key,
    an object's field ("['b'][1]: 2 instead of 3"); None where they are equal or differ as a whole."""
    if isinstance(expected, list) and isinstance(got, list):
        for i, (e, g) in enumerate(zip(expected, got)):
            if not same(e, g):
                return _difference(e, g, f"{path}[{i}]") or f"{path}[{i}]: {_render(g)} instead of {_render(e)}"
        if len(expected) != len(got):
            return f"{path or 'the list'}: {len(got)} items instead of {len(expected)}"
        return None
    keyed = [("key" if "$dict" in v else "field" if "$object" in v else None) if isinstance(v, dict) else None
             for v in (expected, got)]
    if keyed[0] is None or keyed[0] != keyed[1]:
        return None
    want, have = ((dict((_render(k), v) for k, v in d["$dict"]) if "$dict" in d else
                   {f".{k}": v for k, v in d["fields"].items()}) for d in (expected, got))
    missing, extra = [k for k in want if k not in have], [k for k in have if k not in want]
    if missing or extra:
        return f"{path or 'the ' + keyed[0] + 's'}: missing {', '.join(missing) or 'none'}; unexpected " \
               f"{', '.join(extra) or 'none'}"
    for k in want:
        if not same(want[k], have[k]):
            step = k if keyed[0] == "field" else f"[{k}]"
            return _difference(want[k], have[k], path + step) or \
                f"{path}{step}: {_render(have[k])} instead of {_render(want[k])}"
    return None


def _first_difference(expected: Any, got: Any) -> str:
    where = _difference(expected, got)
    if where and re.match(r"\[\d+\]:", where):  # a flat list: "index 2", as a learner says it
        where = "index " + where[1:].replace("]", "", 1)
    return f" (first difference at {where})" if where else ""


def explain(message: str, expected: Any, got: Any, detail: str = "") -> str:
    """The failure text: what was checked on which input, then expected and got (Triton-Puzzles style)."""
    return (f"{message}\n  expected: {render(expected)}\n  got:      {render(got)}"
            + (f"\n  ({detail})" if detail else _first_difference(expected, got)))


def raises_ok(spec: dict, actual: dict) -> bool:
    """An expected raise {"exc", "match"} against an observed outcome {"raised": [class names], "text"}."""
    raised = actual.get("raised") if isinstance(actual, dict) else None
    if not isinstance(raised, list) or spec["exc"] not in raised:
        return False
    return spec["match"] is None or re.search(spec["match"], str(actual.get("text", ""))) is not None


# ---- the per-test log --------------------------------------------------------------------------

class Recorder:
    """Appends one JSON line per test to `path`: {"test", "observations", "completed", "error"}."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.test: str | None = None
        self.observations: list[dict] = []

    def start(self, test: str) -> None:
        self.test, self.observations = test, []

    def add(self, observation: dict) -> None:
        if self.test is not None:
            self.observations.append(observation)

    def finish(self, completed: bool, error: str = "") -> None:
        if self.test is None:
            return
        line = json.dumps({"test": self.test, "observations": self.observations, "completed": completed,
                           "error": error[:2000]})
        with open(self.path, "a") as f:
            f.write(line + "\n")
        self.test, self.observations = None, []


_recorder: Recorder | None = None


def set_recorder(recorder: Recorder | None) -> None:
    global _recorder
    _recorder = recorder


def recorder() -> Recorder | None:
    return _recorder


def _observe(kind: str, actual: Any, expected: Any, message: Any, **extra: Any) -> None:
    if _recorder is None:
        return
    entry = {"kind": kind, "line": sys._getframe(2).f_lineno, "actual": actual}
    if expected is not SENTINEL:  # a trusted run: keep what the parent compares against and shows
        entry.update(expected=expected, message=str(message), **extra)
    _recorder.add(entry)


# ---- the three checks --------------------------------------------------------------------------

def expect_equal(actual: Any, expected: Any, message: str) -> None:
    """`actual` equals `expected` once both are normalized (see `normalize`, `same`)."""
    __tracebackhide__ = True
    got = normalize(actual)
    want = expected if expected is SENTINEL else normalize(expected)
    _observe("equal", got, want, message)
    if want is not SENTINEL and not same(got, want):
        raise AssertionError(explain(message, want, got))


def expect_close(actual: Any, expected: Any, message: str, *, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Numbers, nested lists of numbers or tensors of one shape with |a - e| <= atol + rtol * |e|."""
    __tracebackhide__ = True
    got = normalize(actual)
    want = expected if expected is SENTINEL else normalize(expected)
    _observe("close", got, want, message, rtol=rtol, atol=atol)
    if want is not SENTINEL:
        ok, where = close(got, want, rtol, atol)
        if not ok:
            raise AssertionError(explain(message, want, got, f"rtol={rtol:g}, atol={atol:g}: {where}"))


def expect_prediction(actual: Any, expected: Any, message: str, *, rtol: float = 0.0, atol: float = 0.0) -> None:
    """A graded prediction: numbers within |a - e| <= atol + rtol * |e| (see `close`), anything else equal.

    Its failure says which way and roughly how far (`prediction_hint`), never `expected`: a printed answer
    would be pasted in, and the prediction would stop being one. `message` states the question with its
    units; the tolerance is appended."""
    __tracebackhide__ = True
    got = normalize(actual)
    want = expected if expected is SENTINEL else normalize(expected)
    _observe("prediction", got, want, message, rtol=rtol, atol=atol)
    if want is not SENTINEL and not prediction_ok(got, want, rtol, atol):
        raise AssertionError(explain_prediction(message, want, got, rtol, atol))


def expect_raises(exc_type: type[BaseException], fn: Callable, *args: Any, match: str | None = None,
                  message: str) -> BaseException | None:
    """`fn(*args)` raises `exc_type` (or a subclass) whose text matches the regex `match`.

    Observed: the raised classes (module.qualname, most derived first) and text, or the returned value.
    Returns the exception, or None when nothing was raised.
    """
    __tracebackhide__ = True
    try:
        returned = fn(*args)
    except (DelegationError, KeyboardInterrupt):
        raise
    except BaseException as exc:  # noqa: BLE001 - any raise is an observation
        raised: BaseException | None = exc
        got = {"raised": [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__], "text": str(exc)[:1000]}
    else:
        raised = None
        got = {"raised": None, "returned": normalize(returned)}
    if exc_type is SENTINEL:
        _observe("raises", got, SENTINEL, message)
        return raised
    spec = {"exc": f"{exc_type.__module__}.{exc_type.__qualname__}", "match": match}
    _observe("raises", got, spec, message)
    if not raises_ok(spec, got):
        raise AssertionError(explain(message, spec, got))
    return raised
