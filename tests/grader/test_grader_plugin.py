"""`pytest labs/NN_name` / `pytest solutions/NN_name`: official tests, points table, markers."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grader.labs import REPO_ROOT


def run_pytest(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def test_solution_passes_with_full_points_from_the_repo_root():
    done = run_pytest("solutions/00_warmup")
    assert done.returncode == 0, done.stdout
    assert "solutions/00_warmup/00_warmup.ipynb ....." in done.stdout
    assert "points per task" in done.stdout
    assert "num_blocks_needed  4 / 4" in done.stdout


def test_stub_fails_with_zero_points_from_inside_the_folder():
    done = run_pytest(cwd=REPO_ROOT / "labs" / "00_warmup")
    assert done.returncode == 1, done.stdout
    assert "5 failed" in done.stdout
    assert "num_blocks_needed  0 / 4" in done.stdout
    assert "cell 4 of 00_warmup.ipynb" in done.stdout  # the traceback points at the notebook cell


def test_a_notebook_that_delegates_to_the_engine_is_told_what_it_did(tmp_path):
    """Lab 02's solution whose get_new_blocks calls the engine's, captured before the plug-in."""
    from grader.selftest import write_delegation_notebook

    lab = "02_paged_kv_blocks"
    write_delegation_notebook(lab, tmp_path / lab / f"{lab}.ipynb")
    done = run_pytest("-p", "grader.plugin", lab, "-k", "takes_the_front or counts_references", cwd=tmp_path)
    assert done.returncode == 1, done.stdout
    assert "uses the reference implementation: the engine's own BlockPool.get_new_blocks" in done.stdout
    assert "uses the reference implementation: the engine's own BlockPool.free_blocks" in done.stdout
    assert re.search(r"^total +0 / 4$", done.stdout, re.M), done.stdout


def test_the_projects_own_run_never_collects_labs_or_solutions():
    """testpaths=["tests"]: with every test module ignored, nothing else may be collected."""
    done = run_pytest("--collect-only", "-q", "--ignore-glob=tests/*")
    assert "labs/" not in done.stdout and "solutions/" not in done.stdout, done.stdout
    assert done.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, done.stdout


def test_gpu_and_perf_tests_skip_with_a_reason_without_cuda(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the skip path is what is under test")
    (tmp_path / "test_marked.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.gpu
        @pytest.mark.points(2)
        def test_needs_gpu():
            raise AssertionError("must not run without CUDA")

        @pytest.mark.perf
        @pytest.mark.points(1)
        @pytest.mark.task("speed")
        def test_needs_perf():
            raise AssertionError("must not run without CUDA")

        @pytest.mark.points(3)
        def test_plain():
            pass
    """))
    done = run_pytest("-p", "grader.plugin", "-rs", "test_marked.py", cwd=tmp_path)
    assert done.returncode == 0, done.stdout
    assert "`gpu` test: needs a CUDA device" in done.stdout
    assert "`perf` test: needs a CUDA device" in done.stdout
    assert re.search(r"^total +3 / 6$", done.stdout, re.M), done.stdout  # skipped tests earn nothing
