"""`grader.check`: the one line in every notebook test cell.

It runs the lab's official tests (the same ones `pytest labs/NN_name` runs) against the
notebook's live namespace, prints one line per test (what was expected, what came back,
on which input) and raises when any test did not pass, so nbgrader marks the cell.
"""
from __future__ import annotations

from typing import Any, Sequence

from grader.loader import module_from_namespace
from grader.results import PASSED, SKIPPED, TestResult
from grader.runner import run_tests, stderr_to_stdout


class CheckFailed(AssertionError):
    """Some of the checked tests did not pass (the printed list above says which and why)."""


def _format(result: TestResult) -> str:
    mark = {PASSED: "PASS", SKIPPED: "SKIP"}.get(result.status, "FAIL")
    pts = f"{result.max_points:g} pt" + ("" if result.max_points == 1 else "s")
    head = f"[{mark}] {result.name} ({pts})"
    if result.status == PASSED or not result.message:
        return head
    body = "\n".join("       " + line for line in result.message.splitlines())
    return f"{head}\n{body}"


def check(lab: str, namespace: dict[str, Any], tests: Sequence[str] | None = None) -> None:
    """Grades `tests` (default: all of the lab's tests) on the names defined in `namespace`.

    A skipped test (a `gpu`/`perf` test without CUDA) also raises: it earned nothing here.
    """
    __tracebackhide__ = True  # IPython and pytest then show the learner only our message
    if not isinstance(namespace, dict):
        raise ValueError(f"namespace must be a dict such as globals(), got {type(namespace).__name__}")
    module = module_from_namespace(namespace, label=f"lab {lab}")
    with stderr_to_stdout():
        results = run_tests(lab, lambda: module, tests)
    earned = sum(r.points for r in results)
    possible = sum(r.max_points for r in results)
    passed = sum(r.status == PASSED for r in results)
    print(f"{lab}: {passed} of {len(results)} tests passed, {earned:g} of {possible:g} points")
    for result in results:
        print(_format(result))
    not_passed = [r.name for r in results if r.status != PASSED]
    if not_passed:
        raise CheckFailed(f"{len(not_passed)} of {len(results)} tests did not pass: {', '.join(not_passed)}")
