"""The pytest plugin behind `pytest labs/NN_name`, `pytest solutions/NN_name` and `grader.check`.

- A notebook `NN_name/NN_name.ipynb` collects as the lab's official tests
  (`grader/labtests/labNN_name.py`, never a copy next to the notebook), with node ids
  `labs/NN_name/NN_name.ipynb::test_x`.
- The `student` fixture is the module built from that notebook's graded cells (or the
  module a caller put in `config.stash[STUDENT_PROVIDER]`: check() and batch grading).
- `points(n)` and `task(name)` markers; `gpu` / `perf` tests skip with a reason without CUDA, `triton` tests
  (the Triton tasks) with grader/without_triton.py's reason and routes where triton is not installed.
- Every run ends with points earned out of points possible per task.
- With an `Observing` plugin (batch grading) each test's `expect_*` observations are recorded,
  between a start and an end mark per test (grader/observe.py).
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest

from grader.delegation import DelegationError
from grader.labs import import_tests, lab_of_notebook
from grader.loader import StudentCodeError, load_notebook, manually_graded, read_cells
from grader.observe import Recorder, set_recorder
from grader.results import FAILED, PASSED, SKIPPED, TestResult, format_points_table
from grader.without_triton import MARKER as TRITON_MARKER
from grader.without_triton import REASON as NO_TRITON
from grader.without_triton import ROUTES, is_triton_skip, triton_installed

__all__ = [
    "pytest_configure",
    "pytest_collect_file",
    "pytest_runtest_setup",
    "pytest_runtest_makereport",
    "pytest_terminal_summary",
    "student",
]

STUDENT_PROVIDER = pytest.StashKey[Callable[[], ModuleType]]()
RESULTS = pytest.StashKey[dict]()
SUMMARY_DONE = pytest.StashKey[bool]()  # labs/ and solutions/ in one run load this plugin twice
MARKERS = [
    "points(n): points the test is worth (0 for an ungraded sanity check)",
    "task(name): the graded task the test belongs to (default: the test name without test_)",
    "gpu: needs a CUDA device (skipped with a reason where there is none)",
    "perf: a throughput target; runs only on a CUDA device, after correctness",
    f"{TRITON_MARKER}: a Triton task (skipped with the reason and the routes where triton is not installed)",
    "end_to_end: runs the whole engine with the learner's functions plugged in (each must be called)",
]
MAX_MESSAGE = 3000
# pytest's hints in assertion messages, advice for a command line the learner is not using
PYTEST_ADVICE = re.compile(r"^\s*(Use -v to get more diff|Use -vv to get more diff|Full diff:|"
                           r"\.\.\.Full output truncated|Omitting \d+ identical items, use -vv to show)")


def _mark_labtests_for_rewrite() -> None:
    """Rich assert messages ("assert 1 == 2 where 1 = f(17)") for the official tests."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "already imported": a second check() in one kernel
        pytest.register_assert_rewrite("grader.labtests")


_mark_labtests_for_rewrite()


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    config.stash.setdefault(RESULTS, {})
    _mark_labtests_for_rewrite()  # pytest's import hook exists now, even if we were imported early


class LabNotebook(pytest.Module):
    """A lab notebook collected as its lab's official test module."""

    def __init__(self, *, lab: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.lab = lab
        self._student: ModuleType | None = None

    def _getobj(self) -> ModuleType:
        return import_tests(self.lab)

    def student_module(self) -> ModuleType:
        if self._student is None:
            self._student = load_notebook(self.path)
        return self._student


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    lab = lab_of_notebook(file_path)
    if lab is None or "checkpoint" in file_path.parent.name:
        return None
    return LabNotebook.from_parent(parent, path=file_path, lab=lab)


@pytest.fixture
def student(request: pytest.FixtureRequest) -> ModuleType:
    """The learner's code: a module of the notebook's solution and `setup` cells."""
    provider = request.config.stash.get(STUDENT_PROVIDER, None)
    if provider is not None:
        return provider()
    node = request.node.getparent(LabNotebook)
    if node is None:
        pytest.fail("the `student` fixture only exists in lab tests run through grader", pytrace=False)
    return node.student_module()


def _cuda_available() -> bool:
    import torch  # only for gpu/perf tests: most labs' tests never need torch at all

    return torch.cuda.is_available()


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker(TRITON_MARKER) is not None and not triton_installed():
        pytest.skip(f"{NO_TRITON} ({ROUTES})")
    for name in ("gpu", "perf"):
        if item.get_closest_marker(name) is not None and not _cuda_available():
            pytest.skip(f"`{name}` test: needs a CUDA device (torch.cuda.is_available() is False here)")


def points_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("points")
    return float(marker.args[0]) if marker is not None else 0.0


def task_of(item: pytest.Item) -> str:
    marker = item.get_closest_marker("task")
    if marker is not None:
        return str(marker.args[0])
    name = getattr(item, "originalname", item.name)
    return name[len("test_"):] if name.startswith("test_") else name


def learner_cell(filename: str) -> str | None:
    """How the learner finds the cell a frame belongs to: "cell N of <notebook>" for a loaded
    notebook, "your cell In[5]" for code run live in the learner's kernel, else None."""
    if filename.startswith("cell "):
        return filename
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    name = getattr(getattr(shell, "compile", None), "format_code_name", None)
    named = name(filename) if name is not None else None
    return f"your cell {named[1]}" if named else None


def describe_failure(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    """The error in one or two lines, plus where in the learner's notebook it was raised."""
    if isinstance(excinfo.value, (StudentCodeError, DelegationError)):
        return str(excinfo.value)
    message = "\n".join(line for line in excinfo.exconly().strip().splitlines() if not PYTEST_ADVICE.match(line))
    learner_frames = [(cell, e) for e in excinfo.traceback if (cell := learner_cell(str(e.path))) is not None]
    if learner_frames:
        cell, entry = learner_frames[-1]
        line = str(entry.statement).strip() if entry.statement is not None else ""
        message += f"\n(raised in {cell}, line {entry.lineno + 1}: {line})"
    return message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE] + " ..."


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    results = item.config.stash.setdefault(RESULTS, {})
    result = results.setdefault(
        item.nodeid, TestResult(name=item.name, task=task_of(item), max_points=points_of(item))
    )
    if report.skipped and result.status == PASSED:
        result.status = SKIPPED
        result.message = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else "skipped"
    elif report.failed and result.status != FAILED:
        result.status = FAILED
        result.message = describe_failure(call.excinfo) if call.excinfo else str(report.longrepr)
    return report


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    results = config.stash.get(RESULTS, {})
    if results and not config.stash.get(SUMMARY_DONE, False):
        config.stash[SUMMARY_DONE] = True
        terminalreporter.section("points per task")
        by_file: dict[str, list[TestResult]] = {}
        for nodeid, result in results.items():
            by_file.setdefault(nodeid.split("::")[0], []).append(result)
        for file, file_results in by_file.items():
            if len(by_file) > 1:
                terminalreporter.write_line(f"{file}:")
            terminalreporter.write_line(format_points_table(file_results))
            if any(r.status == SKIPPED and is_triton_skip(r.message) for r in file_results):
                terminalreporter.write_line(f"{NO_TRITON}: {ROUTES}")
            manual = _manual_points(Path(config.rootpath) / file)
            if manual:
                answers = ", ".join(f"{grade_id} {points:g}" for grade_id, points in manual)
                terminalreporter.write_line(f"+ {sum(p for _, p in manual):g} points graded by the instructor "
                                            f"(written answers, not counted above: {answers})")


def _manual_points(path: Path) -> list[tuple[str, float]]:
    """The notebook's manually graded answers; none when `path` is no readable notebook."""
    if path.suffix != ".ipynb" or not path.is_file():
        return []
    try:
        return manually_graded(read_cells(path))
    except (OSError, ValueError):
        return []


class Observing:
    """Records each test's observations into a JSON-lines log (batch grading, both sides)."""

    def __init__(self, path: str | Path) -> None:
        self.recorder = Recorder(path)

    def pytest_configure(self, config: pytest.Config) -> None:
        set_recorder(self.recorder)

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        set_recorder(None)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        self.recorder.start(item.name)
        try:
            result = yield
        except BaseException as exc:
            self.recorder.finish(False, describe_failure(pytest.ExceptionInfo.from_exception(exc)))
            raise
        self.recorder.finish(True)
        return result
