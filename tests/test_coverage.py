"""docs/coverage.md, the interview-coverage table, against the repository.

Every one of the 107 article items (ids M1-M11, P1-P7, S1-S7, R1-R9, C1-C6, K1-K7, Q1-Q9, L1-L5, D1-D2, T1-T11,
V1-V7, E1-E4, F1-F7, H1-H5, X1-X10) has exactly one row; a row graded by tests names at least one, and every test it
names (`labNN_name.py::test_x`) is a function of that file in grader/labtests/; a rubric row names the answer cell
(its nbgrader grade id) of a lab notebook; an in-progress row says which lab.
"""
from __future__ import annotations

import json
import re

import pytest

from grader.labs import REPO_ROOT

AREAS = {"M": 11, "P": 7, "S": 7, "R": 9, "C": 6, "K": 7, "Q": 9, "L": 5, "D": 2, "T": 11, "V": 7, "E": 4, "F": 7,
         "H": 5, "X": 10}
IDS = [f"{area}{n}" for area, count in AREAS.items() for n in range(1, count + 1)]
ROW = re.compile(r"^\| ([A-Z]\d+) \| (.+) \| (\d\d) \| (.+) \| (.+) \|$")
TEST_REF = re.compile(r"`(lab\d\d_\w+\.py)::(test_\w+)`")
ANSWER_REF = re.compile(r"`(\w+)` points? \d")
KIND = re.compile(r"^(test|rubric|in progress: (lab \d\d|\d\d_\w+))$")
TEXT = (REPO_ROOT / "docs" / "coverage.md").read_text()
ROWS = [m.groups() for m in map(ROW.match, TEXT.splitlines()) if m]


def _answer_cells() -> set[str]:
    """Grade ids of the written-answer cells (graded markdown cells) of every solution notebook."""
    ids = set()
    for nb in REPO_ROOT.glob("solutions/*/*.ipynb"):
        for cell in json.loads(nb.read_text())["cells"]:
            meta = cell["metadata"].get("nbgrader", {})
            if cell["cell_type"] == "markdown" and meta.get("grade"):
                ids.add(meta["grade_id"])
    return ids


def test_every_item_once():
    assert len(IDS) == 107
    found = [row[0] for row in ROWS]
    assert sorted(found) == sorted(IDS), (f"missing: {sorted(set(IDS) - set(found))}, unknown: "
                                          f"{sorted(set(found) - set(IDS))}, repeated: "
                                          f"{sorted({i for i in found if found.count(i) > 1})}")
    table_lines = [line for line in TEXT.splitlines() if re.match(r"^\| [A-Z]\d+ \|", line)]
    assert len(table_lines) == len(ROWS), "a table row that does not parse as | id | what | lab | graded by | kind |"


@pytest.mark.parametrize("item, what, lab, graded_by, kind", ROWS, ids=[row[0] for row in ROWS])
def test_row_names_what_grades_it(item, what, lab, graded_by, kind):
    assert KIND.match(kind), f"{item}: kind must be test, rubric or 'in progress: lab NN', got {kind!r}"
    tests = TEST_REF.findall(graded_by)
    answers = ANSWER_REF.findall(graded_by)
    if kind == "test":
        assert tests, f"{item}: a row graded by tests names one (`labNN_name.py::test_x`)"
    if kind == "rubric":
        assert answers, f"{item}: a rubric row names the answer cell and its point (`interview_x` point N)"
    if kind.startswith("in progress"):
        assert lab in kind, f"{item}: in progress in lab {lab}, says {kind!r}"
    for file, name in tests:
        path = REPO_ROOT / "grader" / "labtests" / file
        assert path.exists(), f"{item}: {file} is not a test module of grader/labtests"
        assert re.search(rf"^def {name}\(", path.read_text(), re.M), f"{item}: {file} has no {name}"
    missing = sorted(set(answers) - _answer_cells())
    assert not missing, f"{item}: no solution notebook has a written-answer cell {missing}"
