"""The kit where triton is not installed (a Mac: triton publishes Linux wheels only).

The stand-in and the reports are tested everywhere. The labs are tested where triton is truly absent:
`make test-notriton` runs this file in .venv-notriton (.venv's packages without triton). There every lab's
solution passes each test or skips it with the reason (a Triton task) or for want of CUDA, the released stub
still fails each graded test that is not skipped, and nothing errors.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

from grader.check import check
from grader import labs as lab_files
from grader.labs import REPO_ROOT
from grader.release import solution_labs
from grader.results import SKIPPED, TestResult, format_points_table
from grader.without_triton import REASON, ROUTES, MissingKernel, TritonMissing, is_triton_skip, tl, triton, \
    triton_installed

LABS = solution_labs()
# The labs with Triton tasks: their official tests use triton (a kernel, or kernels.triton); those tests are
# marked `triton`, and a lab whose tests use triton without the mark fails below.
TRITON_LABS = {lab for lab in LABS if "triton" in lab_files.tests_path(lab).read_text()}
needs_no_triton = pytest.mark.skipif(triton_installed(), reason="triton is installed here: `make test-notriton` "
                                                                 "runs this in .venv-notriton")
# One lab's official tests on its solution and (argv[2:]) its released stub, in a fresh interpreter (as a learner
# runs them).
GRADE = """
import json, sys
from grader.loader import load_notebook
from grader.runner import run_tests
lab = sys.argv[1]
out = {}
for side in sys.argv[2:]:
    module = load_notebook(f"{side}/{lab}/{lab}.ipynb")
    out[side] = [r.to_dict() for r in run_tests(lab, lambda: module)]
print(json.dumps(out))
"""


def test_a_kernel_defined_without_triton_reads_but_raises_with_the_routes_when_launched():
    @triton.jit
    def kernel(x_ptr, BLOCK: tl.constexpr):
        pass

    assert isinstance(kernel, MissingKernel) and kernel.__name__ == "kernel"
    with pytest.raises(TritonMissing, match="Triton needs Linux.*docs/hosted.md"):
        kernel[(1,)](None, BLOCK=16)
    assert issubclass(TritonMissing, ImportError)  # `except ImportError` handlers see it
    assert [triton.next_power_of_2(n) for n in (1, 5, 16, 17)] == [1, 8, 16, 32] and triton.cdiv(17, 16) == 2


def test_the_points_table_and_check_say_why_a_triton_task_earns_nothing(capsys, monkeypatch):
    skipped = TestResult("test_kernel", "kernel", 3, SKIPPED, f"{REASON} ({ROUTES})")
    table = format_points_table([TestResult("test_math", "math", 2), skipped])
    assert "kernel  0 / 3   (1 test not gradable here: Triton needs Linux)" in table, table
    assert is_triton_skip(skipped.message) and not is_triton_skip("`gpu` test: needs a CUDA device")

    check_module = importlib.import_module("grader.check")  # the package's `grader.check` is the function
    monkeypatch.setattr(check_module, "run_tests", lambda lab, provider, tests: [skipped])
    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    check("00_warmup", {}, raise_on_failure=None)  # outside nbgrader a Triton skip alone is no failure
    out = capsys.readouterr().out
    assert f"[LINUX] test_kernel (3 pts): {REASON}" in out and ROUTES in out, out
    monkeypatch.setenv("NBGRADER_EXECUTION", "autograde")  # at submission the cell earns 0, as a GPU-only one
    with pytest.raises(AssertionError, match="did not pass: test_kernel"):
        check("00_warmup", {})


@needs_no_triton
def test_the_kernels_say_where_triton_runs():
    import torch

    import kernels
    with pytest.raises(ModuleNotFoundError, match="Linux wheels only.*backend='cpu' or 'torch'"):
        kernels.resolve_backend("triton", torch.device("cpu"))
    with pytest.raises(ModuleNotFoundError, match="Linux wheels only.*docs/hosted.md"):
        import kernels.triton.decode_attention  # noqa: F401


@needs_no_triton
@pytest.mark.parametrize("lab", LABS)
def test_every_lab_grades_without_triton(lab):
    """Solution: each test passes, or skips with the reason (Triton tasks) or for want of CUDA. Stub of a lab with
    Triton tasks: each graded test that is not skipped fails (its other tasks still grade), each Triton test skips
    with the reason (the other labs' stubs never meet triton: the selftest checks them)."""
    sides = ["solutions", "labs"] if lab in TRITON_LABS else ["solutions"]
    done = subprocess.run([sys.executable, "-c", GRADE, lab, *sides], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, f"{lab}: grading crashed without triton:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    results = json.loads(done.stdout.strip().splitlines()[-1])

    def elsewhere(r: dict) -> bool:
        return r["status"] == SKIPPED and (is_triton_skip(r["message"]) or "CUDA" in r["message"])

    bad = [f"{r['name']}: {r['status']} {r['message'][:300]}" for r in results["solutions"]
           if r["status"] != "passed" and not elsewhere(r)]
    assert not bad, f"{lab}: the solution without triton:\n" + "\n".join(bad)
    no_triton = [r["name"] for r in results["solutions"] if is_triton_skip(r["message"])]
    assert bool(no_triton) == (lab in TRITON_LABS), f"{lab}: tests skipped for want of triton: {no_triton}"
    assert any(r["status"] == "passed" and r["max_points"] > 0 for r in results["solutions"]), f"{lab}: nothing graded"
    if lab not in TRITON_LABS:
        return
    stub = {r["name"]: r for r in results["labs"]}
    passing = [n for n, r in stub.items() if r["max_points"] > 0 and r["status"] == "passed"]
    assert not passing, f"{lab}: graded tests that pass on the empty stub without triton: {passing}"
    not_skipped = [n for n in no_triton if not is_triton_skip(stub[n]["message"])]
    assert not not_skipped, f"{lab}: Triton tests that do not skip with the reason on the stub: {not_skipped}"
