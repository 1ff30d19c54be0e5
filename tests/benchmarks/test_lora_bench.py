"""The multi-LoRA benchmark runs end to end (tiny sizes) and prints its table; the GPU line says
why it skips where there is no GPU."""
from __future__ import annotations

import pytest
import torch

from benchmarks import lora as bench


def test_smoke_run_prints_the_table(capsys: pytest.CaptureFixture) -> None:
    rows = bench.main(["--model", "tiny-llama", "--num-adapters", "1,2", "--num-requests", "3", "--input-len", "4:8",
                       "--output-len", "2:3", "--threads", "1"])
    assert [r["adapters"] for r in rows] == [0, 1, 2]
    out = capsys.readouterr().out
    assert "| base model only |" in out and "| 2 (" in out and "disk -> host" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where there is no GPU")
def test_gpu_line_skips_with_a_reason(capsys: pytest.CaptureFixture) -> None:
    assert bench.main(["--device", "cuda"]) == []
    assert "no CUDA device" in capsys.readouterr().out


def test_zipf_assignment_prefers_the_first_adapters() -> None:
    counts = [0] * 8
    for k in bench.zipf_assignment(4000, 8, 1.0, seed=0):
        counts[k] += 1
    # P(k) = 1 / ((k + 1) H_8): adapter 0 is drawn 4x as often as adapter 3 (1470 vs 368 expected)
    assert counts[0] > 3 * counts[3] and min(counts) > 0, counts
