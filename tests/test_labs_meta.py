"""Every lab present: its tests pass on solutions/, fail on the released stub, catch each planted
bug, agree with the notebook's test cells, and labs/ equals a fresh regeneration from solutions/.

Each lab's variants run in one subprocess (`python -m grader.selftest NN_name`, one thread
each), two labs at a time, all started at the first test that needs one; the tests below share
the results.
"""
from __future__ import annotations

import ast
import functools
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from grader import labs as lab_files
from grader.labs import REPO_ROOT
from grader.release import regenerate, solution_labs

LABS = solution_labs()
SELFTEST_TIMEOUT_S = 900
MARKER = "@@SELFTEST@@"


def run_selftest(lab: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two labs share two cores
    return subprocess.run([sys.executable, "-m", "grader.selftest", lab], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=SELFTEST_TIMEOUT_S)


@functools.cache
def selftests() -> dict[str, Future]:
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {lab: pool.submit(run_selftest, lab) for lab in LABS}
    pool.shutdown(wait=False)
    return futures


@functools.cache
def selftest(lab: str) -> dict:
    done = selftests()[lab].result()
    assert done.returncode == 0 and MARKER in done.stdout, f"selftest {lab} failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.split(MARKER, 1)[1])


def describe(results: list[dict]) -> str:
    return "\n".join(f"  {r['name']}: {r['status']} {r['message'][:300]}" for r in results)


def test_at_least_the_warmup_lab_is_present():
    assert "00_warmup" in LABS


@pytest.mark.parametrize("lab", LABS)
def test_official_tests_exist(lab):
    assert lab_files.tests_path(lab).is_file(), f"lab {lab} has no grader/labtests/lab{lab}.py"


@pytest.mark.parametrize("lab", LABS)
def test_solution_passes_every_test(lab):
    results = selftest(lab)["solution"]
    # gpu/perf tests are skipped without CUDA: the plugin says so; anything else must pass
    bad = [r for r in results if r["status"] != "passed" and not (r["status"] == "skipped" and "CUDA" in r["message"])]
    assert results and not bad, f"{lab}: tests that do not pass on the solution:\n{describe(bad)}"


@pytest.mark.parametrize("lab", LABS)
def test_stub_fails_every_graded_test(lab):
    stub = selftest(lab)["stub"]
    assert stub is not None, f"labs/{lab}/{lab}.ipynb is missing: run `make labs`"
    graded_passing = [r for r in stub if r["max_points"] > 0 and r["status"] == "passed"]
    assert not graded_passing, f"{lab}: graded tests that pass on the empty stub:\n{describe(graded_passing)}"


@pytest.mark.parametrize("lab", LABS)
def test_planted_bugs_are_caught(lab):
    bugs = selftest(lab)["bugs"]
    assert bugs, f"{lab}: grader/labtests/lab{lab}_bugs.py plants no bug"
    stale = {name: r for name, r in bugs.items() if isinstance(r, str)}
    assert not stale, f"{lab}: planted bugs whose text is not in the solution: {stale}"
    missed = [name for name, results in bugs.items()
              if not any(r["status"] == "failed" and r["max_points"] > 0 for r in results)]
    assert not missed, f"{lab}: planted bugs no graded test catches: {missed}"


def check_calls(source: str) -> list[ast.Call]:
    tree = ast.parse(source)
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "grader.check"]


@pytest.mark.parametrize("lab", LABS)
def test_test_cells_name_each_official_test_once(lab):
    """Test cells are `grader.check(lab, globals(), tests=[...])` lines whose points add up."""
    points = {t.name: t.points for t in lab_files.official_tests(lab)}
    missing = [name for name, p in points.items() if p is None]
    assert not missing, f"{lab}: tests without @pytest.mark.points: {missing}"

    nb = nbformat.read(REPO_ROOT / "solutions" / lab / f"{lab}.ipynb", as_version=4)
    seen: list[str] = []
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type != "code" or not meta.get("grade") or meta.get("solution"):
            continue
        calls = check_calls(cell.source)
        assert calls, f"{lab}: test cell {meta.get('grade_id')} calls no grader.check"
        names = []
        for call in calls:
            assert ast.literal_eval(call.args[0]) == lab, f"{lab}: {ast.unparse(call)} names another lab"
            tests_kw = [k.value for k in call.keywords if k.arg == "tests"]
            assert tests_kw, f"{lab}: {ast.unparse(call)} must list its tests"
            names += ast.literal_eval(tests_kw[0])
        unknown = set(names) - set(points)
        assert not unknown, f"{lab}: cell {meta.get('grade_id')} names unknown tests {unknown}"
        want = sum(points[n] for n in names)
        assert float(meta.get("points", 0)) == want, (
            f"{lab}: cell {meta.get('grade_id')} is worth {meta.get('points')} points, its tests {want}")
        seen += names
    assert sorted(seen) == sorted(points), (
        f"{lab}: each test must be named by exactly one test cell; named {sorted(seen)}, tests {sorted(points)}")


def test_labs_match_a_fresh_regeneration(tmp_path: Path):
    """labs/ is generated: `make labs` must have been run after the last edit of solutions/."""
    regenerate(tmp_path)
    released = sorted(p.name for p in (REPO_ROOT / "labs").iterdir() if p.is_dir() and p.name[:2].isdigit())
    assert released == LABS, f"labs/ holds {released}, solutions/ {LABS}: run `make labs`"
    for lab in LABS:
        fresh = json.loads((tmp_path / lab / f"{lab}.ipynb").read_text())
        committed = json.loads((REPO_ROOT / "labs" / lab / f"{lab}.ipynb").read_text())
        if committed != fresh:
            cells = zip(committed["cells"], fresh["cells"])
            where = next((i + 1 for i, (a, b) in enumerate(cells) if a != b), "metadata or cell count")
            pytest.fail(f"labs/{lab} differs from a fresh `make labs` (first at cell {where}): run `make labs`")
