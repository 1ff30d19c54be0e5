"""Catching a submission that runs the engine's own implementation of the piece it is graded on.

Three ways a learner's function can reach the answer key, and what catches each in the
learner's own process (self-grading: `pytest labs/NN`, `grader.check`):

- a captured attribute, an import, `__wrapped__`: while a lab is plugged (grader/plug.py) the
  engine's function objects of that lab's seams and helpers run a *tripwire* instead of their
  code (`arm`), so any reference to them, however obtained, raises `DelegationError`;
- reading or exec-ing the engine's source, rebuilding a function from its `__code__`: the graded
  cells' source is scanned for those tools (`scan_source`);
- everything else (a learner who copies the source file's text by hand into a string ...): only
  batch grading catches it, whose kit has the lab's seam bodies removed (grader/batch/kit.py).

Anything here can be undone by code in the same process; batch grading does not rely on it.
"""
from __future__ import annotations

import ast
import functools
import inspect
import sys
import types
from dataclasses import dataclass, field
from typing import Any

VERDICT = "uses the reference implementation"
KIT_REMOVED = "removed from the grading kit"
SCORES_ZERO = ("A submission that runs the engine's own implementation of a piece it is graded on scores 0 "
               "for that test: write the piece yourself.")


class DelegationError(Exception):
    """The learner's code ran (or could load) the engine's own implementation of a graded piece."""


@dataclass
class _Armed:
    """One tripwired engine object and what to put back."""

    obj: Any
    saved: Any  # the original __code__ (functions) or __class__ (kernels)
    is_code: bool


@dataclass
class Tripwires:
    """The armed objects of one plug, and every trip seen while armed (even if the learner caught it)."""

    armed: list[_Armed] = field(default_factory=list)
    trips: list[str] = field(default_factory=list)


_ACTIVE: list[Tripwires] = []


def tripped(description: str) -> DelegationError:
    """Called by a tripwire's code: records the trip and returns the error it raises."""
    caller = sys._getframe(2)  # 0: here, 1: the tripwire, 2: whoever called the engine's function
    where = f"{caller.f_code.co_filename}, line {caller.f_lineno}"
    message = f"{VERDICT}: {description}, called from {where}. {SCORES_ZERO}"
    for wires in _ACTIVE:
        wires.trips.append(message)
    return DelegationError(message)


def _tripwire_code(func: types.FunctionType, description: str) -> types.CodeType:
    """A code object that raises `tripped(description)`, with the free variables `func` needs."""
    freevars = func.__code__.co_freevars
    inner = ("    def _tripwire(*args, **kwargs):\n"
             + "".join(f"        {name}\n" for name in freevars)
             + f"        raise __import__('grader.delegation', fromlist=['tripped']).tripped({description!r})\n")
    outer = "def _outer():\n" + "".join(f"    {name} = None\n" for name in freevars) + inner + "    return _tripwire\n"
    namespace: dict[str, Any] = {}
    exec(compile(outer, "<tripwire>", "exec"), namespace)
    return namespace["_outer"]().__code__


def _tripwired_class(cls: type, description: str) -> type:
    """A subclass of a Triton kernel's class whose launch raises (a kernel has no __code__ to swap)."""
    def launch(self, *args, **kwargs):
        raise tripped(description)

    return type(f"Tripwired{cls.__name__}", (cls,), {"__getitem__": launch, "run": launch, "__call__": launch})


def arm(wires: Tripwires, obj: Any, description: str) -> None:
    """Makes `obj` (an engine function or Triton kernel) raise DelegationError until `disarm`."""
    target = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    if isinstance(target, types.FunctionType):
        wires.armed.append(_Armed(target, target.__code__, True))
        target.__code__ = _tripwire_code(target, description)
    elif hasattr(target, "fn") and hasattr(target, "run"):  # a @triton.jit kernel
        wires.armed.append(_Armed(target, target.__class__, False))
        target.__class__ = _tripwired_class(target.__class__, description)
    else:
        raise TypeError(f"cannot tripwire {description}: {type(target).__name__} is neither a function nor a kernel")


def disarm(wires: Tripwires) -> None:
    for item in reversed(wires.armed):
        if item.is_code:
            item.obj.__code__ = item.saved
        else:
            item.obj.__class__ = item.saved
    wires.armed.clear()


def activate(wires: Tripwires) -> None:
    _ACTIVE.append(wires)


def deactivate(wires: Tripwires) -> None:
    if wires in _ACTIVE:
        _ACTIVE.remove(wires)


# ---- the graded cells' source -------------------------------------------------------------------

# Tools that read, load or rebuild code: a graded cell has no use for them but to get at the engine's.
FORBIDDEN_NAMES = frozenset({
    "exec", "eval", "compile", "open", "__import__", "reload", "import_module", "getsource", "getsourcelines",
    "getsourcefile", "getfile", "findsource", "FunctionType", "CodeType", "read_text", "read_bytes",
    "run_path", "run_module", "__code__", "__wrapped__", "__globals__", "__closure__", "__func__", "__file__",
    "__loader__", "__spec__", "__builtins__", "popen", "system",
})
FORBIDDEN_MODULES = frozenset({"inspect", "linecache", "runpy", "marshal", "importlib", "dis", "pathlib", "io",
                               "codecs", "gc", "ctypes", "subprocess", "shutil"})


def _used_names(tree: ast.AST) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            found.append((node.id, node.lineno))
        elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_NAMES:
            found.append((f".{node.attr}", node.lineno))
        elif isinstance(node, ast.Import):
            found += [(f"import {a.name}", node.lineno) for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
            found.append((f"from {node.module} import ...", node.lineno))
    return found


def scan_source(sources: dict[str, str]) -> list[str]:
    """`where: what` for each use of a code-loading tool in the graded cells ({label: source})."""
    return list(_scan(tuple(sources.items())))


@functools.lru_cache(maxsize=64)
def _scan(sources: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    findings = []
    for label, source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue  # the loader reports it as the cell's error
        findings += [f"{label}, line {line}: `{what}`" for what, line in _used_names(tree)]
    return tuple(findings)


def sources_of(student: Any) -> dict[str, str]:
    """The graded cells' source: what the loader kept, or the source of a live namespace's functions."""
    kept = getattr(student, "__sources__", None)
    if kept:
        return dict(kept)
    found = {}
    for name, value in vars(student).items():
        # only what the notebook itself defined (Jupyter's and a script's module is __main__), not imports
        if isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) in (None, "__main__"):
            try:
                found[f"`{name}` ({inspect.getsourcefile(value)})"] = inspect.getsource(value)
            except (OSError, TypeError):
                continue
    return found


def source_verdict(student: Any) -> str | None:
    """The DelegationError message for graded cells that load code, or None when they do not."""
    findings = scan_source(sources_of(student))
    if not findings:
        return None
    return (f"{VERDICT}: your graded cells use tools that read, load or rebuild code ({'; '.join(findings[:5])}), "
            f"which could load the engine's own implementation. {SCORES_ZERO}")


def is_learner_frame(frame: types.FrameType) -> bool:
    """True for code of the learner's notebook (the loader names its cells "cell N of <notebook>")."""
    return frame.f_code.co_filename.startswith("cell ")


def kit_removed(seam: str) -> BaseException:
    """Raised by a seam body the grading kit removed: delegation when the learner's code called it,
    a kit error when only grader or engine code did (a test that reaches an unplugged seam)."""
    frame = sys._getframe(2)  # 0: here, 1: the removed body, 2: its caller
    caller = f"{frame.f_code.co_filename}, line {frame.f_lineno}"
    while frame is not None:
        if is_learner_frame(frame):
            message = f"{VERDICT}: {seam} ({KIT_REMOVED}), called from {caller}. {SCORES_ZERO}"
            for wires in _ACTIVE:
                wires.trips.append(message)
            return DelegationError(message)
        frame = frame.f_back
    return RuntimeError(f"{KIT_REMOVED}: {seam} was reached from {caller} by grading code alone: a grader "
                        f"bug, tell the instructor")


def is_delegation(message: str) -> bool:
    """True for a failure message that reports delegation (a tripwire, the scan, a kit's removed body)."""
    return message.startswith(VERDICT) or f"DelegationError: {VERDICT}" in message
