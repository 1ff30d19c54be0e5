"""`make gpu-compile` inside `make test`: every kernel specialization the engine and the labs launch compiles
for sm_75 .. sm_120 without a GPU, with no spill, shared memory within each target's limit and registers within
each kernel's budget (benchmarks/gpu_compile.py, cases in benchmarks/gpu_kernels.py). And the check fails when
it should: planted failures (an fp8e4nv cache on sm_80, a tile too big for shared memory, a register budget
exceeded) and an empty table.

The matrix runs in a subprocess without TRITON_INTERPRET (the CPU tests' interpreter decorates kernels that
cannot be compiled). Results are cached on disk by kernel source, specialization, target and triton version
(~/.cache/inference-labs/gpu-compile): a warm run compiles nothing; a cold one a few minutes on 2 cores.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from grader.without_triton import REASON as NO_TRITON
from grader.without_triton import triton_installed

ROOT = Path(__file__).resolve().parents[2]
# The compiler is triton's (its bundled ptxas): no triton, nothing to compile with (a Mac).
pytestmark = pytest.mark.skipif(not triton_installed(), reason=NO_TRITON)


def _matrix(*args: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if cache is not None:
        env["GPU_COMPILE_CACHE"] = str(cache)
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_compile", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)


@pytest.mark.slow
def test_every_kernel_compiles_on_every_target() -> None:
    """The issue's five generations (T4 .. H100/H200); `make gpu-compile` adds sm_100 and sm_120."""
    result = _matrix("--quiet", "--targets", "75,80,86,89,90")
    assert result.returncode == 0, f"{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert "gpu-compile: PASS" in result.stdout and " 0 errors" in result.stdout, result.stdout[-3000:]


PLANTED = '''
import triton
import triton.language as tl
import torch

from benchmarks.gpu_compile import Case, Launch
from benchmarks.gpu_kernels import QWEN3, decode


@triton.jit
def big_tile_kernel(a_ptr, b_ptr, c_ptr, K, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.arange(0, BLOCK)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK, BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + r[:, None] * K + (k0 + k)[None, :])
        b = tl.load(b_ptr + (k0 + k)[:, None] * BLOCK + r[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + r[:, None] * BLOCK + r[None, :], acc)


@triton.jit
def small_kernel(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) * 2, mask=i < n)


CASES = [
    # the engine before fp8 KV learned integer conversion: the cache's own fp8 type on every GPU
    Case("planted fp8 cache everywhere", 255, lambda cap: decode(QWEN3, torch.bfloat16, "fp8_e4m3", 1, 89)),
    Case("planted big tile", 255, lambda cap: Launch(big_tile_kernel, dict(a_ptr="*fp16", b_ptr="*fp16",
                                                     c_ptr="*fp32"), dict(BLOCK=128, BLOCK_K=128), 8, 4)),
    Case("planted budget", 4, lambda cap: Launch(small_kernel, dict(x_ptr="*fp32"), dict(BLOCK=256))),
]
'''


@pytest.mark.slow
def test_planted_failures_fail_the_check(tmp_path: Path) -> None:
    cases = tmp_path / "planted.py"
    cases.write_text(textwrap.dedent(PLANTED))
    result = _matrix("--no-registry", "--cases", str(cases), "--targets", "75,80", "--jobs", "1",
                     cache=tmp_path / "cache")
    out = result.stdout
    assert result.returncode == 1, out[-4000:] + result.stderr[-3000:]
    assert "FAIL planted fp8 cache everywhere on sm_80 (A100, A30): does not compile" in out and "fp8e4nv" in out, out
    assert "FAIL planted big tile on sm_80 (A100, A30):" in out and "over the 166912 B a block may use" in out, out
    assert "FAIL planted budget on sm_80 (A100, A30):" in out and "over its budget of 4" in out, out
    assert "gpu-compile: FAIL" in out


def test_an_empty_table_fails(tmp_path: Path) -> None:
    result = _matrix("--no-registry", "--targets", "80", cache=tmp_path / "cache")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "an empty table proves nothing" in result.stdout, result.stdout
