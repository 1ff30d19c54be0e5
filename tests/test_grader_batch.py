"""`python -m grader batch`: every submission in its own limited process, judged from its observations
against a trusted reference run; zero with a reason for the ones that hang, crash, tamper or use the
engine's own implementation, and everyone else still graded."""
from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from grader.batch import Limits, Reference, grade_all
from grader.labs import REPO_ROOT

pytestmark = pytest.mark.slow  # ~30 s: a reference run and a dozen children, each importing the engine

SOLUTION = REPO_ROOT / "solutions" / "00_warmup" / "00_warmup.ipynb"
ANSWER = "return (num_tokens + block_size - 1) // block_size"
TIMEOUT_S = 300  # generous: a loaded machine must not time out a correct child (the time limit is tested alone)

# name -> replacement of the solution's answer line, or an (old, new) edit
SUBMISSIONS = {
    "correct": ANSWER,
    "half_right": "return max(1, (num_tokens + block_size - 1) // block_size)",  # wrong for 0 tokens only
    "segfault": "import os, signal\n    os.kill(os.getpid(), signal.SIGSEGV)",
    "memory_hog": "return len(bytearray(2**34))",
    "tamper_edit_tests": (
        "return 0\nimport grader.labtests\n"
        "_p = __import__('pathlib').Path(grader.labtests.__file__).with_name('lab00_warmup.py')\n"
        "_p.write_text(_p.read_text() + '\\n')"
    ),
    # its own outcomes and a log of completed tests, written at exit: the parent trusts neither
    "forges_its_results": (
        "return 0\nimport atexit, sys, json\n"
        "_a = sys.argv\n"
        "_TESTS = ['test_whole_blocks', 'test_partial_block', 'test_edge_cases', 'test_matches_specification', "
        "'test_the_scheduler_sizes_block_tables_with_it']\n"
        "def _forge():\n"
        "    open(_a[_a.index('--results') + 1], 'w').write(json.dumps({'results': [], 'cell_errors': []}))\n"
        "    open(_a[_a.index('--log') + 1], 'w').write(''.join(json.dumps({'test': t, 'observations': [], "
        "'completed': True}) + '\\n' for t in _TESTS))\n"
        "atexit.register(_forge)"
    ),
    "delegates": "from engine_core.core.kv_cache_manager import cdiv\n    return cdiv(num_tokens, block_size)",
    "raises_at_import": ("def num_blocks_needed", "raise RuntimeError('boom at import')\ndef num_blocks_needed"),
}


def make_submission(root: Path, student: str, answer: str | tuple[str, str]) -> None:
    folder = root / student / "00_warmup"  # nbgrader's submitted/<student>/<assignment>/ layout
    folder.mkdir(parents=True)
    nb = nbformat.read(SOLUTION, as_version=4)
    old, new = answer if isinstance(answer, tuple) else (ANSWER, answer)
    for cell in nb.cells:
        cell.source = cell.source.replace(old, new)
    nbformat.write(nb, folder / "00_warmup.ipynb")
    # a copy of the tests that always pass, next to the notebook: must never be used
    (folder / "test_fake.py").write_text("def test_everything():\n    pass\n")


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> tuple[dict[str, list[dict]], str, Path]:
    root = tmp_path_factory.mktemp("submitted")
    for student, answer in SUBMISSIONS.items():
        make_submission(root, student, answer)
    (root / "no_notebook").mkdir()
    out = tmp_path_factory.mktemp("grades")
    done = subprocess.run(
        [sys.executable, "-m", "grader", "batch", str(root), "--lab", "00_warmup", "--jobs", "3",
         "--timeout", str(TIMEOUT_S), "--memory-gb", "2", "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows: dict[str, list[dict]] = {}
    with open(out / "grades.csv") as f:
        for row in csv.DictReader(f):
            rows.setdefault(row["student"], []).append(row)
    return rows, done.stdout, out


def total(rows: list[dict]) -> float:
    return sum(float(r["points"]) for r in rows)


def test_grades_csv_has_one_row_per_student_and_official_test(batch):
    rows, _, _ = batch
    assert set(rows) == set(SUBMISSIONS) | {"no_notebook"}
    for student, student_rows in rows.items():
        assert [r["test"] for r in student_rows] == [
            "test_whole_blocks", "test_partial_block", "test_edge_cases", "test_matches_specification",
        "test_the_scheduler_sizes_block_tables_with_it"], student


def test_correct_and_half_right_are_graded_on_their_merits(batch):
    rows, _, _ = batch
    assert total(rows["correct"]) == 5
    assert total(rows["half_right"]) == 3
    failed = {r["test"]: r["message"] for r in rows["half_right"] if r["status"] == "failed"}
    assert failed["test_edge_cases"] == "num_blocks_needed(0, 16): no tokens, no block\n  expected: 0\n  got:      1"


@pytest.mark.parametrize(
    "student, status, reason",
    [
        ("segfault", "crashed", "died of SIGSEGV"),
        ("tamper_edit_tests", "tampered", "grader/labtests/lab00_warmup.py"),
        ("forges_its_results", "failed", "checks"),
        ("delegates", "delegated", "uses the reference implementation: your `num_blocks_needed` calls the engine's "
                                   "kv_cache_manager.cdiv"),
        ("no_notebook", "missing", "no 00_warmup.ipynb"),
    ],
)
def test_bad_submissions_score_zero_with_the_reason(batch, student, status, reason):
    rows, stdout, _ = batch
    assert total(rows[student]) == 0
    assert {r["status"] for r in rows[student]} == {status}
    assert all(reason in r["message"] for r in rows[student]), rows[student][0]["message"]
    assert student in stdout


def test_memory_limit_fails_the_test_that_allocates(batch):
    rows, _, _ = batch
    assert total(rows["memory_hog"]) == 0
    assert all("MemoryError" in r["message"] for r in rows["memory_hog"]), rows["memory_hog"][0]["message"]


def test_an_error_at_import_names_the_cell(batch):
    rows, _, out = batch
    assert total(rows["raises_at_import"]) == 0
    reason = "`num_blocks_needed` is not defined because cell 4 of 00_warmup.ipynb: RuntimeError: boom at import"
    assert all(r["message"] == reason for r in rows["raises_at_import"]), rows["raises_at_import"][0]["message"]
    assert "cell 4 of 00_warmup.ipynb: RuntimeError: boom at import" in (out / "report.html").read_text()


def test_the_html_report_lists_everyone(batch):
    _, _, out = batch
    html = (out / "report.html").read_text()
    for student in SUBMISSIONS:
        assert f"id='{student}'" in html


def test_a_submission_past_the_time_limit_scores_zero(tmp_path):
    """The time limit alone (no reference needed: the verdict comes before any comparison)."""
    make_submission(tmp_path / "submitted", "endless_loop", "while True:\n        pass")
    limits = Limits(timeout_s=3, memory_bytes=2**31)
    (graded,) = grade_all(tmp_path / "submitted", "00_warmup", limits, tmp_path / "out", reference=Reference({}, {}))
    assert graded.points == 0 and graded.reason == "timed out after 3 s (an endless loop?)"
    assert {r.status for r in graded.results} == {"timeout"}
