"""One submission's grading process, started by `python -m grader batch` (grader/batch.py).

It limits its own memory first, reads a one-time key from stdin, runs the lab's official
tests on the notebook, and writes the results signed with that key, together with any
grader or pytest function the learner's code replaced while the tests ran.
"""
from __future__ import annotations

import argparse
import functools
import json
import resource
import sys


class Guard:
    """Compares the guarded functions before the learner's code loads and after the last test."""

    def __init__(self) -> None:
        self.before: dict[str, int] = {}
        self.changed: list[str] = []

    def pytest_collection_finish(self, session) -> None:
        from grader.integrity import snapshot

        self.before = snapshot()

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        from grader.integrity import changed_callables, snapshot

        self.changed = changed_callables(self.before, snapshot())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grader.child")
    parser.add_argument("--lab", required=True)
    parser.add_argument("--notebook", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--memory-bytes", type=int, required=True)
    args = parser.parse_args(argv)
    resource.setrlimit(resource.RLIMIT_DATA, (args.memory_bytes, args.memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    key = bytes.fromhex(sys.stdin.readline().strip())
    sys.stdin.close()

    from grader.integrity import sign
    from grader.loader import load_notebook
    from grader.runner import run_tests, stderr_to_stdout

    guard = Guard()
    provider = functools.cache(lambda: load_notebook(args.notebook))
    with stderr_to_stdout():
        results = run_tests(args.lab, provider, plugins=[guard])
    cell_errors = [str(e) for e in provider().__cell_errors__] if provider.cache_info().currsize else []
    payload = json.dumps({"results": [r.to_dict() for r in results], "tampered": guard.changed,
                          "cell_errors": cell_errors})
    with open(args.result, "w") as f:
        f.write(payload + "\n" + sign(key, payload) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
