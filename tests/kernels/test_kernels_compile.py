"""The kernels compile for a real GPU (sm_90), even on a machine without one.

The CPU tests run the interpreter, which accepts code the GPU compiler rejects; this runs
aot_compile.py (Triton to PTX, then the wheel's bundled ptxas) in a subprocess without
TRITON_INTERPRET, so the kernels are decorated for compilation. Triton's on-disk cache makes
reruns of unchanged kernels fast; the first run compiles ~15 variants (~20 s of CPU).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90() -> None:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file():
        pytest.skip(f"this triton wheel has no bundled ptxas at {ptxas}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("aot_compile.py")
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-3000:]}"
