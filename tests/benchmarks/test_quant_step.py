"""benchmarks/quant_step.py runs end to end on tiny-llama (two schemes, two batches, one step): every point timed,
the roofline and crossovers computed, the weight bytes the engines' own."""
from __future__ import annotations

import torch

from benchmarks import quant_step


def test_quant_step_runs_and_reports_every_point(capsys) -> None:
    threads = torch.get_num_threads()
    try:
        result = quant_step.main(["--model", "tiny-llama", "--schemes", "bf16,fp8", "--batches", "1,3", "--steps", "1",
                                  "--threads", "1", "--bandwidth", "10"])
    finally:
        torch.set_num_threads(threads)
    assert set(result["median_s"]) == {"bf16", "fp8"}
    assert all(set(per) == {1, 3} and min(per.values()) > 0 for per in result["median_s"].values())
    assert result["weight_bytes"]["fp8"] < result["weight_bytes"]["bf16"]
    assert set(result["crossover"]) == {"fp8 vs bf16"}
    out = capsys.readouterr().out
    assert "| M | bf16 | fp8 |" in out and "AVX512-BF16" in out  # the CPU's flags beside the table
