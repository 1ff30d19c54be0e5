"""Find-the-bug tasks (docs/authoring_labs.md): the buggy code a notebook shows is the code the grader runs.

A lab's locked cell with grade_id `buggy_<name>` shows `buggy_<name>` to the learner; its official test runs
the copy in grader/labtests/labNN_name.py (the learner cannot edit it). Both must be the same text.
"""
from __future__ import annotations

import ast
import json

import pytest

from grader import labs

CASES = []
for lab in labs.available_labs():
    notebook = json.loads((labs.REPO_ROOT / "solutions" / lab / f"{lab}.ipynb").read_text())
    for cell in notebook["cells"]:
        grade_id = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "")
        if grade_id.startswith("buggy_"):
            CASES.append((lab, grade_id, cell))


def test_labs_03_and_05_have_a_find_the_bug_task():
    assert {"03_preemption", "05_prefix_caching"} <= {lab for lab, _, _ in CASES}


@pytest.mark.parametrize("lab, name, cell", CASES, ids=[f"{lab}-{name}" for lab, name, _ in CASES])
def test_the_notebook_shows_the_code_the_grader_runs(lab, name, cell):
    meta = cell["metadata"]["nbgrader"]
    assert meta.get("locked") and not meta.get("solution") and not meta.get("grade"), (
        f"{lab}: the {name} cell must be a locked read-only cell: {meta}")
    source = labs.tests_path(lab).read_text()
    defs = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert defs, f"{lab}: grader/labtests/lab{lab}.py defines no {name}"
    shown = "".join(cell["source"]).strip()
    assert shown == ast.get_source_segment(source, defs[0]).strip(), (
        f"{lab}: the notebook's {name} differs from grader/labtests/lab{lab}.py's: copy the module's function "
        f"into the cell")
    release = json.loads((labs.REPO_ROOT / "labs" / lab / f"{lab}.ipynb").read_text())
    assert any("".join(c["source"]).strip() == shown for c in release["cells"]), f"{lab}: the release lacks {name}"
