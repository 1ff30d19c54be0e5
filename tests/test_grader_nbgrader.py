"""The instructor workflow of docs/instructors.md, end to end on 00_warmup, in a scratch course:
generate_assignment -> submitted/ -> autograde -> generate_feedback -> export to CSV."""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from grader.labs import REPO_ROOT

pytestmark = pytest.mark.slow

ANSWER = "return (num_tokens + block_size - 1) // block_size"
STUB = "# YOUR CODE HERE\n    raise NotImplementedError()"
CELL_TIMEOUT_S = 12  # the first check cell imports the engine (torch): a few seconds
NOISY = (
    "import os, warnings\n    import torch\n"
    "    torch.tensor(torch.tensor([1.0]))  # torch's copy-construct UserWarning, on stderr\n"
    "    warnings.warn('a warning of the learner', UserWarning)\n"
    "    os.write(2, b'a line written straight to file descriptor 2\\n')\n    " + ANSWER
)


def nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    """nbgrader from the repo root (its nbgrader_config.py applies) on the scratch course."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # it runs `alembic`
    done = subprocess.run(
        [sys.executable, "-m", "nbgrader", *args, f"--CourseDirectory.root={course}"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def submit(course: Path, student: str, answer: str) -> None:
    """A learner's copy of the *released* notebook (no hidden tests) with `answer` filled in."""
    nb = nbformat.read(course / "labs" / "00_warmup" / "00_warmup.ipynb", as_version=4)
    for cell in nb.cells:
        cell.source = cell.source.replace(STUB, answer)
    folder = course / "submitted" / student / "00_warmup"
    folder.mkdir(parents=True)
    nbformat.write(nb, folder / "00_warmup.ipynb")


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    course = tmp_path_factory.mktemp("course")
    shutil.copytree(REPO_ROOT / "solutions" / "00_warmup", course / "solutions" / "00_warmup")
    nbgrader(course, "generate_assignment", "00_warmup")
    submit(course, "alice", ANSWER)
    submit(course, "bob", STUB)
    submit(course, "carol", NOISY)
    submit(course, "dave", "while True:\n        pass")
    nbgrader(course, "autograde", "00_warmup", f"--Execute.timeout={CELL_TIMEOUT_S}")
    nbgrader(course, "generate_feedback", "00_warmup")
    nbgrader(course, "export", f"--to={course / 'grades.csv'}")
    return course


def scores(course: Path) -> dict[str, tuple[float, float]]:
    with open(course / "grades.csv") as f:
        return {row["student_id"]: (float(row["score"]), float(row["max_score"])) for row in csv.DictReader(f)}


def test_the_solution_gets_full_marks_and_the_stub_zero(course):
    got = scores(course)
    assert got["alice"] == (5.0, 5.0)
    assert got["bob"] == (0.0, 5.0)


def test_hidden_tests_are_restored_and_run(course):
    nb = nbformat.read(course / "autograded" / "alice" / "00_warmup" / "00_warmup.ipynb", as_version=4)
    check_cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade"))
    assert "test_edge_cases" in check_cell.source
    printed = "".join(o.get("text", "") for o in check_cell.outputs)
    assert "[PASS] test_edge_cases" in printed and "[PASS] test_matches_specification" in printed


def test_torch_warnings_on_stderr_do_not_zero_a_correct_cell(course):
    assert scores(course)["carol"] == (5.0, 5.0)


def test_a_cell_past_the_time_limit_scores_zero_and_grading_goes_on(course):
    assert scores(course)["dave"] == (0.0, 5.0)
    nb = nbformat.read(course / "autograded" / "dave" / "00_warmup" / "00_warmup.ipynb", as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert errors, "the endless loop should have been interrupted with an error"


def test_feedback_is_written_for_everyone(course):
    for student in ("alice", "bob", "carol", "dave"):
        html = (course / "feedback" / student / "00_warmup" / "00_warmup.html").read_text()
        assert "num_blocks_needed" in html
