"""benchmarks/cpu_gemm_rows.py runs end to end (one row count, one repeat) and prints the CPU line and a row per
shape; `measure.cpu_line` names the flags that choose a CPU path, yes or no, from /proc/cpuinfo's text."""
from __future__ import annotations

import torch

from benchmarks import cpu_gemm_rows
from benchmarks.measure import cpu_line
from engine_core.models.quantization.unquantized import onednn_bf16_available
from kernels.cpu.packed_gemm import packed_gemm_native

CPUINFO = "processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu avx512f avx512_vnni amx_bf16 amx_tile\n"


def test_cpu_line_says_each_flag() -> None:
    line = cpu_line(CPUINFO)
    assert line.startswith("CPU: Some Xeon, ")
    assert "AMX yes" in line and "AVX512-BF16 no" in line and "AVX512-VNNI yes" in line and "AVX-512 yes" in line
    assert "unknown CPU" in cpu_line("") and "AMX no" in cpu_line("")


def test_cpu_gemm_rows_prints_every_path(capsys) -> None:
    threads = torch.get_num_threads()
    try:
        cpu_gemm_rows.main(["--rows", "2", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert out.startswith("CPU: ")
    # the columns of the paths this CPU runs: oneDNN's bf16 where it has bf16 kernels, the AVX512-BF16 kernels
    optional = [("bf16 oneDNN | ", onednn_bf16_available()), ("bf16 packed | ", packed_gemm_native()),
                ("fp8 packed | ", packed_gemm_native())]
    cols = "".join(c for c, on in optional if on)
    assert f"| weight | M | bf16 | {cols}fp8 kernel | fp8 deq+bf16 | q4_1 kernel | q4_1 deq+bf16 |" in out
    rows = [ln for ln in out.splitlines() if ln.startswith(("| 3072x576 | 2 |", "| 576x1536 | 2 |"))]
    assert len(rows) == 2 and all(len(r.split("|")) == 9 + sum(on for _, on in optional) for r in rows)
