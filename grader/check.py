"""`grader.check`: the one line in every notebook test cell.

It runs the lab's official tests (the same ones `pytest labs/NN_name` runs) against the
notebook's live namespace and prints one line per test: what the cell is worth (its hidden
tests included), what was expected, what came back, on which input, and where in the
learner's cells an exception came from.

Under nbgrader (autograde, Validate: `NBGRADER_EXECUTION` is set) and outside a notebook a
cell with a test that did not pass raises `CheckFailed`, so the cell scores 0. In the learner's
own notebook it only prints: Run All goes on to the next sections, and the report says what
the cell would earn at submission.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from grader.labs import check_lab_name, official_tests
from grader.loader import module_from_namespace
from grader.results import PASSED, SKIPPED, TestResult
from grader.runner import run_tests, stderr_to_stdout
from grader.without_triton import REASON as NO_TRITON
from grader.without_triton import ROUTES, is_triton_skip

NEEDS_GPU = "needs a GPU"


class CheckFailed(AssertionError):
    """Some of the checked tests did not pass (the printed list above says which and why)."""

    def _render_traceback_(self) -> list[str]:
        """IPython shows this instead of a traceback into the grader."""
        return [f"CheckFailed: {self}"]


def _pts(points: float) -> str:
    return f"{points:g} pt" + ("" if points == 1 else "s")


def _needs_gpu(result: TestResult) -> bool:
    return result.status == SKIPPED and "CUDA" in result.message


def _needs_linux(result: TestResult) -> bool:
    """A Triton task on a machine without triton (grader/without_triton.py)."""
    return result.status == SKIPPED and is_triton_skip(result.message)


def _elsewhere(result: TestResult) -> bool:
    """Skipped here for want of a GPU or of triton: gradable on another machine, no fault of the code."""
    return _needs_gpu(result) or _needs_linux(result)


def _format(result: TestResult) -> str:
    if _needs_linux(result):
        return f"[LINUX] {result.name} ({_pts(result.max_points)}): {NO_TRITON}"
    if _needs_gpu(result):
        return (f"[GPU ] {result.name} ({_pts(result.max_points)}): {NEEDS_GPU}: 0 of "
                f"{result.max_points:g} points here")
    mark = {PASSED: "PASS", SKIPPED: "SKIP"}.get(result.status, "FAIL")
    head = f"[{mark}] {result.name} ({_pts(result.max_points)})"
    if result.status == PASSED or not result.message:
        return head
    body = "\n".join("       " + line for line in result.message.splitlines())
    return f"{head}\n{body}"


def _hidden_points(lab: str, checked: Sequence[str]) -> tuple[int, float]:
    """(count, points) of the official tests of the checked tests' tasks that this cell does not run:
    the release hides them, grading at submission runs them."""
    tests = official_tests(lab)
    tasks = {t.task for t in tests if t.name in checked}
    hidden = [t for t in tests if t.task in tasks and t.name not in checked]
    return len(hidden), sum(t.points or 0.0 for t in hidden)


def _in_notebook() -> bool:
    """True in an interactive IPython kernel that nbgrader is not driving."""
    if os.environ.get("NBGRADER_EXECUTION"):
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def check(lab: str, namespace: dict[str, Any], tests: Sequence[str] | None = None,
          raise_on_failure: bool | None = None) -> None:
    """Grades `tests` (default: all of the lab's tests) on the names defined in `namespace`.

    `raise_on_failure`: default True except in a learner's live notebook (see the module doc).
    A GPU-only test skipped on a CPU, or a Triton test where triton is not installed, earns nothing here and
    says so (with where to run it); it raises only under nbgrader.
    """
    __tracebackhide__ = True  # pytest then shows the learner only our message
    if not isinstance(namespace, dict):
        raise ValueError(f"namespace must be a dict such as globals(), got {type(namespace).__name__}")
    check_lab_name(lab)
    module = module_from_namespace(namespace, label=f"lab {lab}")
    with stderr_to_stdout():
        results = run_tests(lab, lambda: module, tests)
    checked = [r.name for r in results]
    num_hidden, hidden_points = _hidden_points(lab, checked)
    earned = sum(r.points for r in results)
    possible = sum(r.max_points for r in results)
    passed = sum(r.status == PASSED for r in results)
    head = f"{lab}: {passed} of {len(results)} tests passed, {earned:g} of {possible:g} points"
    if num_hidden:
        head += (f"; this cell is worth {possible + hidden_points:g}: {num_hidden} hidden "
                 f"test{'s' if num_hidden > 1 else ''} ({_pts(hidden_points)}) run at grading "
                 f"(`pytest labs/{lab}` in a terminal runs them now)")
    print(head)
    for result in results:
        print(_format(result))
    if any(_needs_linux(r) for r in results):
        print(f"-> {NO_TRITON}: {ROUTES}")
    not_passed = [r for r in results if r.status != PASSED]
    elsewhere_only = all(_elsewhere(r) for r in not_passed)
    if raise_on_failure is None:
        raise_on_failure = not _in_notebook() and not (elsewhere_only and not os.environ.get("NBGRADER_EXECUTION"))
    if not not_passed:
        return
    names = ", ".join(r.name for r in not_passed)
    if raise_on_failure:
        raise CheckFailed(f"{len(not_passed)} of {len(results)} tests did not pass: {names}")
    if not elsewhere_only:
        print(f"-> {len(not_passed)} of {len(results)} tests did not pass: at submission this cell earns 0 "
              f"until all of them pass.")
