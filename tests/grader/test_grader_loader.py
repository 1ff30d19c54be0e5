"""The notebook loader: which cells run, source registration, and per-cell error reporting."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from grader.labs import REPO_ROOT
from grader.loader import StudentCodeError, load_notebook


def solution_cell(source: str):
    cell = new_code_cell(source)
    cell.metadata["nbgrader"] = {"solution": True, "grade": False, "locked": False, "grade_id": f"s{abs(hash(source))}"}
    return cell


def setup_cell(source: str):
    cell = new_code_cell(source)
    cell.metadata["tags"] = ["setup"]
    return cell


def grade_cell(source: str):
    cell = new_code_cell(source)
    cell.metadata["nbgrader"] = {"solution": False, "grade": True, "locked": True, "points": 1, "grade_id": "t"}
    return cell


def write(tmp_path: Path, *cells, name: str = "lab.ipynb") -> Path:
    path = tmp_path / name
    nbformat.write(new_notebook(cells=list(cells)), path)
    return path


def test_only_solution_and_setup_cells_run(tmp_path):
    path = write(
        tmp_path,
        new_markdown_cell("# title"),
        setup_cell("import math\nSCALE = 2"),
        solution_cell("def double(x):\n    return SCALE * x"),
        grade_cell("raise AssertionError('test cells must never run')"),
        new_code_cell("raise AssertionError('demo cells must never run')"),
    )
    module = load_notebook(path)
    assert module.double(21) == 42
    assert module.__cell_errors__ == []


def test_getsource_and_tracebacks_point_at_the_cell(tmp_path):
    path = write(tmp_path, new_markdown_cell("intro"), solution_cell("def f(x):\n    return 1 / x"))
    module = load_notebook(path)
    assert inspect.getsource(module.f) == "def f(x):\n    return 1 / x\n"
    with pytest.raises(ZeroDivisionError) as info:
        module.f(0)
    assert str(info.traceback[-1].path) == f"cell 2 of {path.resolve()}"  # tmp_path lies outside the cwd
    assert "return 1 / x" in str(info.traceback[-1].statement)


def test_a_failing_cell_fails_only_the_names_it_should_define(tmp_path):
    path = write(
        tmp_path,
        solution_cell("def good():\n    return 'ok'"),
        solution_cell("x = 1 / 0\ndef broken():\n    return 'never defined'"),
        solution_cell("def also_good():\n    return good()"),
    )
    module = load_notebook(path)
    assert module.good() == "ok" and module.also_good() == "ok"
    with pytest.raises(StudentCodeError, match=r"`broken` is not defined because cell 2 of .*lab\.ipynb: ZeroDivisionError"):
        module.broken()
    assert "x = 1 / 0" in module.__cell_errors__[0].traceback


def test_syntax_errors_and_system_exit_are_reported_not_raised(tmp_path):
    path = write(tmp_path, solution_cell("def f(:\n    pass"), solution_cell("raise SystemExit(3)"))
    module = load_notebook(path)
    assert [e.summary.split(":")[0] for e in module.__cell_errors__] == ["SyntaxError", "SystemExit"]


def test_missing_name_says_to_keep_the_given_name(tmp_path):
    module = load_notebook(write(tmp_path, solution_cell("def renamed():\n    pass")))
    with pytest.raises(StudentCodeError, match="defines no `expected_name`"):
        module.expected_name


def test_magics_are_commented_out(tmp_path):
    module = load_notebook(write(tmp_path, setup_cell("%matplotlib inline\n!echo hi\nVALUE = 3")))
    assert module.VALUE == 3 and module.__cell_errors__ == []


def test_edits_replace_text_and_unknown_edits_are_rejected(tmp_path):
    path = write(tmp_path, solution_cell("def f():\n    return 1"))
    assert load_notebook(path, edits=[("return 1", "return 2")]).f() == 2
    with pytest.raises(ValueError, match="occurs in no graded cell"):
        load_notebook(path, edits=[("return 3", "return 4")])


def test_dataclasses_work_in_notebook_cells(tmp_path):
    """dataclasses look their module up in sys.modules: the loader must register it."""
    module = load_notebook(write(tmp_path, solution_cell(
        "from dataclasses import dataclass\n@dataclass\nclass Block:\n    block_id: int\n    ref_cnt: int = 0")))
    assert module.Block(3).ref_cnt == 0


TRITON_SCRIPT = textwrap.dedent("""
    import sys, torch
    from grader.loader import load_notebook
    module = load_notebook(sys.argv[1])
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty_like(x)
    module.add_one[(1,)](x, out, 8, BLOCK=8)
    assert torch.equal(out, x + 1), out
    print("TRITON_OK")
""")


@pytest.mark.slow  # a fresh interpreter importing torch and triton: ~5 s
def test_a_triton_jit_kernel_defined_in_a_cell_compiles_under_the_interpreter(tmp_path):
    """@triton.jit reads the kernel's source with inspect: the linecache registration must serve it."""
    path = write(
        tmp_path,
        setup_cell("import triton\nimport triton.language as tl"),
        solution_cell(textwrap.dedent("""
            @triton.jit
            def add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
                offsets = tl.arange(0, BLOCK)
                mask = offsets < n
                tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1.0, mask=mask)
        """)),
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # must be set before triton is imported: a fresh process
    done = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(path)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert "TRITON_OK" in done.stdout, done.stdout + done.stderr
