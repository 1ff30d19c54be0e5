"""kernels.bench's verdicts (the two GPU acceptance lines) and its behaviour without a GPU."""
from __future__ import annotations

import pytest
import torch

from kernels import bench
from kernels.split_policy import choose_num_splits

GB = 1.0  # every fake row moves 1 GB, so GB/s = 1e6 / triton_us


def _rows(b64_us: float, b1_split1_us: float, b1_best: tuple[int, float]) -> list[bench.Row]:
    return [bench.Row("decode", "B=64 ctx=4096", 1, 1, b64_us, None, GB, 0.0),
            bench.Row("decode", "B=1 ctx=32768", 1, 16, b1_split1_us, None, GB, 0.0),
            bench.Row("decode", "B=1 ctx=32768", b1_best[0], 16, b1_best[1], None, GB, 0.0)]


def test_acceptance_passes_at_70_percent_of_copy_bandwidth_and_a_faster_split() -> None:
    # 1 GB in 350 us = 2857 GB/s = 71% of 4000 GB/s; split 16 is faster than split 1.
    checks = bench.acceptance(_rows(350.0, 900.0, (16, 120.0)), copy_gbps=4000.0)
    assert [ok for _, ok in checks] == [True, True], checks


def test_acceptance_fails_below_70_percent_or_without_a_faster_split() -> None:
    # 1 GB in 400 us = 2500 GB/s = 62.5% of 4000; the "best" split is slower than split 1.
    checks = bench.acceptance(_rows(400.0, 900.0, (16, 950.0)), copy_gbps=4000.0)
    assert [ok for _, ok in checks] == [False, False], checks


@pytest.mark.parametrize("num_seqs, max_seq_len, expected", [
    (1, 32768, 64),  # 8 programs: 32 splits give 256 < 2 * 132, so 64; 32k / 64 = 512 tiles allow it
    (64, 4096, 1),  # 512 programs already fill 132 SMs twice over
    (1, 512, 2),  # only 8 tiles: splits of >= 4 tiles caps it at 2
])
def test_split_heuristic(num_seqs: int, max_seq_len: int, expected: int) -> None:
    assert choose_num_splits(num_seqs, 8, max_seq_len, num_sms=132) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where there is no GPU")
def test_without_cuda_it_exits_with_a_clear_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
