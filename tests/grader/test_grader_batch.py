"""`python -m grader batch`: the parts around the sandboxed runs. The hostile class itself (honest and
attacking submissions graded together in the sandbox) is tests/adversarial/test_adversarial_class.py."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grader.batch.grade import Limits, find_notebook, grade_all, manual_cells, snapshot, write_csv, Submission
from grader.labs import REPO_ROOT
from grader.batch.report import write_html
from grader.results import Graded, TestResult

SOLUTION = REPO_ROOT / "solutions" / "00_warmup" / "00_warmup.ipynb"


def _nb(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(SOLUTION.read_bytes())
    return path


def test_nbgrader_path_wins_and_other_copies_are_noted(tmp_path):
    chosen = _nb(tmp_path / "00_warmup" / "00_warmup.ipynb")
    _nb(tmp_path / "old" / "00_warmup.ipynb")
    _nb(tmp_path / "00_warmup" / "00_warmup-Copy1.ipynb")
    notebook, problem, notes = find_notebook(tmp_path, "00_warmup")
    assert (notebook, problem) == (chosen, "")
    assert notes == ["graded 00_warmup/00_warmup.ipynb; ignored old/00_warmup.ipynb (nbgrader's rule)"]


def test_flat_and_single_deep_layouts_are_accepted(tmp_path):
    flat = _nb(tmp_path / "a" / "00_warmup.ipynb")
    assert find_notebook(tmp_path / "a", "00_warmup")[0] == flat
    deep = _nb(tmp_path / "b" / "x" / "y" / "00_warmup.ipynb")
    assert find_notebook(tmp_path / "b", "00_warmup")[0] == deep


def test_two_notebooks_elsewhere_are_refused_with_the_reason(tmp_path):
    _nb(tmp_path / "a" / "00_warmup.ipynb")
    _nb(tmp_path / "b" / "00_warmup.ipynb")
    notebook, problem, _ = find_notebook(tmp_path, "00_warmup")
    assert notebook is None
    assert problem == ("2 notebooks named 00_warmup.ipynb (a/00_warmup.ipynb, b/00_warmup.ipynb) and none at "
                       "00_warmup/00_warmup.ipynb: nbgrader grades only <student>/00_warmup/00_warmup.ipynb; put "
                       "the one to grade there")


def test_links_and_other_names_are_never_graded(tmp_path):
    (tmp_path / "00_warmup").mkdir()
    (tmp_path / "00_warmup" / "00_warmup.ipynb").symlink_to(SOLUTION)
    _nb(tmp_path / "00_warmup" / "my_answers.ipynb")
    notebook, problem, notes = find_notebook(tmp_path, "00_warmup")
    assert notebook is None
    assert problem == ("no 00_warmup.ipynb in the submission (found: 00_warmup/my_answers.ipynb; nbgrader grades "
                       "only the notebook named 00_warmup.ipynb)")
    assert notes == ["00_warmup/00_warmup.ipynb is a symbolic link: not graded"]


def test_snapshots_are_private_copies_made_before_any_run(tmp_path, monkeypatch):
    import grader.batch.grade as batch

    a = _nb(tmp_path / "sub" / "a" / "00_warmup.ipynb")
    b = _nb(tmp_path / "sub" / "b" / "00_warmup.ipynb")
    monkeypatch.setattr(batch, "MAX_NOTEBOOK_BYTES", a.stat().st_size)
    b.write_bytes(b.read_bytes() + b" ")  # one byte over the limit
    subs = [Submission("a", a), Submission("b", b)]
    (tmp_path / "private").mkdir()
    snapshot(subs, tmp_path / "private")
    a.write_text("edited later")
    assert subs[0].snapshot.read_bytes() == SOLUTION.read_bytes()
    assert subs[1].snapshot is None and subs[1].problem == "refused: the notebook is larger than 0 MiB"


def test_manually_graded_cells_are_listed_not_earned(tmp_path):
    nb = json.loads(SOLUTION.read_text())
    nb["cells"].append({"cell_type": "markdown", "id": "why", "source": "Explain ...", "metadata": {
        "nbgrader": {"grade": True, "solution": True, "locked": False, "points": 3, "grade_id": "explain_why",
                     "schema_version": 3}}})
    (tmp_path / "nb.ipynb").write_text(json.dumps(nb))
    manual = manual_cells("00_warmup", tmp_path / "nb.ipynb")
    assert manual == [("explain_why", 3.0)]
    g = Graded("ada", [TestResult("test_x", "x", 2.0)], manual=manual)
    assert (g.points, g.max_points, g.manual_points) == (2.0, 2.0, 3.0)
    write_csv([g], tmp_path / "grades.csv")
    with open(tmp_path / "grades.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows[1] == {"student": "ada", "test": "explain_why", "points": "", "status": "manual",
                       "message": "3 points graded by the instructor"}
    write_html([g], "00_warmup", tmp_path / "report.html")
    assert "2 / 2 (+ 3 points graded by the instructor)" in (tmp_path / "report.html").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grades.csv", "nb.ipynb", "report.html"]  # no temp files


def test_without_bwrap_the_batch_refuses_and_says_how_to_install_it(tmp_path):
    (tmp_path / "sub" / "a").mkdir(parents=True)
    env = {**os.environ, "PATH": str(tmp_path)}  # no bwrap on it
    done = subprocess.run([sys.executable, "-m", "grader", "batch", str(tmp_path / "sub"), "--lab", "00_warmup",
                           "--out", str(tmp_path / "out")], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert "apt-get install bubblewrap" in done.stderr and "--unsafe-no-sandbox" in done.stderr
    assert not (tmp_path / "out" / "grades.csv").exists()


@pytest.mark.slow
def test_unsafe_mode_still_grades(tmp_path, monkeypatch):
    """--unsafe-no-sandbox (trusted code only): the same judging, no sandbox; the reference run imports the
    checkout, the submission's run the grading kit (PYTHONPATH), as in the sandbox."""
    import grader.batch.grade as batch

    envs, popen = [], subprocess.Popen

    def recording_popen(*args, **kwargs):
        if "grader.batch.child" in args[0]:  # only the batch's children (make test runs selftests beside this)
            envs.append(kwargs.get("env") or {})
        return popen(*args, **kwargs)

    monkeypatch.setattr(batch.subprocess, "Popen", recording_popen)
    _nb(tmp_path / "sub" / "ada" / "00_warmup" / "00_warmup.ipynb")
    (graded,) = grade_all(tmp_path / "sub", "00_warmup", Limits(300, 2**31), tmp_path / "out",
                          unsafe_no_sandbox=True)
    assert (graded.points, graded.max_points, graded.reason) == (5, 5, "")
    paths = [env.get("PYTHONPATH") for env in envs]
    assert len(paths) == 2 and paths[0] == str(REPO_ROOT), paths
    kit = Path(paths[1])  # the batch's private kit folder (gone with the batch)
    assert (kit.name, kit.parent.name.startswith("grader-00_warmup-")) == ("kit", True), paths


def test_an_environment_under_tmp_is_bound_over_the_private_tmp(monkeypatch, tmp_path):
    """A checkout (and its .venv) under /tmp stays visible: the private /tmp is mounted before the binds."""
    from grader.batch import sandbox

    monkeypatch.setattr(sandbox, "python_dirs", lambda: ["/tmp/clone/.venv"])
    args = sandbox.command(["python"], kit=tmp_path, notebook=(tmp_path / "n.ipynb", "n.ipynb"), outputs={},
                           env={}, limits=sandbox.Limits(memory_bytes=1 << 30, cpu_seconds=60))
    tmpfs = [i for i, a in enumerate(args) if a == "--tmpfs" and args[i + 1] == "/tmp"]
    venv = args.index("/tmp/clone/.venv", args.index("--ro-bind"))
    assert len(tmpfs) == 1 and tmpfs[0] < venv, "the tmpfs on /tmp would hide the environment bound before it"
