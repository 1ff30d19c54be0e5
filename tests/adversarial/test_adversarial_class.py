"""The project's own hostile class: lab 00 submissions (tests/adversarial/lab00/*.py, each the source of the
notebook's graded cell, its kind and deserved grade in its first comment) graded together by
`python -m grader batch` in its sandbox. Every honest submission gets exactly its grade, every attacker 0 or
what its honest code earns, nothing outlives the batch, and grades.csv is complete.

The 40-submission lab 03 timing is `make grade-class-bench` (tests/adversarial/bench_lab03.py)."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grader.batch import sandbox
from grader.labs import REPO_ROOT

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(sandbox.unavailable_reason() is not None,
                                 reason=f"no sandbox here: {sandbox.unavailable_reason()}")]

HERE = Path(__file__).parent / "lab00"
SOLUTION = REPO_ROOT / "solutions" / "00_warmup" / "00_warmup.ipynb"
TESTS = ["test_whole_blocks", "test_partial_block", "test_edge_cases", "test_matches_specification",
         "test_the_scheduler_sizes_block_tables_with_it"]
TEST_TIMEOUT_S = 20

# student -> (points, {test: status} for the tests that do not pass, or one status for all)
EXPECTED = {
    "honest_correct": (5, {}),
    "honest_half_right": (3, {"test_edge_cases": "failed", "test_matches_specification": "failed"}),
    "forge_in_process": (0, "*"),
    "delegates_import": (0, "delegated"),
    "reads_checkout": (0, "*"),
    "hostile_neighbour": (5, {}),
    "hogs_resources": (5, {}),
    "kills_itself": (3, {"test_edge_cases": "crashed", "test_matches_specification": "crashed"}),
    "loops_in_one_case": (4, {"test_whole_blocks": "timeout"}),
    "memory_hog": (0, "failed"),
    "no_notebook": (0, "missing"),
    "two_notebooks": (0, "missing"),
    "links_the_solution": (0, "missing"),
}


def write_notebook(path: Path, graded_cell: str) -> None:
    nb = json.loads(SOLUTION.read_text())
    for cell in nb["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "num_blocks_needed":
            cell["source"] = graded_cell
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb))


def make_class(root: Path) -> None:
    for source in sorted(HERE.glob("*.py")):
        write_notebook(root / source.stem / "00_warmup" / "00_warmup.ipynb", source.read_text())
    (root / "no_notebook").mkdir()
    honest = (HERE / "honest_correct.py").read_text()
    write_notebook(root / "two_notebooks" / "a" / "00_warmup.ipynb", honest)
    write_notebook(root / "two_notebooks" / "b" / "00_warmup.ipynb", honest)
    (root / "links_the_solution" / "00_warmup").mkdir(parents=True)
    (root / "links_the_solution" / "00_warmup" / "00_warmup.ipynb").symlink_to(SOLUTION)


def leftovers() -> list[str]:
    """Processes of the class still alive anywhere on the machine (the daemon's marker)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and b"987654" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("advclass") / "submitted"
    make_class(root)
    out = tmp_path_factory.mktemp("grades")
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "grader", "batch", str(root), "--lab", "00_warmup", "--jobs", "2",
         "--timeout", "400", "--test-timeout", str(TEST_TIMEOUT_S), "--memory-gb", "2", "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - start
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    rows: dict[str, list[dict]] = {}
    with open(out / "grades.csv") as f:
        for row in csv.DictReader(f):
            rows.setdefault(row["student"], []).append(row)
    return rows, done.stdout, out, seconds


@pytest.mark.parametrize("student", sorted(EXPECTED))
def test_each_submission_gets_what_its_honest_code_earns(graded, student):
    rows, stdout, _, _ = graded
    points, statuses = EXPECTED[student]
    mine = rows[student]
    assert [r["test"] for r in mine] == TESTS
    detail = "\n".join(f"{r['test']}: {r['points']} {r['status']} {r['message'][:300]}" for r in mine)
    assert sum(float(r["points"]) for r in mine) == points, detail
    if isinstance(statuses, dict):
        assert {r["test"]: r["status"] for r in mine if r["status"] != "passed"} == statuses, detail
    elif statuses != "*":
        assert {r["status"] for r in mine} == {statuses}, detail
    assert student in stdout


def test_reasons_say_what_happened(graded):
    rows, _, _, _ = graded
    by = {s: {r["test"]: r["message"] for r in rows[s]} for s in rows}
    assert by["loops_in_one_case"]["test_whole_blocks"] == f"timed out after {TEST_TIMEOUT_S} s in this test (an endless loop?)"
    assert "died of SIGKILL in this test" in by["kills_itself"]["test_edge_cases"]
    assert "MemoryError" in by["memory_hog"]["test_whole_blocks"]
    assert "uses the reference implementation" in by["delegates_import"]["test_whole_blocks"]
    assert "nbgrader grades only <student>/00_warmup/00_warmup.ipynb" in by["two_notebooks"]["test_whole_blocks"]
    assert "no 00_warmup.ipynb" in by["links_the_solution"]["test_whole_blocks"]


def test_nothing_outlives_the_batch(graded):
    _, _, out, _ = graded
    assert leftovers() == []
    for path in ("/tmp/hog", "/tmp/sparse", "/dev/shm/hog", "/tmp/conftest.py", "/tmp/sitecustomize.py"):
        assert not Path(path).exists(), f"{path}: a submission wrote outside its sandbox"
    before = (out / "grades.csv").read_bytes()
    time.sleep(1)
    assert (out / "grades.csv").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["grades.csv", "report.html"]


def test_report_lists_everyone(graded):
    _, _, out, seconds = graded
    html = (out / "report.html").read_text()
    for student in EXPECTED:
        assert f"id='{student}'" in html
    print(f"adversarial class of {len(EXPECTED)}: {seconds:.0f} s")
