"""The instructor workflow of docs/instructors.md, end to end on 00_warmup, in a scratch course:
generate_assignment -> submitted/ -> autograde -> a manual grade -> generate_feedback -> export to CSV.

The scratch copy of lab 00 gets a manually graded interview answer (a markdown cell with the
metadata every lab's interview answers carry), so the round trip proves what an instructor sees:
the release hides the model answer, autograde leaves it for a person, and the export's total is
auto + manual."""
from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook

from grader.labs import REPO_ROOT

pytestmark = pytest.mark.slow

ANSWER = "return (num_tokens + block_size - 1) // block_size"
STUB = "# YOUR CODE HERE\n    raise NotImplementedError()"
# dave's endless loop is cut after this long per cell; he is graded alone with it, so that no honest cell (the first
# check cell imports the engine: a few seconds idle, 10-20 s on a loaded 2-core box) races it: the others get the
# course's own limit (nbgrader_config.py), and a slow machine can only lower dave's 0 to 0
CELL_TIMEOUT_S = 30
NOISY = (
    "import os, warnings\n    import torch\n"
    "    torch.tensor(torch.tensor([1.0]))  # torch's copy-construct UserWarning, on stderr\n"
    "    warnings.warn('a warning of the learner', UserWarning)\n"
    "    os.write(2, b'a line written straight to file descriptor 2\\n')\n    " + ANSWER
)


MANUAL_ID, MANUAL_POINTS = "interview_blocks", 3
MODEL_ANSWER = "A model answer: ceil division, because a partial block still takes a whole block."


def add_interview_answer(solution: Path) -> None:
    """Appends a question and a manually graded answer cell, as the labs write them."""
    nb = nbformat.read(solution, as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell("**Interview question** (3 points): why round up?"))
    answer = nbformat.v4.new_markdown_cell(MODEL_ANSWER)
    answer.metadata["nbgrader"] = {"grade": True, "solution": True, "locked": False, "points": MANUAL_POINTS,
                                   "grade_id": MANUAL_ID, "schema_version": 3, "task": False}
    nb.cells.append(answer)
    nbformat.write(nb, solution)


def nbgrader(course: Path, *args: str) -> subprocess.CompletedProcess:
    """nbgrader from the repo root (its nbgrader_config.py applies) on the scratch course."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # it runs `alembic`
    done = subprocess.run(
        [sys.executable, "-m", "nbgrader", *args, f"--CourseDirectory.root={course}"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def submit(course: Path, student: str, answer: str, written: str | None = None) -> None:
    """A learner's copy of the *released* notebook (no hidden tests) with `answer` filled in,
    and `written` as the interview answer (None: left as released)."""
    nb = nbformat.read(course / "labs" / "00_warmup" / "00_warmup.ipynb", as_version=4)
    for cell in nb.cells:
        cell.source = cell.source.replace(STUB, answer)
        if written is not None and cell.metadata.get("nbgrader", {}).get("grade_id") == MANUAL_ID:
            cell.source = written
    folder = course / "submitted" / student / "00_warmup"
    folder.mkdir(parents=True)
    nbformat.write(nb, folder / "00_warmup.ipynb")


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> Path:
    course = tmp_path_factory.mktemp("course")
    shutil.copytree(REPO_ROOT / "solutions" / "00_warmup", course / "solutions" / "00_warmup")
    add_interview_answer(course / "solutions" / "00_warmup" / "00_warmup.ipynb")
    nbgrader(course, "generate_assignment", "00_warmup")
    submit(course, "alice", ANSWER, written="Blocks are whole: 17 tokens in blocks of 16 take 2.")
    submit(course, "bob", STUB)
    submit(course, "carol", NOISY)
    nbgrader(course, "autograde", "00_warmup")
    submit(course, "dave", "while True:\n        pass")
    nbgrader(course, "autograde", "00_warmup", "--student=dave", f"--Execute.timeout={CELL_TIMEOUT_S}")
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:  # what formgrader's score box does
        grade = gradebook.find_grade(MANUAL_ID, "00_warmup", "00_warmup", "alice")
        grade.manual_score = 2
        gradebook.db.commit()
    nbgrader(course, "generate_feedback", "00_warmup")
    nbgrader(course, "export", f"--to={course / 'grades.csv'}")
    return course


def scores(course: Path) -> dict[str, tuple[float, float]]:
    with open(course / "grades.csv") as f:
        return {row["student_id"]: (float(row["score"]), float(row["max_score"])) for row in csv.DictReader(f)}


def test_the_solution_gets_full_marks_and_the_stub_zero(course):
    got = scores(course)
    assert got["alice"] == (5.0 + 2.0, 5.0 + MANUAL_POINTS), "auto 5 of 5 plus the manual 2 of 3"
    assert got["bob"] == (0.0, 5.0 + MANUAL_POINTS)


def test_the_release_shows_the_question_not_the_model_answer(course):
    released = (course / "labs" / "00_warmup" / "00_warmup.ipynb").read_text()
    assert "why round up?" in released and MODEL_ANSWER not in released and "YOUR ANSWER HERE" in released


def test_autograde_leaves_a_written_answer_to_a_person_and_an_untouched_one_at_zero(course):
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        alice = gradebook.find_grade(MANUAL_ID, "00_warmup", "00_warmup", "alice")
        assert alice.auto_score is None and alice.manual_score == 2, "only the instructor's score counts"
        bob = gradebook.find_grade(MANUAL_ID, "00_warmup", "00_warmup", "bob")
        assert bob.auto_score == 0 and not bob.needs_manual_grade, "nbgrader scores an unchanged answer 0"


def test_hidden_tests_are_restored_and_run(course):
    nb = nbformat.read(course / "autograded" / "alice" / "00_warmup" / "00_warmup.ipynb", as_version=4)
    check_cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade"))
    assert "test_edge_cases" in check_cell.source
    printed = "".join(o.get("text", "") for o in check_cell.outputs)
    assert "[PASS] test_edge_cases" in printed and "[PASS] test_matches_specification" in printed


def test_torch_warnings_on_stderr_do_not_zero_a_correct_cell(course):
    assert scores(course)["carol"] == (5.0, 5.0 + MANUAL_POINTS)


def test_a_cell_past_the_time_limit_scores_zero_and_grading_goes_on(course):
    assert scores(course)["dave"] == (0.0, 5.0 + MANUAL_POINTS)
    nb = nbformat.read(course / "autograded" / "dave" / "00_warmup" / "00_warmup.ipynb", as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert errors, "the endless loop should have been interrupted with an error"


def test_feedback_is_written_for_everyone(course):
    for student in ("alice", "bob", "carol", "dave"):
        html = (course / "feedback" / student / "00_warmup" / "00_warmup.html").read_text()
        assert "num_blocks_needed" in html
