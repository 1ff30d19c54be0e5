"""Lab 01's capacity planner against hand arithmetic on public configs and a brute-force search."""
from __future__ import annotations

import dataclasses
import math

import pytest

from engine_core import capacity_planner, memory
from engine_core.capacity_planner import GPUS
from tests.engine.test_memory import LLAMA2_70B, LLAMA2_70B_PARAMS, LLAMA3_8B, LLAMA3_8B_PARAMS, MIXTRAL_8X7B, QWEN3_06B


def test_the_engines_default_cuda_rates_are_the_h100s() -> None:
    """memory.DEFAULT_RATES cannot import the datasheets (they build on memory.py): its numbers must agree."""
    h100 = GPUS["H100-80GB"]
    assert memory.DEFAULT_RATES["cuda"] == (h100.bf16_flops * 0.5, h100.pcie_bytes_per_s)


def test_max_concurrent_requests_by_hand() -> None:
    # Llama-3-8B bf16 on an H100 at 90%: what is left after the weights, over 4096 tokens of KV each.
    free = 81559 * 2**20 * 0.9 - LLAMA3_8B_PARAMS * 2
    assert capacity_planner.max_concurrent_requests(GPUS["H100-80GB"].memory_bytes, 0.9, LLAMA3_8B, 4096, "bf16") == \
        int(free // (4096 * 131072))
    # Rounded up to whole 16-token blocks: 4000 tokens hold 250 blocks = 4000 tokens, 4001 hold 251.
    assert capacity_planner.max_concurrent_requests(80e9, 1.0, LLAMA3_8B, 4001, "bf16", block_size=16) == \
        int((80e9 - LLAMA3_8B_PARAMS * 2) // (4016 * 131072))
    # Llama-2-70B fp16 (138 GB of weights) does not fit on one 80 GB GPU at all.
    assert capacity_planner.max_concurrent_requests(GPUS["H100-80GB"].memory_bytes, 0.9, LLAMA2_70B, 2500, "fp16") == 0


@pytest.mark.parametrize("kwargs,name", [
    (dict(utilization=0.0), "utilization"), (dict(utilization=1.5), "utilization"),
    (dict(context_len=0), "context_len"), (dict(gpu_bytes=0), "gpu_bytes"), (dict(block_size=0), "block_size"),
])
def test_max_concurrent_requests_rejects_bad_input(kwargs: dict, name: str) -> None:
    args = dict(gpu_bytes=80e9, utilization=0.9, config=LLAMA3_8B, context_len=100, dtype="bf16") | kwargs
    with pytest.raises(ValueError, match=name):
        capacity_planner.max_concurrent_requests(**args)


def test_decode_bound_by_hand() -> None:
    """Batch 1 on Llama-2-70B is the weights over HBM bandwidth; batch 4096 at TP 1 turns compute-bound."""
    h100 = GPUS["H100-80GB"]
    weights = LLAMA2_70B_PARAMS * 2
    assert capacity_planner.decode_step_lower_bound(LLAMA2_70B, "fp16", 1, 1000, h100) == \
        pytest.approx((weights + 1000 * 327_680) / 3.35e12, rel=1e-12)
    # FLOPs per token: 2 per matmul weight (all but the 32000 x 8192 input embedding) + attention 4*80*64*128*ctx.
    matmul = LLAMA2_70B_PARAMS - 32000 * 8192 - 80 * 2 * 8192 - 8192
    flops = 4096 * (2 * matmul + 4 * 80 * 64 * 128 * 16)
    memory_s = (weights + 4096 * 16 * 327_680) / 3.35e12
    assert flops / 989e12 > memory_s
    assert capacity_planner.decode_step_lower_bound(LLAMA2_70B, "fp16", 4096, 16, h100) == pytest.approx(flops / 989e12, rel=1e-12)


def test_tensor_parallel_bounds_by_hand() -> None:
    """TP 4 reads a quarter of the weights and KV per GPU, and pays two ring all-reduces per layer,
    each 5 us of latency plus its bytes over NVLink."""
    h100 = GPUS["H100-80GB"]
    allreduce = 2 * 80 * (5e-6 + 2 * 3 / 4 * (8 * 8192 * 2) / 450e9)  # batch 8, hidden 8192, fp16
    read = (LLAMA2_70B_PARAMS * 2 / 4 + 8 * 2000 * 327_680 / 4) / 3.35e12
    assert capacity_planner.decode_step_lower_bound(LLAMA2_70B, "fp16", 8, 2000, h100, tp=4) == \
        pytest.approx(read + allreduce, rel=1e-12)
    # Llama-3-8B has 8 KV heads: at TP 16 each GPU still holds one whole head (replicated twice).
    assert capacity_planner.kv_heads_per_gpu(LLAMA3_8B, 16) == 1
    with pytest.raises(ValueError, match="tp"):
        capacity_planner.kv_heads_per_gpu(LLAMA3_8B, 3)


def test_allreduce_alpha_beta_by_hand() -> None:
    """Two all-reduces per layer, each latency + 2 (tp - 1) / tp x bytes / bandwidth; none at TP 1."""
    h100 = GPUS["H100-80GB"]
    assert h100.allreduce_latency_s == 5e-6
    assert capacity_planner.allreduce_seconds(LLAMA2_70B, "fp16", 64, h100, 1) == 0.0
    want = 2 * 80 * (5e-6 + 2 * 7 / 8 * (64 * 8192 * 2) / 450e9)
    assert capacity_planner.allreduce_seconds(LLAMA2_70B, "fp16", 64, h100, 8) == pytest.approx(want, rel=1e-12)
    # fp8 weights: the activations still travel in 16 bits; a slower link with more latency (cross-node)
    slow = dataclasses.replace(h100, nvlink_bytes_per_s=50e9, allreduce_latency_s=20e-6)
    want = 2 * 32 * (20e-6 + 2 * 15 / 16 * (1 * 4096 * 2) / 50e9)
    assert capacity_planner.allreduce_seconds(LLAMA3_8B, "fp8", 1, slow, 16) == pytest.approx(want, rel=1e-12)


def test_max_concurrent_requests_subtracts_activations_and_non_torch_memory() -> None:
    """The utilization budget holds weights, the activation peak, non-torch memory and the KV cache."""
    act = 8192 * (2 * 4096 + 3 * 14336) * 2
    free = 81559 * 2**20 * 0.9 - LLAMA3_8B_PARAMS * 2 - act - 2e9
    got = capacity_planner.max_concurrent_requests(GPUS["H100-80GB"].memory_bytes, 0.9, LLAMA3_8B, 4096, "bf16",
                                         block_size=16, max_num_batched_tokens=8192, non_torch_bytes=2e9)
    assert got == int(free // (4096 * 131072))
    for kwargs, name in ((dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
                         (dict(non_torch_bytes=-1.0), "non_torch_bytes")):
        with pytest.raises(ValueError, match=name):
            capacity_planner.max_concurrent_requests(80e9, 0.9, LLAMA3_8B, 100, "bf16", **kwargs)


def test_prefill_bound_by_hand() -> None:
    a100 = GPUS["A100-80GB"]
    n = 2048
    matmul = LLAMA3_8B_PARAMS - 128256 * 4096 - 32 * 2 * 4096 - 4096 - 128256 * 4096  # layers' matmuls only
    flops = 2 * matmul * n + 2 * 128256 * 4096 + 4 * 32 * 32 * 128 * n * (n + 1) / 2
    assert capacity_planner.prefill_lower_bound(LLAMA3_8B, "bf16", n, a100) == pytest.approx(flops / 312e12, rel=1e-12)


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
            t_ttft, t_tpot, rate = capacity_planner.replica_estimates(config, dtype, tp, batch, prompt, output, gpu)
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
    plan = capacity_planner.capacity_plan(config, dtype, rps, prompt, output, ttft, tpot, gpu)
    assert plan is not None and plan.gpu == gpu
    assert plan.num_gpus == plan.tp * plan.replicas
    assert plan.ttft_s <= ttft and plan.tpot_s <= tpot
    assert plan.replicas * plan.replica_requests_per_s >= rps
    assert plan.memory_per_gpu_bytes <= spec.memory_bytes * 0.9
    # The plan's own numbers are the model's, at its batch: TPOT is a decode step plus batch/output prefills.
    step = capacity_planner.decode_step_lower_bound(config, dtype, plan.batch_size, prompt + output // 2, spec, plan.tp)
    prefill = capacity_planner.prefill_lower_bound(config, dtype, prompt, spec, plan.tp)
    assert plan.tpot_s == pytest.approx(step + plan.batch_size / output * prefill, rel=1e-12)
    assert plan.ttft_s == pytest.approx(prefill + plan.tpot_s, rel=1e-12)
    assert plan.replica_requests_per_s == pytest.approx(plan.batch_size / (output * plan.tpot_s), rel=1e-12)
    assert plan.num_gpus == _brute_force_gpus(config, dtype, rps, prompt, output, ttft, tpot, spec)


def test_capacity_plan_needs_tensor_parallelism_for_70b() -> None:
    """138 GB of fp16 weights: no single 80 GB GPU holds them, one 141 GB H200 barely does."""
    plan = capacity_planner.capacity_plan(LLAMA2_70B, "fp16", 1.0, 1000, 100, 10.0, 1.0, "H100-80GB")
    assert plan is not None and plan.tp >= 2
    assert capacity_planner.capacity_plan(LLAMA2_70B, "fp16", 1.0, 1000, 100, 10.0, 1.0, "H100-80GB", max_tp=1) is None


def test_capacity_plan_returns_none_when_targets_are_unreachable() -> None:
    # A decode step of Llama-2-70B reads at least 138 GB / (8 x 3.35 TB/s) = 5 ms: a 1 ms TPOT is impossible.
    assert capacity_planner.capacity_plan(LLAMA2_70B, "fp16", 1.0, 100, 100, 10.0, 0.001, "H100-80GB") is None


@pytest.mark.parametrize("kwargs,name", [
    (dict(requests_per_s=0), "requests_per_s"), (dict(prompt_len=0), "prompt_len"),
    (dict(output_len=1.5), "output_len"), (dict(ttft_s=-1), "ttft_s"), (dict(tpot_s=0), "tpot_s"),
    (dict(gpu="V100"), "gpu"), (dict(utilization=0), "utilization"), (dict(max_tp=0), "max_tp"),
])
def test_capacity_plan_rejects_bad_input(kwargs: dict, name: str) -> None:
    args = dict(config=LLAMA3_8B, dtype="bf16", requests_per_s=1.0, prompt_len=100, output_len=100,
                ttft_s=1.0, tpot_s=0.05, gpu="H100-80GB") | kwargs
    with pytest.raises(ValueError, match=name):
        capacity_planner.capacity_plan(**args)


def test_tp_degrees_shard_heads_like_vllm() -> None:
    """Powers of two up to max_tp that split the query heads and split or replicate the KV heads."""
    assert capacity_planner.tp_degrees(LLAMA2_70B, 64) == [1, 2, 4, 8, 16, 32, 64]
    qwen2_7b_like = dict(LLAMA3_8B, num_attention_heads=28, num_key_value_heads=4)  # 28 = 4 x 7
    assert capacity_planner.tp_degrees(qwen2_7b_like, 8) == [1, 2, 4]
    with pytest.raises(ValueError, match="tp"):
        capacity_planner.check_tp(qwen2_7b_like, 8)


def test_int4_weight_bytes_by_hand_and_against_published_checkpoints() -> None:
    """Per projection of K inputs, N outputs at group 128: K N / 2 (qweight) + K/128 N x 2.5 (fp16 scales, 4-bit
    zeros) + 4 K (g_idx); the rest fp16. Llama-2-7B's 4-bit group-128 AutoGPTQ file (TinyLamda/llama-2-7b-4bit-128g
    on the Hugging Face Hub) is 3.89 GB; TheBloke's 2023 files, which add a zero fp16 bias per output of each
    quantized linear, list 3.90 GB (Llama-2-7B-GPTQ) and 36.65 GB (Llama-2-70B-chat-GPTQ, group 128)."""
    llama2_7b = dict(LLAMA3_8B, num_key_value_heads=32, intermediate_size=11008, vocab_size=32000)
    layer = (4 * 4096 * 4096 + 3 * 4096 * 11008) // 2 + (4 * 32 * 4096 + 2 * 32 * 11008 + 86 * 4096) * 5 // 2 \
        + 4 * (6 * 4096 + 11008) + 2 * 2 * 4096
    int4_7b = capacity_planner.int4_weight_bytes(llama2_7b)
    assert int4_7b == 32 * layer + 2 * (2 * 32000 * 4096 + 4096) == 3_893_862_400
    assert round(int4_7b / 1e9, 2) == 3.89
    assert round((int4_7b + 32 * 2 * (4 * 4096 + 3 * 11008)) / 1e9, 2) == 3.90
    int4_70b = capacity_planner.int4_weight_bytes(LLAMA2_70B)
    assert round((int4_70b + 80 * 2 * (2 * 8192 + 2 * 1024 + 2 * 28672 + 8192)) / 1e9, 2) == 36.65
    # Llama-3-8B keeps 2.1 GB of embeddings in 16 bits: a third of its bf16 bytes, not a quarter
    assert capacity_planner.int4_weight_bytes(LLAMA3_8B) == 5_732_835_328
    assert 0.35 < 5_732_835_328 / (LLAMA3_8B_PARAMS * 2) < 0.36
    # smaller groups: more scales and zeros; an MoE router stays 16-bit
    assert capacity_planner.int4_weight_bytes(LLAMA3_8B, 32) > capacity_planner.int4_weight_bytes(LLAMA3_8B, 64) \
        > 5_732_835_328
    experts = MIXTRAL_8X7B["num_local_experts"]
    moe = capacity_planner.int4_weight_bytes(MIXTRAL_8X7B) - capacity_planner.int4_weight_bytes(
        dict(MIXTRAL_8X7B, num_local_experts=0, num_experts_per_tok=0))
    one_expert = (3 * 4096 * 14336 // 2 + (2 * 32 * 14336 + 112 * 4096) * 5 // 2  # qweight; scales, qzeros
                  + 4 * (2 * 4096 + 14336))  # g_idx
    assert moe == 32 * ((experts - 1) * one_expert + 2 * 4096 * experts)  # 7 more experts, the router in fp16


@pytest.mark.parametrize("group_size", [0, 100, 1.5])
def test_int4_weight_bytes_rejects_a_group_size_that_does_not_divide(group_size) -> None:
    with pytest.raises(ValueError, match="group_size"):
        capacity_planner.int4_weight_bytes(LLAMA3_8B, group_size)
