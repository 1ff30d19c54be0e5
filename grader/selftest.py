"""`python -m grader.selftest NN_name`: one lab's tests on its solution, its stub and each planted bug.

Prints one JSON object: {"solution": [results], "stub": [results], "bugs": {name: [results]}}.
The meta-test (tests/test_labs_meta.py) runs it once per lab in a subprocess: one interpreter
start and one engine import per lab, not per variant.
"""
from __future__ import annotations

import functools
import importlib
import json
import sys
import time

from grader.labs import REPO_ROOT, bugs_path, check_lab_name, tests_module_name
from grader.loader import load_notebook
from grader.runner import run_tests, stderr_to_stdout

PER_TEST_TIMEOUT_S = 120  # generous for the solution: a loaded 2-core machine
BUG_TEST_TIMEOUT_S = 20  # a planted bug that loops forever fails its test instead of hanging


def planted_bugs(lab: str) -> list:
    if not bugs_path(lab).is_file():
        return []
    return list(importlib.import_module(f"{tests_module_name(lab)}_bugs").BUGS)


def selftest(lab: str) -> dict:
    check_lab_name(lab)
    solution = REPO_ROOT / "solutions" / lab / f"{lab}.ipynb"
    stub = REPO_ROOT / "labs" / lab / f"{lab}.ipynb"
    args = [f"--timeout={PER_TEST_TIMEOUT_S}"]
    bug_args = [f"--timeout={BUG_TEST_TIMEOUT_S}", "--exitfirst"]  # one failing test is enough to catch a bug

    seconds: dict[str, float] = {}

    def run(variant: str, path, edits=None, pytest_args=args) -> list[dict]:
        start = time.perf_counter()
        provider = functools.cache(lambda: load_notebook(path, edits=edits))
        results = run_tests(lab, provider, pytest_args=pytest_args)
        seconds[variant] = round(time.perf_counter() - start, 2)
        return [r.to_dict() for r in results]

    report = {"solution": run("solution", solution), "stub": run("stub", stub) if stub.is_file() else None,
              "bugs": {}, "seconds": seconds}
    for bug in planted_bugs(lab):
        try:
            results = run(bug.name, solution, bug.edits, bug_args)
            if not any(r["status"] == "failed" and r["max_points"] > 0 for r in results):
                results = run(bug.name, solution, bug.edits, bug_args[:1])  # the first failure was ungraded
            report["bugs"][bug.name] = results
        except ValueError as exc:  # the edit's `old` text is not in the solution any more
            report["bugs"][bug.name] = str(exc)
    return report


if __name__ == "__main__":
    with stderr_to_stdout():
        result = selftest(sys.argv[1])
    sys.stdout.write("\n@@SELFTEST@@" + json.dumps(result) + "\n")
