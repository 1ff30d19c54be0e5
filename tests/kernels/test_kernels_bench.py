"""benchmarks.kernels' verdicts (the three GPU acceptance lines) and its behaviour without a GPU."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import kernels as bench
from kernels.split_policy import choose_num_splits

GB = 1.0  # every fake row moves 1 GB, so GB/s = 1e6 / triton_us


def _rows(b64_us: float, b1_split1_us: float, b1_pick: tuple[int, float], fp8_us: float) -> list[bench.Row]:
    pick = b1_pick[0]
    return [bench.Row("decode", "B=64 ctx=4096", 1, 1, b64_us, None, GB, 0.0),
            bench.Row("decode", "B=64 ctx=4096", 1, 1, fp8_us, None, GB / 2, 0.0, "fp8_e4m3"),
            bench.Row("decode", "B=1 ctx=32768", 1, pick, b1_split1_us, None, GB, 0.0),
            bench.Row("decode", "B=1 ctx=32768", pick, pick, b1_pick[1], None, GB, 0.0),
            bench.Row("decode", "B=1 ctx=32768", 64, pick, 100.0, None, GB, 0.0)]  # the sweep's fastest


def test_acceptance_passes_at_70_percent_of_copy_bandwidth_a_faster_split_and_fp8_at_1_5x() -> None:
    # 1 GB in 350 us = 2857 GB/s = 71% of 4000 GB/s; split 16 is faster than split 1; fp8 350/200 = 1.75x.
    checks = bench.acceptance(_rows(350.0, 900.0, (16, 120.0), 200.0), copy_gbps=4000.0)
    assert [ok for _, ok in checks] == [True, True, True], checks
    assert "fastest: num_splits=64 100.0 us" in checks[1][0] and "1.75x the bf16 speed on 0.50x the bytes" in checks[2][0]


def test_acceptance_fails_below_70_percent_a_slower_split_or_fp8_under_1_5x() -> None:
    # 1 GB in 400 us = 2500 GB/s = 62.5% of 4000; the policy's split is slower than split 1 (though the
    # sweep found a faster one: the policy is what the engine runs); fp8 400/300 = 1.33x.
    checks = bench.acceptance(_rows(400.0, 900.0, (16, 950.0), 300.0), copy_gbps=4000.0)
    assert [ok for _, ok in checks] == [False, False, False], checks


def test_a_policy_that_never_splits_fails_the_flash_decoding_line() -> None:
    checks = bench.acceptance(_rows(350.0, 900.0, (1, 900.0), 200.0), copy_gbps=4000.0)
    assert [ok for _, ok in checks] == [True, False, True], checks


@pytest.mark.parametrize("num_seqs, max_seq_len, expected", [
    (1, 32768, 64),  # 8 programs: 32 splits give 256 < 2 * 132, so 64; 32k / 64 = 512 tiles allow it
    (64, 4096, 1),  # 512 programs already fill 132 SMs twice over
    (1, 512, 2),  # only 8 tiles: splits of >= 4 tiles caps it at 2
])
def test_split_heuristic(num_seqs: int, max_seq_len: int, expected: int) -> None:
    assert choose_num_splits(num_seqs, 8, max_seq_len, num_sms=132) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where there is no GPU")
@pytest.mark.parametrize("args", [[], ["--acceptance", "--repeats", "5"], ["--quant"]])
def test_without_cuda_it_exits_with_a_clear_message(capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    assert bench.main(args) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [(["--repeats", "0"], "--repeats must be >= 1"),
                                           (["--acceptance=yes"], "ignored explicit argument")])
def test_bad_arguments_are_refused_before_looking_for_a_gpu(capsys: pytest.CaptureFixture[str], args: list[str],
                                                            message: str) -> None:
    with pytest.raises(SystemExit):
        bench.main(args)
    assert message in capsys.readouterr().err


# ---- make gpu-check: the one command for every GPU acceptance line ------------------------------------
ROOT = Path(__file__).resolve().parents[2]
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def _make_gpu_check(*flags: str) -> subprocess.CompletedProcess[str]:
    """`make gpu-check` with this interpreter and without (re)building .venv (-o venv)."""
    return subprocess.run(["make", "-s", "-o", "venv", *flags, "gpu-check", f"PY={sys.executable}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


@needs_make
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where there is no GPU")
def test_gpu_check_without_cuda_stops_with_a_clear_message() -> None:
    result = _make_gpu_check()
    assert result.returncode != 0
    assert "make gpu-check: torch" in result.stderr and "sees no CUDA device" in result.stderr, result.stderr
    assert "pytest" not in result.stdout + result.stderr  # nothing ran after the check


@needs_make
def test_gpu_check_runs_test_files_that_exist_and_the_acceptance_benchmark() -> None:
    commands = _make_gpu_check("-n").stdout
    pytest_line = next(line for line in commands.splitlines() if " -m pytest " in line)
    paths = pytest_line.split("no:cacheprovider", 1)[1].split("||")[0].split()
    assert paths and all((ROOT / p).exists() for p in paths), paths
    assert "-m benchmarks.kernels --acceptance" in commands
    assert "-m benchmarks.kernels --quant" in commands  # the W4A16 / fp8 GEMM lines (benchmarks/quant_kernels.py)
    limits = [int(t) for line in commands.splitlines() for a, t in zip(line.split(), line.split()[1:]) if a == "timeout"]
    assert "-m benchmarks.allreduce --backend nccl" in commands  # the NCCL line (skips below two GPUs)
    assert len(limits) == 4 and sum(limits) <= 300, limits  # one command under 5 minutes, whatever hangs


# ---- --quant: the weight-quantized GEMM lines (benchmarks/quant_kernels.py) ------------------------------
def test_quant_acceptance_needs_1_5x_for_w4a16_and_1_3x_for_fp8_at_m1() -> None:
    from benchmarks.quant_kernels import QuantRow, acceptance
    rows = [QuantRow(1, 30.0, 19.0, 22.0), QuantRow(256, 60.0, 90.0, 40.0)]  # 1.58x and 1.36x at M = 1
    assert [ok for _, ok in acceptance(rows)] == [True, True]
    rows = [QuantRow(1, 30.0, 21.0, 24.0), QuantRow(256, 60.0, 30.0, 20.0)]  # 1.43x and 1.25x: M = 256 does not count
    assert [ok for _, ok in acceptance(rows)] == [False, False]
