"""The engine's memory model against hand arithmetic on public configs and Hugging Face's own parameter count."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config

from engine_core import memory

# Public config.json values (the fields that matter), as published on the Hugging Face Hub.
LLAMA2_70B = dict(model_type="llama", num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
                  num_key_value_heads=8, intermediate_size=28672, vocab_size=32000, tie_word_embeddings=False)
LLAMA3_8B = dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)
QWEN3_06B = dict(model_type="qwen3", num_hidden_layers=28, hidden_size=1024, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                 tie_word_embeddings=True, attention_bias=False)
MIXTRAL_8X7B = dict(model_type="mixtral", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                    num_key_value_heads=8, intermediate_size=14336, vocab_size=32000, num_local_experts=8,
                    num_experts_per_tok=2, tie_word_embeddings=False)

# Parameters by hand: per layer q,k,v,o + gate,up,down (+ router, x experts) + 2 norms; embeddings; final norm.
LLAMA2_70B_PARAMS = (80 * (8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672 + 2 * 8192)
                     + 2 * 32000 * 8192 + 8192)
LLAMA3_8B_PARAMS = (32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096)
                    + 2 * 128256 * 4096 + 4096)
# Qwen3: 16 query heads of 128 (2048 wide) on a 1024 residual, q/k RMSNorm (2 x 128), one tied embedding.
QWEN3_06B_PARAMS = (28 * (1024 * (2048 + 2 * 1024) + 2048 * 1024 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128)
                    + 151936 * 1024 + 1024)
MIXTRAL_PARAMS = (32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 8 * 3 * 4096 * 14336 + 4096 * 8 + 2 * 4096)
                  + 2 * 32000 * 4096 + 4096)

CASES = [  # config, params, KV bytes per token in 16 bits = 2 (K,V) x layers x kv_heads x head_dim x 2 bytes
    (LLAMA2_70B, LLAMA2_70B_PARAMS, 2 * 80 * 8 * 128 * 2),
    (LLAMA3_8B, LLAMA3_8B_PARAMS, 2 * 32 * 8 * 128 * 2),
    (QWEN3_06B, QWEN3_06B_PARAMS, 2 * 28 * 8 * 128 * 2),
    (MIXTRAL_8X7B, MIXTRAL_PARAMS, 2 * 32 * 8 * 128 * 2),
]
IDS = ["llama2-70b", "llama3-8b", "qwen3-0.6b", "mixtral-8x7b"]


def test_published_headline_numbers() -> None:
    """The hand formulas reproduce the counts the model cards publish, and the interview slip."""
    assert LLAMA2_70B_PARAMS == 68_976_648_192
    assert LLAMA3_8B_PARAMS == 8_030_261_248
    assert QWEN3_06B_PARAMS == 596_049_920
    assert MIXTRAL_PARAMS == 46_702_792_704
    assert memory.kv_cache_bytes_per_token(LLAMA2_70B, "fp16") == 327_680 == 320 * 1024  # not "640 KB"


@pytest.mark.parametrize("config,params,kv16", CASES, ids=IDS)
def test_exact_public_config_values(config: dict, params: int, kv16: int) -> None:
    for dtype, nbytes in (("fp32", 4), (torch.bfloat16, 2), ("fp16", 2), ("fp8", 1)):
        assert memory.kv_cache_bytes_per_token(config, dtype) == kv16 // 2 * nbytes
        assert memory.weight_bytes(config, dtype) == params * nbytes
    assert memory.num_params(config) == params


def test_mixtral_active_params() -> None:
    """One token runs through 2 of 8 experts: about 12.9B of 46.7B parameters."""
    expert = 3 * 4096 * 14336
    assert memory.num_params(MIXTRAL_8X7B, active_only=True) == MIXTRAL_PARAMS - 32 * 6 * expert
    assert memory.num_params(LLAMA3_8B, active_only=True) == LLAMA3_8B_PARAMS


def _hf_count(config) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


@pytest.mark.parametrize("config", [
    LlamaConfig(**{k: v for k, v in LLAMA2_70B.items() if k != "model_type"}),
    MixtralConfig(**{k: v for k, v in MIXTRAL_8X7B.items() if k != "model_type"}),
    Qwen3Config(**{k: v for k, v in QWEN3_06B.items() if k != "model_type"}),
    Qwen2Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100),  # q/k/v bias, no o bias
    LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, vocab_size=100, attention_bias=True, tie_word_embeddings=True),
    Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, vocab_size=100, attention_bias=True),
], ids=["llama2-70b", "mixtral-8x7b", "qwen3-0.6b", "qwen2-bias", "llama-bias-tied", "qwen3-bias"])
def test_num_params_matches_transformers(config) -> None:
    """An independent reference: the parameters Hugging Face's own modules allocate (on meta)."""
    assert memory.num_params(config) == _hf_count(config)


_CONFIG_CLASSES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mixtral": MixtralConfig}


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(sorted(_CONFIG_CLASSES)), layers=st.integers(1, 3), kv_heads=st.sampled_from([1, 2, 4]),
       group=st.integers(1, 3), head_dim=st.sampled_from([8, 16]), inter=st.integers(8, 64), vocab=st.integers(10, 90),
       tied=st.booleans(), bias=st.booleans(), experts=st.integers(2, 4))
def test_num_params_matches_transformers_on_random_shapes(kind, layers, kv_heads, group, head_dim, inter, vocab, tied,
                                                          bias, experts) -> None:
    """Any small shape of each family: the count equals what Hugging Face's modules allocate."""
    heads = kv_heads * group
    kwargs = dict(num_hidden_layers=layers, hidden_size=heads * head_dim + 8 * (kind == "qwen3"),
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tied)
    if kind in ("llama", "qwen3"):
        kwargs["attention_bias"] = bias
    if kind == "mixtral":
        kwargs.update(num_local_experts=experts, num_experts_per_tok=2)
    config = _CONFIG_CLASSES[kind](**kwargs)
    assert memory.num_params(config) == _hf_count(config)


def test_activation_bytes_by_hand() -> None:
    """Residual + normed copy (2 h) and gate, up, activated (3 i, x top-k experts) per token, >= 16 bits."""
    assert memory.activation_bytes(LLAMA3_8B, "bf16", 8192) == 8192 * (2 * 4096 + 3 * 14336) * 2
    assert memory.activation_bytes(LLAMA3_8B, "fp8", 100) == 100 * (2 * 4096 + 3 * 14336) * 2
    assert memory.activation_bytes(LLAMA3_8B, "fp32", 100) == 100 * (2 * 4096 + 3 * 14336) * 4
    assert memory.activation_bytes(MIXTRAL_8X7B, "bf16", 10) == 10 * (2 * 4096 + 3 * 2 * 14336) * 2
    assert memory.activation_bytes(LLAMA3_8B, "bf16", 0) == 0


def test_prefill_flops_by_hand() -> None:
    n = 2048
    matmul = LLAMA3_8B_PARAMS - 128256 * 4096 - 32 * 2 * 4096 - 4096 - 128256 * 4096  # layers' matmuls only
    flops = 2 * matmul * n + 2 * 128256 * 4096 + 4 * 32 * 32 * 128 * n * (n + 1) / 2
    assert memory.prefill_flops(LLAMA3_8B, n) == pytest.approx(flops, rel=1e-12)
    # Cached context: 10 new tokens after 100 cached ones attend 101..110 keys.
    extra = 4 * 32 * 32 * 128 * sum(range(101, 111))
    assert memory.prefill_flops(LLAMA3_8B, 10, context_start=100) == \
        pytest.approx(2 * matmul * 10 + 2 * 128256 * 4096 + extra, rel=1e-12)


def test_recompute_and_swap_costs() -> None:
    """Recompute is the prefill's FLOPs over a rate; swap is the KV twice over the link."""
    assert memory.swap_seconds(LLAMA2_70B, 1000, "fp16", 64e9) == pytest.approx(2 * 1000 * 327_680 / 64e9)
    assert memory.recompute_seconds(LLAMA3_8B, 100, 1e12) == pytest.approx(memory.prefill_flops(LLAMA3_8B, 100) / 1e12)


def test_dtype_bytes_rejects_unknown_names() -> None:
    assert memory.dtype_bytes(torch.float8_e4m3fn) == 1
    with pytest.raises(ValueError, match="dtype"):
        memory.dtype_bytes("int4")


