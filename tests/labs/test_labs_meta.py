"""Every lab present: its tests pass on solutions/, fail on the released stub, catch each planted
bug, agree with the notebook's test cells, and labs/ equals a fresh regeneration from solutions/.
The engine and the solutions agree (each passes the other's tests), every end-to-end test makes
the engine call every function it plugs, a notebook that calls the engine's own functions
scores 0 on every test that plugs them in self-grading (in batch grading the kit holds no such
body: tests/grader/test_grader_kit.py), and batch grading gives the solution full marks.

Each lab's variants run in one subprocess (`python -m grader.selftest NN_name`, one thread
each), two labs at a time, started right after collection for the labs whose `selftest`-marked
tests are selected (tests/conftest.py); the tests below share the results.
"""
from __future__ import annotations

import ast
import functools
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from grader import labs as lab_files
from grader.delegation import VERDICT
from grader.batch.kit import comparisons_left
from grader.check import _hidden_points
from grader.labs import REPO_ROOT
from grader.release import regenerate, solution_labs
from grader.seams import SEAMLESS_LABS

LABS = solution_labs()
SEAMED_LABS = [lab for lab in LABS if lab not in SEAMLESS_LABS]  # a seamless lab has no engine function to check
SELFTEST_TIMEOUT_S = 900
MARKER = "@@SELFTEST@@"


def run_selftest(lab: str, results: Path | None) -> subprocess.CompletedProcess:
    """One lab's selftest; with `results`, its outcome also goes to `results/<lab>.json` (written whole,
    then renamed) for the pytest-xdist workers that did not start it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two labs share two cores
    try:
        done = subprocess.run([sys.executable, "-m", "grader.selftest", lab], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=SELFTEST_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        done = subprocess.CompletedProcess(exc.cmd, -1, out, f"timed out after {exc.timeout} s")
    if results is not None:
        tmp = results / f".{lab}.json"
        tmp.write_text(json.dumps({"returncode": done.returncode, "stdout": done.stdout, "stderr": done.stderr}))
        tmp.rename(results / f"{lab}.json")
    return done


# The slowest labs first, so the two threads finish together (measured under make test on 2 cores, seconds:
# 84, 75, 70, 68, 66, 63, 61, 49, 37, 16; 10_speculative_decoding: 87 s alone at one thread on the shared
# 2-core machine at load average 5.8, placed as about 65 under make test; 11_parallelism: 48 at one thread,
# 78 on a busier machine; 12_serving: 51; 13_weight_quantization: 93 alone at one thread on a busy machine;
# 14_find_the_bottleneck: 103 at one thread at load average 7, 31 s of CPU).
SLOWEST_FIRST = ["14_find_the_bottleneck", "13_weight_quantization", "07_flash_decoding", "02_paged_kv_blocks",
                 "06_paged_attention_kernel", "09_multi_lora", "10_speculative_decoding", "04_chunked_prefill", "08_fp8_kv_cache",
                 "01_kv_cache_math", "12_serving", "03_preemption", "11_parallelism", "05_prefix_caching", "00_warmup"]
_started: dict[str, Future] = {}
_results_dir: Path | None = None  # set under pytest-xdist: where every worker finds the selftests' outcomes


def share_results_in(path: Path) -> None:
    """Under pytest-xdist (tests/conftest.py): one worker runs the selftests, every worker reads `path`."""
    global _results_dir
    path.mkdir(parents=True, exist_ok=True)
    _results_dir = path


def _claim(lab: str) -> bool:
    """True for the one process that is to run the lab's selftest (under pytest-xdist: the first to
    create `<lab>.claim` in the shared folder; elsewhere: the first caller in this process)."""
    if lab in _started:
        return False
    if _results_dir is None:
        return True
    try:
        os.close(os.open(_results_dir / f"{lab}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def start_selftests(labs: list[str]) -> list[Future]:
    """Starts these labs' selftests that no one has started, two at a time (tests/conftest.py calls it
    right after collection, so they overlap the rest of the suite)."""
    pool = ThreadPoolExecutor(max_workers=2)
    order = sorted(labs, key=lambda lab: (SLOWEST_FIRST.index(lab) if lab in SLOWEST_FIRST else -1, lab))
    futures = []
    for lab in order:
        if _claim(lab):
            _started[lab] = pool.submit(run_selftest, lab, _results_dir)
            futures.append(_started[lab])
    pool.shutdown(wait=False)
    return futures


def finished_selftest(lab: str) -> subprocess.CompletedProcess:
    """This process's run of the lab's selftest, or the one another xdist worker claimed (waiting for it)."""
    start_selftests([lab])
    if lab in _started:
        return _started[lab].result()
    path = _results_dir / f"{lab}.json"
    deadline = time.monotonic() + 2 * SELFTEST_TIMEOUT_S
    while not path.is_file():
        assert time.monotonic() < deadline, f"no selftest result for {lab} in {path.parent} (the worker running it died?)"
        time.sleep(0.5)
    data = json.loads(path.read_text())
    return subprocess.CompletedProcess([], data["returncode"], data["stdout"], data["stderr"])


@functools.cache
def selftest(lab: str) -> dict:
    done = finished_selftest(lab)
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
@pytest.mark.selftest
def test_solution_passes_every_test(lab):
    results = selftest(lab)["solution"]
    # gpu/perf tests are skipped without CUDA: the plugin says so; anything else must pass
    bad = [r for r in results if r["status"] != "passed" and not (r["status"] == "skipped" and "CUDA" in r["message"])]
    assert results and not bad, f"{lab}: tests that do not pass on the solution:\n{describe(bad)}"


@pytest.mark.parametrize("lab", LABS)
@pytest.mark.selftest
def test_stub_fails_every_graded_test(lab):
    stub = selftest(lab)["stub"]
    assert stub is not None, f"labs/{lab}/{lab}.ipynb is missing: run `make labs`"
    graded_passing = [r for r in stub if r["max_points"] > 0 and r["status"] == "passed"]
    assert not graded_passing, f"{lab}: graded tests that pass on the empty stub:\n{describe(graded_passing)}"


@pytest.mark.parametrize("lab", LABS)
@pytest.mark.selftest
def test_planted_bugs_are_caught(lab):
    bugs = selftest(lab)["bugs"]
    assert bugs, f"{lab}: grader/labtests/lab{lab}_bugs.py plants no bug"
    stale = {name: r for name, r in bugs.items() if isinstance(r, str)}
    assert not stale, f"{lab}: planted bugs whose text is not in the solution: {stale}"
    missed = [name for name, results in bugs.items()
              if not any(r["status"] == "failed" and r["max_points"] > 0 for r in results)]
    assert not missed, f"{lab}: planted bugs no graded test catches: {missed}"


def plugged_tests(lab: str) -> set[str]:
    """The tests that plugged the learner's functions into the engine in the solution's run."""
    return {p["test"] for p in selftest(lab)["plugs"]}


def not_cuda_skipped(results: list[dict]) -> list[dict]:
    return [r for r in results if not (r["status"] == "skipped" and "CUDA" in r["message"])]


@pytest.mark.parametrize("lab", SEAMED_LABS)
@pytest.mark.selftest
def test_end_to_end_tests_call_every_plugged_function(lab):
    """Each end_to_end test plugs the learner's functions and the engine calls every one of them."""
    report = selftest(lab)
    assert report["end_to_end"], f"{lab}: no test is marked end_to_end"
    for test in report["end_to_end"]:
        plugs = [p for p in report["plugs"] if p["test"] == test]
        assert plugs, f"{lab}: {test} never plugged the learner's functions"
        calls: dict[str, int] = {}
        for p in plugs:  # a test may run several configurations, each in its own plug
            for name, n in p["calls"].items():
                calls[name] = calls.get(name, 0) + n
        uncalled = sorted(name for name, n in calls.items() if n == 0)
        assert not uncalled, f"{lab}: in {test} the engine never called the plugged {uncalled}"


# Tests that cannot take the engine's functions as the student, and why.
ENGINE_AS_STUDENT_EXEMPT = {
    # they count launches of the learner's own kernel, `paged_decode_kernel`, which the engine does not have
    "06_paged_attention_kernel": {"test_decode_one_block", "test_decode_block_table_gather", "test_decode_gqa",
                                  "test_decode_lengths_and_block_sizes", "test_decode_fp16_and_strided_query"},
    # the same: they count launches of `split_decode_kernel` and read what the launcher hands to `merge_partials`
    "07_flash_decoding": {"test_split_kernel_partials_and_lse", "test_split_kernel_1_to_16_splits",
                          "test_split_kernel_gqa_fp16_strided", "test_split_kernel_empty_row",
                          "test_split_kernel_fp16_keeps_fp32_partials"},
    # the same: they count launches of `flash_attention_kernel`
    "18_flash_attention": {"test_kernel_one_sequence", "test_kernel_varlen_with_prefix", "test_kernel_gqa",
                           "test_kernel_fp16_and_strided_query"},
}


@pytest.mark.parametrize("lab", SEAMED_LABS)
@pytest.mark.selftest
def test_the_engines_own_functions_pass_the_labs_unit_tests(lab):
    """The tests and the engine agree: the engine's bodies of the seams, plugged as the student, pass."""
    results = not_cuda_skipped(selftest(lab)["engine"])
    bad = [r for r in results if r["status"] != "passed" and r["name"] not in ENGINE_AS_STUDENT_EXEMPT.get(lab, ())]
    assert results and not bad, f"{lab}: unit tests the engine's own functions fail:\n{describe(bad)}"


def engine_test_failures(lab: str) -> set[str]:
    results = selftest(lab)["engine_tests"]
    assert results, f"{lab}: no engine unit test ran with the solution plugged in"
    return {r["name"] for r in results if r["status"] == "failed"}


@pytest.mark.parametrize("lab", SEAMED_LABS)
@pytest.mark.selftest
def test_the_solution_passes_the_engines_unit_tests(lab):
    """The solution and the engine agree: the engine's own unit tests of these pieces pass with the
    solution's functions plugged in."""
    bad = sorted(engine_test_failures(lab))
    messages = {r["name"]: r["message"][-600:] for r in selftest(lab)["engine_tests"]}
    assert not bad, f"{lab}: engine tests failing with the solution plugged in:\n" + "\n".join(
        f"  {name}: {messages[name]}" for name in bad)


@pytest.mark.parametrize("lab", SEAMED_LABS)
@pytest.mark.selftest
def test_delegation_is_caught_in_self_grading(lab):
    """A notebook whose functions call the engine's own (captured at load) fails every plugging test with the reason."""
    plugged = plugged_tests(lab)
    results = {r["name"]: r for r in selftest(lab)["delegation"]}
    missed = [f"{name}: {results[name]['status']} {results[name]['message'][:200]}" for name in sorted(plugged)
              if results[name]["status"] != "failed" or VERDICT not in results[name]["message"]]
    assert plugged and not missed, f"{lab}: delegation not reported:\n" + "\n".join(missed)


@pytest.mark.parametrize("lab", SEAMLESS_LABS)
@pytest.mark.selftest
def test_a_seamless_lab_plugs_nothing(lab):
    """A lab graded on classes written from a blank page (grader/seams.py SEAMLESS_LABS) replaces nothing of the
    engine: none of its tests plugs, none claims to run the engine end to end, and it is graded on observations
    (batch grading verifies every check)."""
    report = selftest(lab)
    assert not report["plugs"] and not report["end_to_end"], (
        f"{lab}: a seamless lab's tests plug {sorted({p['test'] for p in report['plugs']})}, end_to_end "
        f"{report['end_to_end']}")
    assert not comparisons_left(lab_files.tests_path(lab).read_text()), f"{lab}: checks that are not observations"


@pytest.mark.parametrize("lab", [lab for lab in LABS if not comparisons_left(lab_files.tests_path(lab).read_text())])
@pytest.mark.selftest
def test_a_converted_lab_grades_the_solution_full_marks_in_batch(lab):
    """Every graded check is an observation: batch grading verifies them all outside the learner's process."""
    rows = not_cuda_skipped(selftest(lab)["batch"])
    bad = [r for r in rows if r["status"] != "passed"]
    assert rows and not bad, f"{lab}: the solution in batch grading:\n{describe(bad)}"


def check_calls(source: str) -> list[ast.Call]:
    tree = ast.parse(source)
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "grader.check"]


@pytest.mark.parametrize("lab", LABS)
def test_property_tests_are_seeded_with_the_lab_settings(lab):
    """Every `@given` test also has `@seed(N)` (the kit and the reference run see the same examples) and
    `@lab_settings(n)` (no example database, no explain phase: docs/authoring_labs.md)."""
    tree = ast.parse(lab_files.tests_path(lab).read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            names = {ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list}
            if "given" in names and not {"seed", "lab_settings"} <= names:
                bad.append(f"{node.name}: {sorted(names)}")
    assert not bad, f"{lab}: @given tests without @seed and @lab_settings:\n" + "\n".join(bad)


@pytest.mark.parametrize("lab", LABS)
def test_test_cells_name_each_official_test_once(lab):
    """Test cells are `grader.check(lab, globals(), tests=[...])` lines whose points add up: the tests' `points`
    marks are the one source, the cell's nbgrader points, the "worth" its visible check prints (its tests' tasks,
    hidden tests included) and pytest's per-task table all sum them, so a cell checks whole tasks."""
    points = {t.name: t.points for t in lab_files.official_tests(lab)}
    tasks = {t.name: t.task for t in lab_files.official_tests(lab)}
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
        for call in check_calls(cell.source.split("### BEGIN HIDDEN TESTS")[0]):  # what the learner's run prints
            visible = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "tests"))
            printed = sum(points[n] for n in visible) + _hidden_points(lab, visible)[1]
            assert printed == want, (
                f"{lab}: cell {meta.get('grade_id')} prints 'worth {printed:g}' (its tests' tasks: "
                f"{sorted({tasks[n] for n in visible})}), its nbgrader points are {want:g}: a cell checks whole tasks")
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
