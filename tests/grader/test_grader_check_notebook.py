"""`grader.check` as a learner meets it: in a live Jupyter kernel, and under nbgrader.

In the learner's kernel a failing check prints its report and Run All goes on; an exception in
the learner's own code names the cell (as Jupyter numbers it, In[N]) and line. Under nbgrader
(`NBGRADER_EXECUTION` set) the cell raises, and the error shows the report's summary, not a
traceback into the grader. GPU-only tests skipped on a CPU say why they earn nothing here.
"""
from __future__ import annotations

import sys

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

import grader
from grader.labs import REPO_ROOT
from grader.results import FAILED, PASSED, SKIPPED, TestResult

CELLS = [
    "import grader",
    "def num_blocks_needed(num_tokens, block_size):\n    return -(-num_tokens // blok_size)",
    'grader.check("00_warmup", globals(), tests=["test_whole_blocks"])',
    'print("the next section ran")',
]


def run(cells: list[str]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(REPO_ROOT)}}).execute()
    return nb


def text_of(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.outputs)


@pytest.fixture(scope="module")
def learner_run() -> nbformat.NotebookNode:
    return run(CELLS)


def test_a_failing_check_in_the_learners_kernel_reports_and_run_all_goes_on(learner_run):
    report = text_of(learner_run.cells[2])
    assert "[FAIL] test_whole_blocks (1 pt)" in report
    assert "at submission this cell earns 0" in report
    assert not [o for o in learner_run.cells[2].outputs if o.output_type == "error"]
    assert text_of(learner_run.cells[3]) == "the next section ran\n"


def test_an_error_in_a_live_cell_names_the_cell_and_line(learner_run):
    report = text_of(learner_run.cells[2])
    assert "NameError: name 'blok_size' is not defined" in report
    assert "raised in your cell In[2], line 2: return -(-num_tokens // blok_size)" in report


def test_the_cell_says_what_its_hidden_tests_are_worth(learner_run):
    report = text_of(learner_run.cells[2])
    assert "this cell is worth 4: 3 hidden tests (3 pts) run at grading" in report
    assert "pytest labs/00_warmup" in report


def test_under_nbgrader_the_cell_fails_without_a_traceback_into_the_grader(monkeypatch):
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")  # the kernel inherits it
    with pytest.raises(CellExecutionError) as excinfo:
        run(CELLS)
    message = str(excinfo.value)
    assert "CheckFailed: 1 of 1 tests did not pass: test_whole_blocks" in message
    assert "grader/check.py" not in message and "runner.py" not in message


def fake_results(monkeypatch, *results: TestResult) -> None:
    check_module = sys.modules["grader.check"]  # the module: `grader.check` is the function
    monkeypatch.setattr(check_module, "run_tests", lambda lab, provider, tests: list(results))


GPU_SKIP = TestResult("test_fast", "kernel", 3, SKIPPED,
                      "`perf` test: needs a CUDA device (torch.cuda.is_available() is False here)")


def test_a_gpu_only_test_on_a_cpu_says_why_it_earns_nothing_and_does_not_stop(monkeypatch, capsys):
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    fake_results(monkeypatch, TestResult("test_whole_blocks", "num_blocks_needed", 1, PASSED), GPU_SKIP)
    grader.check("00_warmup", {})
    out = capsys.readouterr().out
    assert "[GPU ] test_fast (3 pts): needs a GPU: 0 of 3 points here" in out


def test_under_nbgrader_a_gpu_skip_scores_zero(monkeypatch):
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")
    fake_results(monkeypatch, GPU_SKIP)
    with pytest.raises(grader.CheckFailed, match="test_fast"):
        grader.check("00_warmup", {})


def test_a_real_failure_beside_a_gpu_skip_still_raises_outside_a_notebook(monkeypatch):
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    fake_results(monkeypatch, TestResult("test_whole_blocks", "num_blocks_needed", 1, FAILED, "wrong"), GPU_SKIP)
    with pytest.raises(grader.CheckFailed, match="2 of 2 tests did not pass"):
        grader.check("00_warmup", {})
