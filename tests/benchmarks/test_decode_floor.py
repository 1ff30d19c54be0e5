"""`make bench-floor`'s arithmetic: the bytes a batch-1 decode step reads, against a count from the presets'
shapes by hand, and one tiny run that prints every table (no timing is asserted)."""
from __future__ import annotations

import pytest

from benchmarks import decode_floor
from engine_core.engine import LLMEngine


def test_step_bytes_of_an_untied_bf16_model_match_a_count_from_its_shapes() -> None:
    """tiny-llama: 2 layers, hidden 64, MLP 128, 4 query heads and 2 KV heads of 16, vocab 512, its own LM head."""
    engine = LLMEngine.from_kwargs("tiny-llama", dtype="bfloat16")
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 2 * 128 * 64 + 64 * 128 + 2 * 64  # qkv, o, gate|up, down, 2 norms
    b = decode_floor.step_bytes(engine, context=37)
    assert b.layers == 2 * 2 * per_layer
    assert b.lm_head == 2 * (512 * 64 + 64 + 64)  # the head, the final norm, the token's embedding row
    assert b.kv == 2 * 2 * 37 * 2 * 16 * 2  # K and V, layers, tokens, KV heads, head_dim, bytes
    assert b.total == b.layers + b.lm_head + b.kv


def test_step_bytes_of_a_tied_fp32_model_count_the_embedding_once() -> None:
    """tiny-qwen3: head_dim 32 (q rows 128 != hidden), q/k norms of 32, the LM head is the embedding."""
    engine = LLMEngine.from_kwargs("tiny-qwen3", dtype="float32")
    per_layer = 64 * (128 + 2 * 64) + 128 * 64 + 2 * 128 * 64 + 64 * 128 + 2 * 64 + 2 * 32
    b = decode_floor.step_bytes(engine, context=5)
    assert (b.layers, b.lm_head, b.kv) == (4 * 2 * per_layer, 4 * (512 * 64 + 64), 2 * 2 * 5 * 2 * 32 * 4)
    # the model's own total agrees: weight_bytes counts the tied embedding once as well
    assert b.layers + b.lm_head == engine.runner.model.weight_bytes()


def test_a_tiny_run_prints_the_floor_and_phase_tables(capsys) -> None:
    decode_floor.main(["--model", "tiny-llama", "--formats", "fp32,bf16", "--threads", "1", "--rounds", "2",
                       "--input-len", "6", "--output-len", "5", "--bandwidth-mb", "8"])
    text = capsys.readouterr().out
    assert "CPU: " in text and "other processes used" in text
    floor_table, phase_table = text.split("Where a decode step's time goes")
    for fmt in ("fp32", "bf16"):
        assert f"| {fmt} | 1 |" in floor_table and f"| {fmt} | 1 |" in phase_table
    assert decode_floor.REST in phase_table


def test_an_unknown_format_is_refused_before_any_model_loads() -> None:
    with pytest.raises(ValueError, match="--formats"):
        decode_floor.main(["--model", "tiny-llama", "--formats", "fp16"])
