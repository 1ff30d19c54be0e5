"""One notebook's grading process: `python -m grader.child --lab NN_name --notebook NB --log L --results R`.

Batch grading (grader/batch.py) starts it twice over: once, trusted, on the lab's solution with
the real kit, whose log is the reference; then, untrusted, on each submission inside the grading
kit, with a memory limit. It runs the lab's official tests with observations recorded to `--log`
and writes the tests' own outcomes (JSON) to `--results`. The parent decides pass or fail from
the logs alone; the outcomes only explain failures (an exception, delegation, a cell error).
"""
from __future__ import annotations

import argparse
import functools
import json
import resource
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grader.child")
    parser.add_argument("--lab", required=True)
    parser.add_argument("--notebook", required=True)
    parser.add_argument("--log", required=True, help="observations, one JSON line per test")
    parser.add_argument("--results", required=True, help="the tests' outcomes as JSON")
    parser.add_argument("--memory-bytes", type=int, default=0, help="RLIMIT_DATA (0: no limit)")
    args = parser.parse_args(argv)
    if args.memory_bytes:
        resource.setrlimit(resource.RLIMIT_DATA, (args.memory_bytes, args.memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    from grader.loader import load_notebook
    from grader.runner import run_tests, stderr_to_stdout

    provider = functools.cache(lambda: load_notebook(args.notebook))
    with stderr_to_stdout():
        results = run_tests(args.lab, provider, observe_to=args.log)
    cell_errors = [str(e) for e in provider().__cell_errors__] if provider.cache_info().currsize else []
    with open(args.results, "w") as f:
        json.dump({"results": [r.to_dict() for r in results], "cell_errors": cell_errors}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
