"""Starts the labs' selftests (tests/labs/test_labs_meta.py) as soon as collection is done, for the labs
whose `selftest`-marked tests are selected: they then run beside the rest of the suite instead of after it.

Under pytest-xdist (`make test` runs `-n 2 --dist loadfile --no-loadscope-reorder`: whole files, in
the order below) every worker collects the same tests;
the first worker (gw0) runs the selftests and leaves each outcome in a folder named after the run,
where the worker that got tests/labs/test_labs_meta.py reads it, and gw0 stays until the last one is written.
The long serial files go first and the meta tests last (`FIRST`). Without CUDA it also picks Triton's
interpreter for the whole run, before anything imports triton.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import Future, wait
from pathlib import Path

import pytest
import torch

from grader.without_triton import REASON as NO_TRITON
from grader.without_triton import ROUTES, triton_installed

# Triton's interpreter must be chosen before `kernels.triton.*` is first imported (the kernels are
# decorated then), and any test folder may import it first: the kernel tests, the labs' kernel tasks, the
# engine with backend="triton". On a CUDA machine it is left alone: the tests want compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

META = "tests/labs/test_labs_meta.py"
# Files whose time is mostly one long serial chain (a JupyterLab and a browser, nbgrader executing
# notebooks, a sandboxed class): started first, so the other worker fills in around them. The meta
# tests wait for the selftests, so they come last.
FIRST = ("tests/grader/test_grader_browser.py", "tests/grader/test_grader_nbgrader.py", "tests/adversarial/test_adversarial_class.py",
         "tests/grader/test_grader_batch.py", "tests/grader/test_grader_check_notebook.py", "tests/entrypoints/test_openai_server.py",
         "tests/entrypoints/test_router.py")
_running: list[Future] = []


def _folder(testrunuid: str) -> Path:
    return Path(tempfile.gettempdir()) / f"inference-labs-selftests-{testrunuid}"


def _no_triton(exc: BaseException | None) -> bool:
    """An error that only says triton is not installed here (a Mac: triton publishes Linux wheels only)."""
    return isinstance(exc, ModuleNotFoundError) and exc.name == "triton" and not triton_installed()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A test that needs triton where it is not installed skips with the reason, as the labs' Triton tasks do."""
    try:
        return (yield)
    except ModuleNotFoundError as exc:
        if _no_triton(exc):
            pytest.skip(f"{NO_TRITON} ({ROUTES})")
        raise


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    """A test file that imports triton where it is not installed: skipped with the reason, not an error."""
    report = yield
    said = str(report.longrepr) if report.failed else ""
    if ("No module named 'triton'" in said or "needs triton, which publishes Linux wheels only" in said) \
            and not triton_installed():
        report.outcome = "skipped"
        report.longrepr = (str(collector.path), 0, f"Skipped: {NO_TRITON} ({ROUTES})")
    return report


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return FIRST.index(path) if path in FIRST else len(FIRST) + (path == META)
    items.sort(key=rank)  # stable: the order within a file and among the rest stays


def pytest_collection_finish(session: pytest.Session) -> None:
    items = [item for item in session.items if item.nodeid.startswith(META)]
    if not items:
        return
    meta = items[0].module
    labs = {item.callspec.params["lab"] for item in items if item.get_closest_marker("selftest")}
    workerinput = getattr(session.config, "workerinput", None)  # set in a pytest-xdist worker
    if workerinput is not None:
        meta.share_results_in(_folder(workerinput["testrunuid"]))
        if workerinput["workerid"] != "gw0":
            return
    _running.extend(meta.start_selftests(sorted(labs)))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """gw0 stays until every selftest it started has written its outcome."""
    if _running:
        wait(_running)


_workers_up: set[str] = set()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    _workers_up.add(node.workerinput["workerid"])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """The controller removes the shared folder once the last worker is gone."""
    _workers_up.discard(node.workerinput["workerid"])
    if not _workers_up:
        shutil.rmtree(_folder(node.workerinput["testrunuid"]), ignore_errors=True)
