"""benchmarks.throughput and its workload (benchmarks.workload): a small smoke run, the baseline's rules (left
padding, per-request cut); the demo (examples.continuous_batching) runs."""
from __future__ import annotations

import argparse

import pytest
import torch
import transformers

from engine_core import LLMEngine
from benchmarks.throughput import main, run_hf
from benchmarks.workload import (add_workload_args, make_prompts, make_workload, parse_range, run_engine, token_agreement,
                                 workload_from_args)
from engine_core.presets import preset_path


def test_parse_range():
    assert parse_range("16:512") == (16, 512) and parse_range("8") == (8, 8)
    for bad in ("0:4", "9:3"):
        with pytest.raises(ValueError, match="1 <= A <= B"):
            parse_range(bad)


def test_workload_is_reproducible_and_in_range():
    a, b = make_workload(20, (3, 9), (2, 5), 512, seed=1), make_workload(20, (3, 9), (2, 5), 512, seed=1)
    assert a == b and a != make_workload(20, (3, 9), (2, 5), 512, seed=2)
    assert all(3 <= len(p) <= 9 and all(3 <= t < 512 for t in p) for p in a.prompts)
    assert all(2 <= n <= 5 for n in a.output_lens) and a.num_output_tokens == sum(a.output_lens)


def test_every_benchmark_draws_the_same_prompts_from_the_same_flags():
    """fp8_accuracy's prompts (make_prompts) are the throughput workload's for the same seed and lengths, and
    the shared flags give the workload they describe; a bad --num-requests is refused by name."""
    assert make_prompts(7, (3, 9), 512, seed=4) == make_workload(7, (3, 9), (1, 50), 512, seed=4).prompts
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    a = ap.parse_args(["--num-requests", "5", "--input-len", "2:6", "--output-len", "3", "--seed", "9"])
    assert workload_from_args(a, 100) == make_workload(5, (2, 6), (3, 3), 100, seed=9)
    with pytest.raises(ValueError, match="--num-requests must be >= 1, got 0"):
        workload_from_args(ap.parse_args(["--num-requests", "0"]), 100)


def test_hf_baseline_and_engine_agree_token_for_token():
    """Left-padded static batches, each output cut to its own length, give the engine's greedy tokens."""
    w = make_workload(6, (2, 30), (1, 7), 512, seed=3)
    engine = LLMEngine.from_kwargs("tiny-llama", num_gpu_blocks=64)
    engine_out = run_engine(engine, w)
    hf = transformers.AutoModelForCausalLM.from_pretrained(preset_path("tiny-llama"), dtype=torch.float32).eval()
    hf_out = run_hf(hf, w, batch_size=4, pad_id=0)
    assert [len(o) for o in hf_out] == w.output_lens == [len(o) for o in engine_out]
    assert token_agreement(engine_out, hf_out) == 1.0, (engine_out, hf_out)


def test_agreement_counts_up_to_the_first_difference():
    assert token_agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5


def test_smoke_run_prints_both_sides_and_the_ratio(capsys):
    r = main(["--model", "tiny-llama", "--num-requests", "5", "--input-len", "4:24", "--output-len", "2:6",
              "--hf-batch-sizes", "2,4", "--threads", str(torch.get_num_threads()), "--repeats", "2"])
    text = capsys.readouterr().out
    assert "[run 2] engine " in text and "[run 2] HF generate, batch   2" in text and "HF generate, batch   4" in text
    assert r["hf_best_batch_size"] in (2, 4) and r["ratio"] == pytest.approx(r["engine_tok_s"] / r["hf_tok_s"])
    assert "token agreement with the engine 100.0%" in text


def test_demo_prints_the_metrics_table_and_writes_the_plot(tmp_path, capsys):
    from examples import continuous_batching

    out = tmp_path / "demo.png"
    continuous_batching.main(["--num-requests", "8", "--num-gpu-blocks", "40", "--out", str(out)])
    text = capsys.readouterr().out
    for row in ("output throughput", "TTFT p50 / p90 / p99", "TPOT p50 / p90 / p99", "KV usage mean / peak"):
        assert row in text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
