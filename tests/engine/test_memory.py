"""The capacity model against hand arithmetic on public configs and Hugging Face's own parameter count."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config

from engine_core import memory
from engine_core.memory import GPUS

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


def test_max_concurrent_requests_by_hand() -> None:
    # Llama-3-8B bf16 on an H100 at 90%: what is left after the weights, over 4096 tokens of KV each.
    free = 81559 * 2**20 * 0.9 - LLAMA3_8B_PARAMS * 2
    assert memory.max_concurrent_requests(GPUS["H100-80GB"].memory_bytes, 0.9, LLAMA3_8B, 4096, "bf16") == \
        int(free // (4096 * 131072))
    # Rounded up to whole 16-token blocks: 4000 tokens hold 250 blocks = 4000 tokens, 4001 hold 251.
    assert memory.max_concurrent_requests(80e9, 1.0, LLAMA3_8B, 4001, "bf16", block_size=16) == \
        int((80e9 - LLAMA3_8B_PARAMS * 2) // (4016 * 131072))
    # Llama-2-70B fp16 (138 GB of weights) does not fit on one 80 GB GPU at all.
    assert memory.max_concurrent_requests(GPUS["H100-80GB"].memory_bytes, 0.9, LLAMA2_70B, 2500, "fp16") == 0


@pytest.mark.parametrize("kwargs,name", [
    (dict(utilization=0.0), "utilization"), (dict(utilization=1.5), "utilization"),
    (dict(context_len=0), "context_len"), (dict(gpu_bytes=0), "gpu_bytes"), (dict(block_size=0), "block_size"),
])
def test_max_concurrent_requests_rejects_bad_input(kwargs: dict, name: str) -> None:
    args = dict(gpu_bytes=80e9, utilization=0.9, config=LLAMA3_8B, context_len=100, dtype="bf16") | kwargs
    with pytest.raises(ValueError, match=name):
        memory.max_concurrent_requests(**args)


def test_decode_bound_by_hand() -> None:
    """Batch 1 on Llama-2-70B is the weights over HBM bandwidth; batch 4096 at TP 1 turns compute-bound."""
    h100 = GPUS["H100-80GB"]
    weights = LLAMA2_70B_PARAMS * 2
    assert memory.decode_step_lower_bound(LLAMA2_70B, "fp16", 1, 1000, h100) == \
        pytest.approx((weights + 1000 * 327_680) / 3.35e12, rel=1e-12)
    # FLOPs per token: 2 per matmul weight (all but the 32000 x 8192 input embedding) + attention 4*80*64*128*ctx.
    matmul = LLAMA2_70B_PARAMS - 32000 * 8192 - 80 * 2 * 8192 - 8192
    flops = 4096 * (2 * matmul + 4 * 80 * 64 * 128 * 16)
    memory_s = (weights + 4096 * 16 * 327_680) / 3.35e12
    assert flops / 989e12 > memory_s
    assert memory.decode_step_lower_bound(LLAMA2_70B, "fp16", 4096, 16, h100) == pytest.approx(flops / 989e12, rel=1e-12)


def test_tensor_parallel_bounds_by_hand() -> None:
    """TP 4 reads a quarter of the weights and KV per GPU, and pays two ring all-reduces per layer,
    each 5 us of latency plus its bytes over NVLink."""
    h100 = GPUS["H100-80GB"]
    allreduce = 2 * 80 * (5e-6 + 2 * 3 / 4 * (8 * 8192 * 2) / 450e9)  # batch 8, hidden 8192, fp16
    read = (LLAMA2_70B_PARAMS * 2 / 4 + 8 * 2000 * 327_680 / 4) / 3.35e12
    assert memory.decode_step_lower_bound(LLAMA2_70B, "fp16", 8, 2000, h100, tp=4) == \
        pytest.approx(read + allreduce, rel=1e-12)
    # Llama-3-8B has 8 KV heads: at TP 16 each GPU still holds one whole head (replicated twice).
    assert memory.kv_heads_per_gpu(LLAMA3_8B, 16) == 1
    with pytest.raises(ValueError, match="tp"):
        memory.kv_heads_per_gpu(LLAMA3_8B, 3)


def test_allreduce_alpha_beta_by_hand() -> None:
    """Two all-reduces per layer, each latency + 2 (tp - 1) / tp x bytes / bandwidth; none at TP 1."""
    h100 = GPUS["H100-80GB"]
    assert h100.allreduce_latency_s == 5e-6
    assert memory.allreduce_seconds(LLAMA2_70B, "fp16", 64, h100, 1) == 0.0
    want = 2 * 80 * (5e-6 + 2 * 7 / 8 * (64 * 8192 * 2) / 450e9)
    assert memory.allreduce_seconds(LLAMA2_70B, "fp16", 64, h100, 8) == pytest.approx(want, rel=1e-12)
    # fp8 weights: the activations still travel in 16 bits; a slower link with more latency (cross-node)
    slow = dataclasses.replace(h100, nvlink_bytes_per_s=50e9, allreduce_latency_s=20e-6)
    want = 2 * 32 * (20e-6 + 2 * 15 / 16 * (1 * 4096 * 2) / 50e9)
    assert memory.allreduce_seconds(LLAMA3_8B, "fp8", 1, slow, 16) == pytest.approx(want, rel=1e-12)


def test_activation_bytes_by_hand() -> None:
    """Residual + normed copy (2 h) and gate, up, activated (3 i, x top-k experts) per token, >= 16 bits."""
    assert memory.activation_bytes(LLAMA3_8B, "bf16", 8192) == 8192 * (2 * 4096 + 3 * 14336) * 2
    assert memory.activation_bytes(LLAMA3_8B, "fp8", 100) == 100 * (2 * 4096 + 3 * 14336) * 2
    assert memory.activation_bytes(LLAMA3_8B, "fp32", 100) == 100 * (2 * 4096 + 3 * 14336) * 4
    assert memory.activation_bytes(MIXTRAL_8X7B, "bf16", 10) == 10 * (2 * 4096 + 3 * 2 * 14336) * 2
    assert memory.activation_bytes(LLAMA3_8B, "bf16", 0) == 0


def test_max_concurrent_requests_subtracts_activations_and_non_torch_memory() -> None:
    """The utilization budget holds weights, the activation peak, non-torch memory and the KV cache."""
    act = 8192 * (2 * 4096 + 3 * 14336) * 2
    free = 81559 * 2**20 * 0.9 - LLAMA3_8B_PARAMS * 2 - act - 2e9
    got = memory.max_concurrent_requests(GPUS["H100-80GB"].memory_bytes, 0.9, LLAMA3_8B, 4096, "bf16",
                                         block_size=16, max_num_batched_tokens=8192, non_torch_bytes=2e9)
    assert got == int(free // (4096 * 131072))
    for kwargs, name in ((dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
                         (dict(non_torch_bytes=-1.0), "non_torch_bytes")):
        with pytest.raises(ValueError, match=name):
            memory.max_concurrent_requests(80e9, 0.9, LLAMA3_8B, 100, "bf16", **kwargs)


def test_prefill_bound_by_hand() -> None:
    a100 = GPUS["A100-80GB"]
    n = 2048
    matmul = LLAMA3_8B_PARAMS - 128256 * 4096 - 32 * 2 * 4096 - 4096 - 128256 * 4096  # layers' matmuls only
    flops = 2 * matmul * n + 2 * 128256 * 4096 + 4 * 32 * 32 * 128 * n * (n + 1) / 2
    assert memory.prefill_flops(LLAMA3_8B, n) == pytest.approx(flops, rel=1e-12)
    assert memory.prefill_lower_bound(LLAMA3_8B, "bf16", n, a100) == pytest.approx(flops / 312e12, rel=1e-12)
    # Cached context: 10 new tokens after 100 cached ones attend 101..110 keys.
    extra = 4 * 32 * 32 * 128 * sum(range(101, 111))
    assert memory.prefill_flops(LLAMA3_8B, 10, context_start=100) == \
        pytest.approx(2 * matmul * 10 + 2 * 128256 * 4096 + extra, rel=1e-12)


def _brute_force_gpus(config, dtype, rps, prompt, output, ttft, tpot, gpu, util=0.9, max_tp=8, max_batch=256):
    """Every TP degree and every batch size, no shortcuts: the fewest GPUs meeting the targets."""
    best = None
    for tp in (1, 2, 4, 8, 16, 32):
        if tp > max_tp or config["num_attention_heads"] % tp or \
                (config["num_key_value_heads"] % tp and tp % config["num_key_value_heads"]):
            continue
        kv = memory.kv_cache_bytes_per_token(config, dtype) * max(1, config["num_key_value_heads"] // tp) \
            // config["num_key_value_heads"]
        for batch in range(1, max_batch + 1):
            need = memory.weight_bytes(config, dtype) / tp + batch * math.ceil((prompt + output) / 16) * 16 * kv
            if need > gpu.memory_bytes * util:
                break
            t_ttft, t_tpot, rate = memory.replica_estimates(config, dtype, tp, batch, prompt, output, gpu)
            if t_ttft <= ttft and t_tpot <= tpot:
                gpus = tp * math.ceil(rps / rate)
                best = gpus if best is None else min(best, gpus)
    return best


@pytest.mark.parametrize("config,dtype,rps,prompt,output,ttft,tpot,gpu", [
    (LLAMA2_70B, "fp16", 10.0, 2000, 500, 2.0, 0.05, "H100-80GB"),
    (LLAMA2_70B, "fp8", 3.0, 1000, 200, 1.0, 0.03, "A100-80GB"),
    (LLAMA3_8B, "bf16", 50.0, 512, 256, 0.5, 0.02, "H200-141GB"),
    (MIXTRAL_8X7B, "bf16", 5.0, 4000, 1000, 3.0, 0.04, "H100-80GB"),
    (QWEN3_06B, "bf16", 200.0, 256, 128, 0.2, 0.005, "A100-80GB"),
], ids=["70b-h100", "70b-fp8-a100", "8b-h200", "mixtral-h100", "qwen3-a100"])
def test_capacity_plan_meets_its_constraints_with_fewest_gpus(config, dtype, rps, prompt, output, ttft, tpot, gpu):
    spec = GPUS[gpu]
    plan = memory.capacity_plan(config, dtype, rps, prompt, output, ttft, tpot, gpu)
    assert plan is not None and plan.gpu == gpu
    assert plan.num_gpus == plan.tp * plan.replicas
    assert plan.ttft_s <= ttft and plan.tpot_s <= tpot
    assert plan.replicas * plan.replica_requests_per_s >= rps
    assert plan.memory_per_gpu_bytes <= spec.memory_bytes * 0.9
    # The plan's own numbers are the model's, at its batch: TPOT is a decode step plus batch/output prefills.
    step = memory.decode_step_lower_bound(config, dtype, plan.batch_size, prompt + output // 2, spec, plan.tp)
    prefill = memory.prefill_lower_bound(config, dtype, prompt, spec, plan.tp)
    assert plan.tpot_s == pytest.approx(step + plan.batch_size / output * prefill, rel=1e-12)
    assert plan.ttft_s == pytest.approx(prefill + plan.tpot_s, rel=1e-12)
    assert plan.replica_requests_per_s == pytest.approx(plan.batch_size / (output * plan.tpot_s), rel=1e-12)
    assert plan.num_gpus == _brute_force_gpus(config, dtype, rps, prompt, output, ttft, tpot, spec)


def test_capacity_plan_needs_tensor_parallelism_for_70b() -> None:
    """138 GB of fp16 weights: no single 80 GB GPU holds them, one 141 GB H200 barely does."""
    plan = memory.capacity_plan(LLAMA2_70B, "fp16", 1.0, 1000, 100, 10.0, 1.0, "H100-80GB")
    assert plan is not None and plan.tp >= 2
    assert memory.capacity_plan(LLAMA2_70B, "fp16", 1.0, 1000, 100, 10.0, 1.0, "H100-80GB", max_tp=1) is None


def test_capacity_plan_returns_none_when_targets_are_unreachable() -> None:
    # A decode step of Llama-2-70B reads at least 138 GB / (8 x 3.35 TB/s) = 5 ms: a 1 ms TPOT is impossible.
    assert memory.capacity_plan(LLAMA2_70B, "fp16", 1.0, 100, 100, 10.0, 0.001, "H100-80GB") is None


@pytest.mark.parametrize("kwargs,name", [
    (dict(requests_per_s=0), "requests_per_s"), (dict(prompt_len=0), "prompt_len"),
    (dict(output_len=1.5), "output_len"), (dict(ttft_s=-1), "ttft_s"), (dict(tpot_s=0), "tpot_s"),
    (dict(gpu="V100"), "gpu"), (dict(utilization=0), "utilization"), (dict(max_tp=0), "max_tp"),
])
def test_capacity_plan_rejects_bad_input(kwargs: dict, name: str) -> None:
    args = dict(config=LLAMA3_8B, dtype="bf16", requests_per_s=1.0, prompt_len=100, output_len=100,
                ttft_s=1.0, tpot_s=0.05, gpu="H100-80GB") | kwargs
    with pytest.raises(ValueError, match=name):
        memory.capacity_plan(**args)


def test_recompute_and_swap_costs() -> None:
    """Recompute is the prefill's FLOPs over a rate; swap is the KV twice over the link."""
    assert memory.swap_seconds(LLAMA2_70B, 1000, "fp16", 64e9) == pytest.approx(2 * 1000 * 327_680 / 64e9)
    assert memory.recompute_seconds(LLAMA3_8B, 100, 1e12) == pytest.approx(memory.prefill_flops(LLAMA3_8B, 100) / 1e12)


def test_dtype_bytes_rejects_unknown_names() -> None:
    assert memory.dtype_bytes(torch.float8_e4m3fn) == 1
    with pytest.raises(ValueError, match="dtype"):
        memory.dtype_bytes("int4")


def test_tp_degrees_shard_heads_like_vllm() -> None:
    """Powers of two up to max_tp that split the query heads and split or replicate the KV heads."""
    assert memory.tp_degrees(LLAMA2_70B, 64) == [1, 2, 4, 8, 16, 32, 64]
    qwen2_7b_like = dict(LLAMA3_8B, num_attention_heads=28, num_key_value_heads=4)  # 28 = 4 x 7
    assert memory.tp_degrees(qwen2_7b_like, 8) == [1, 2, 4]
    with pytest.raises(ValueError, match="tp"):
        memory.check_tp(qwen2_7b_like, 8)
