"""One notebook's grading process: `python -m grader.batch.child --lab NN_name --notebook NB --log L --results R`.

Batch grading (grader/batch/grade.py) starts it: once, trusted, on the lab's solution with the real
kit, whose log is the reference; then, untrusted, on each submission inside its sandbox
(grader/batch/sandbox.py) against the grading kit. It loads the notebook, then runs the lab's
official tests (`--tests`: a comma-separated subset, in that order) with observations recorded
to `--log`, and writes the tests' own outcomes (JSON) to `--results`. `--progress` receives
"loaded" once the notebook is loaded and "start <test>" as each test starts: the parent's
per-test time limit reads it, and when a test hangs or kills the process the parent starts a
new child for the tests left. The parent decides pass or fail from the logs alone; nothing
here is trusted.
"""
from __future__ import annotations

import argparse
import functools
import json
import resource
import sys


class Progress:
    """A pytest plugin: one line per test start, flushed at once."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)

    def mark(self, text: str) -> None:
        self.file.write(text + "\n")
        self.file.flush()

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        self.mark(f"start {nodeid.rsplit('::', 1)[-1]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grader.batch.child")
    parser.add_argument("--lab", required=True)
    parser.add_argument("--notebook", required=True)
    parser.add_argument("--log", required=True, help="observations, one JSON line per test")
    parser.add_argument("--results", required=True, help="the tests' outcomes as JSON")
    parser.add_argument("--tests", default="", help="comma-separated test names (default: all)")
    parser.add_argument("--progress", default="", help="'loaded', then 'start <test>' lines")
    parser.add_argument("--memory-bytes", type=int, default=0, help="RLIMIT_DATA (0: no limit)")
    args = parser.parse_args(argv)
    if args.memory_bytes:
        resource.setrlimit(resource.RLIMIT_DATA, (args.memory_bytes, args.memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    from grader.loader import load_notebook
    from grader.runner import run_tests, stderr_to_stdout

    progress = Progress(args.progress) if args.progress else None
    provider = functools.cache(lambda: load_notebook(args.notebook))
    with stderr_to_stdout():
        try:
            provider()  # before the tests: a crash here is the notebook's, not a test's
        except (OSError, ValueError):
            pass  # not a readable notebook: every test reports it
        if progress is not None:
            progress.mark("loaded")
        tests = [t for t in args.tests.split(",") if t] or None
        results = run_tests(args.lab, provider, tests, observe_to=args.log,
                            plugins=[progress] if progress is not None else [])
    cell_errors = [str(e) for e in provider().__cell_errors__] if provider.cache_info().currsize else []
    with open(args.results, "w") as f:
        json.dump({"results": [r.to_dict() for r in results], "cell_errors": cell_errors}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
