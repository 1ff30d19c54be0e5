"""Runs a lab's official tests in this process against a given `student` module.

The one engine behind `grader.check` (a live notebook namespace), batch grading (a
submission's notebook, inside its own child process) and the meta-test (solution, stub
and planted-bug variants). pytest's own terminal output is swallowed; results come back
as `TestResult`s.
"""
from __future__ import annotations

import ast
import contextlib
import io
import os
import sys
from types import ModuleType
from typing import Callable, Iterator, Sequence

import pytest

import grader.plugin as plugin
from grader.labs import check_lab_name, tests_path
from grader.results import TestResult


# Plugins lab tests never need, skipped to start faster (hypothesis itself still works without its plugin).
QUIET_PLUGINS = ("-p", "no:hypothesispytest", "-p", "no:anyio", "-p", "no:platformdirs")


def test_names(lab: str) -> list[str]:
    """The official test functions of a lab, in file order.

    Read from the source, not by importing it: the module must first be imported by pytest,
    whose assertion rewriting gives the "assert 1 == 2 where 1 = f(17)" explanations.
    """
    tree = ast.parse(tests_path(check_lab_name(lab)).read_text())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


test_names.__test__ = False  # a helper, not a test


@contextlib.contextmanager
def stderr_to_stdout() -> Iterator[None]:
    """Sends stderr (Python and file descriptor 2) to stdout while grading.

    nbgrader zeroes a test cell that wrote anything to stderr, and torch writes warnings
    there; a correct cell must not lose its points to a warning.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved = None
    try:
        saved = os.dup(2)
        os.dup2(1, 2)
    except OSError:  # no real descriptors (an embedded interpreter): Python-level only
        saved = None
    try:
        with contextlib.redirect_stderr(sys.stdout):
            yield
    finally:
        sys.stdout.flush()
        if saved is not None:
            os.dup2(saved, 2)
            os.close(saved)


class _Provide:
    """Puts the student module into the session before any test asks for it."""

    def __init__(self, provider: Callable[[], ModuleType]) -> None:
        self.provider = provider
        self.config: pytest.Config | None = None

    def pytest_configure(self, config: pytest.Config) -> None:
        config.stash[plugin.STUDENT_PROVIDER] = self.provider
        config.stash[plugin.RESULTS] = {}
        self.config = config


def run_tests(
    lab: str,
    provider: Callable[[], ModuleType],
    tests: Sequence[str] | None = None,
    pytest_args: Sequence[str] = (),
    plugins: Sequence[object] = (),
    observe_to: str | os.PathLike[str] | None = None,
) -> list[TestResult]:
    """Runs `tests` (default: all) of `lab`; `provider()` returns the student module.

    `provider` is called by every test that uses the `student` fixture, after collection:
    cache it when the module should be built once. `observe_to`: a file that receives each
    test's observations (grader/observe.py), as batch grading needs.
    """
    check_lab_name(lab)
    names = test_names(lab)
    if tests is not None:
        if isinstance(tests, str) or not all(isinstance(t, str) for t in tests):
            raise ValueError(f"tests must be a list of test names from {names}, got {tests!r}")
        unknown = [t for t in tests if t not in names]
        if unknown:
            raise ValueError(f"tests: {unknown} are not tests of lab {lab}; its tests are {names}")
    selected = names if tests is None else list(dict.fromkeys(tests))
    path = str(tests_path(lab))
    args = [f"{path}::{name}" for name in selected]
    args += ["-q", "-p", "no:cacheprovider", "--capture=sys", "-o", "addopts=", *QUIET_PLUGINS, *pytest_args]
    provide = _Provide(provider)
    if observe_to is not None:
        plugins = [*plugins, plugin.Observing(observe_to)]
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        code = pytest.main(args, plugins=[plugin, provide, *plugins])
    results = list(provide.config.stash[plugin.RESULTS].values()) if provide.config is not None else []
    incomplete = code == pytest.ExitCode.OK and len(results) < len(selected)  # (--exitfirst stops early on failure)
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED) or incomplete:
        raise RuntimeError(f"pytest could not run the tests of lab {lab} (exit {code}):\n{sink.getvalue()}")
    return results
