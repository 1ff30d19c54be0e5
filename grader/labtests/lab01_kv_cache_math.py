"""Official tests of lab 01_kv_cache_math: the capacity model of `engine_core.memory` and
`engine_core.capacity_planner`.

Expected values are hand arithmetic on public config.json values, written out here in the
expected arguments, never the solution's code; the capacity-plan tests search every TP degree
and batch size with the engine's own bounds (spec helpers evaluated only in expected arguments,
outside any plug). Every test runs inside `plug(student, LAB)` (grader/plug.py): the engine's
functions of this lab are the learner's, and calling the engine's own raises. So a later task
uses the learner's own earlier functions (a wrong kv_cache_bytes_per_token also fails the
tests built on it; decode_step_lower_bound calls the learner's allreduce_seconds). The
end-to-end test plugs the learner's `kv_cache_bytes_per_token` into the engine and observes the
KV tensors the engine then allocates. Every check is an `expect_*` observation.

Float checks use rtol=1e-9: the expected values are the same arithmetic in another order, so a
correct answer differs by a few ulps (1e-16 relative), and every planted bug by more than 1e-3.
"""
import functools
import math

import pytest

from grader.harness import GPUS, capacity_planner, make_engine, memory
from grader.observe import expect_close, expect_equal, expect_prediction, expect_raises
from grader.plug import plug

LAB = "01_kv_cache_math"
H100, A100, H200 = GPUS["H100-80GB"], GPUS["A100-80GB"], GPUS["H200-141GB"]
RTOL = 1e-9

LLAMA2_70B = dict(model_type="llama", num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
                  num_key_value_heads=8, intermediate_size=28672, vocab_size=32000, tie_word_embeddings=False)
LLAMA3_8B = dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False)
QWEN3_06B = dict(model_type="qwen3", num_hidden_layers=28, hidden_size=1024, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
                 tie_word_embeddings=True)
MIXTRAL_8X7B = dict(model_type="mixtral", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                    num_key_value_heads=8, intermediate_size=14336, vocab_size=32000, num_local_experts=8,
                    num_experts_per_tok=2, tie_word_embeddings=False)

# KV elements per token: 2 (K and V) x layers x KV heads x head_dim.
KV_ELEMENTS = {"Llama-2-70B": 2 * 80 * 8 * 128, "Llama-3-8B": 2 * 32 * 8 * 128, "Qwen3-0.6B": 2 * 28 * 8 * 128,
               "Mixtral-8x7B": 2 * 32 * 8 * 128}
# Parameters: per layer q,k,v,o + gate,up,down (x experts, + router) + 2 norms; embeddings; final norm.
PARAMS = {
    "Llama-2-70B": 80 * (8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672 + 2 * 8192)
    + 2 * 32000 * 8192 + 8192,  # 68,976,648,192
    "Llama-3-8B": 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096)
    + 2 * 128256 * 4096 + 4096,  # 8,030,261,248
    # 16 query heads x 128 = 2048 wide on a 1024 residual, q/k norms 2 x 128, one tied embedding
    "Qwen3-0.6B": 28 * (1024 * (2048 + 2 * 1024) + 2048 * 1024 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128)
    + 151936 * 1024 + 1024,  # 596,049,920
    "Mixtral-8x7B": 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 8 * 3 * 4096 * 14336 + 4096 * 8 + 2 * 4096)
    + 2 * 32000 * 4096 + 4096,  # 46,702,792,704
}
CONFIGS = {"Llama-2-70B": LLAMA2_70B, "Llama-3-8B": LLAMA3_8B, "Qwen3-0.6B": QWEN3_06B, "Mixtral-8x7B": MIXTRAL_8X7B}
# Matmul weights of Llama-3-8B's layers (no embedding, no norms) and its LM head: 2 FLOPs each per token.
LLAMA3_8B_LAYER_MATMULS = 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336)
LLAMA3_8B_HEAD = 128256 * 4096


# Activations per token of Llama-3-8B at the MLP: residual + normed copy (2 x 4096), gate, up and
# activated product (3 x 14336), 2 bytes each.
LLAMA3_8B_ACT = (2 * 4096 + 3 * 14336) * 2
NVLINK_LATENCY = 5e-6  # GPUSpec.allreduce_latency_s of all three GPUs

# What each task's tests plug (the rest of the lab's seams stay tripwired): the learner's own functions
# that the graded one calls, and nothing defined later in the notebook, so a check cell passes before
# the later tasks are written.
KV_ONLY, WEIGHTS_ONLY, ACTIVATION_ONLY = ["kv_cache_bytes_per_token"], ["weight_bytes"], ["activation_bytes"]
INT4_ONLY = ["weight_bytes", "int4_weight_bytes"]
CONCURRENCY_ONLY = ["kv_cache_bytes_per_token", "weight_bytes", "activation_bytes", "max_concurrent_requests"]
ALLREDUCE_ONLY = ["allreduce_seconds"]
BOUNDS_ONLY = ["kv_cache_bytes_per_token", "weight_bytes", "allreduce_seconds", "decode_step_lower_bound",
               "prefill_lower_bound"]


# ---- task 1: KV bytes per token --------------------------------------------------------------

@pytest.mark.points(1)
@pytest.mark.task("kv_cache_bytes_per_token")
def test_kv_bytes_public_configs(student):
    """16-bit KV per token of four public models: 2 x layers x KV heads x head_dim x 2 bytes."""
    with plug(student, LAB, only=KV_ONLY):
        for name, config in CONFIGS.items():
            for dtype in ("fp16", "bf16"):
                expect_equal(student.kv_cache_bytes_per_token(config, dtype), KV_ELEMENTS[name] * 2,
                             f"kv_cache_bytes_per_token({name}, {dtype!r}): 2 (K and V) x layers x KV heads x "
                             f"head_dim x 2 bytes")


@pytest.mark.points(1)
@pytest.mark.task("kv_cache_bytes_per_token")
def test_kv_bytes_fp8_and_fp32(student):
    """Element size scales it: 1 byte for fp8, 4 for fp32; torch dtypes work like names."""
    import torch

    with plug(student, LAB, only=KV_ONLY):
        for name, config in CONFIGS.items():
            for dtype, size in (("fp8", 1), ("fp32", 4), (torch.float8_e4m3fn, 1), (torch.float32, 4)):
                expect_equal(student.kv_cache_bytes_per_token(config, dtype), KV_ELEMENTS[name] * size,
                             f"kv_cache_bytes_per_token({name}, {dtype!r}): {size} byte(s) per element")


def _engine_kv(engine):
    """(bytes per token the engine's K and V tensors hold, blocks it allocated)."""
    cache = engine.runner.kv_cache
    allocated = sum(t.numel() * t.element_size() for t in cache.key + cache.value)
    return allocated // (cache.num_blocks * cache.block_size), cache.num_blocks


ENGINE_CASES = (("tiny-llama", "auto"), ("tiny-qwen2", "auto"), ("tiny-qwen3", "auto"), ("tiny-llama", "fp8_e4m3"))
KV_BUDGET = 2**18


@functools.cache
def _reference_engine_kv():
    """The reference engine on each case (no plug): [(bytes per token, blocks)]."""
    return [list(_engine_kv(make_engine(model, kv_cache_memory_bytes=KV_BUDGET, kv_cache_dtype=kv_dtype,
                                        swap_space=0))) for model, kv_dtype in ENGINE_CASES]


@pytest.mark.points(2)
@pytest.mark.task("kv_cache_bytes_per_token")
@pytest.mark.end_to_end
def test_engine_kv_cache_matches(student):
    """The engine sizes its cache with the learner's function; the tensors it allocates must agree."""
    # GQA 4:2, GQA 4:1, head_dim 32 on a 64-wide residual; and one fp8 cache (1 byte per element)
    with plug(student, LAB, only=["kv_cache_bytes_per_token"]) as plugged:
        engines = [make_engine(model, kv_cache_memory_bytes=KV_BUDGET, kv_cache_dtype=kv_dtype, swap_space=0)
                   for model, kv_dtype in ENGINE_CASES]
        answers = [student.kv_cache_bytes_per_token(e.cost_model.model_spec, e.runner.kv_cache.dtype) for e in engines]
    expect_equal(plugged.uncalled(), [], "plugged functions the engine never called while sizing its KV cache")
    for k, ((model, kv_dtype), engine, answer) in enumerate(zip(ENGINE_CASES, engines, answers)):
        expect_equal(answer, _reference_engine_kv()[k][0],
                     f"{model} with kv_cache_dtype={kv_dtype!r}: your kv_cache_bytes_per_token on the engine's "
                     f"ModelSpec and KV dtype, against the bytes per token its K and V tensors hold")
        expect_equal(_engine_kv(engine)[1], _reference_engine_kv()[k][1],
                     f"{model}, kv_cache_dtype={kv_dtype!r}: blocks the engine allocated in a {KV_BUDGET}-byte "
                     f"budget, sized with your function (budget // (block_size x bytes per token))")


# ---- task 2: weight bytes --------------------------------------------------------------------

@pytest.mark.points(1)
@pytest.mark.task("weight_bytes")
def test_weight_bytes_dense(student):
    """Llama-2-70B and Llama-3-8B: attention, SwiGLU MLP, norms, separate embedding and LM head."""
    with plug(student, LAB, only=WEIGHTS_ONLY):
        for name in ("Llama-2-70B", "Llama-3-8B"):
            for dtype, size in (("fp16", 2), ("fp8", 1), ("fp32", 4)):
                expect_equal(student.weight_bytes(CONFIGS[name], dtype), PARAMS[name] * size,
                             f"weight_bytes({name}, {dtype!r}): parameters x {size} bytes")


@pytest.mark.points(1)
@pytest.mark.task("weight_bytes")
def test_weight_bytes_moe(student):
    """Mixtral-8x7B: all 8 experts and the router sit in memory, though a token uses 2 experts."""
    with plug(student, LAB, only=WEIGHTS_ONLY):
        expect_equal(student.weight_bytes(MIXTRAL_8X7B, "bf16"), PARAMS["Mixtral-8x7B"] * 2,
                     "weight_bytes(Mixtral-8x7B, 'bf16'): every one of the 8 experts and the router, x 2 bytes")


@pytest.mark.points(2)
@pytest.mark.task("weight_bytes")
def test_weight_bytes_tied_and_biases(student):
    """Qwen3-0.6B (q/k norms, head_dim 128 on a 1024 residual, tied embedding); q/k/v and o biases."""
    small = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=96, vocab_size=100)
    qwen2 = dict(small, model_type="qwen2", num_key_value_heads=2)  # q 64, k and v 32 wide, bias on q, k, v
    llama = dict(small, model_type="llama", num_key_value_heads=1, attention_bias=True, tie_word_embeddings=True)
    with plug(student, LAB, only=WEIGHTS_ONLY):
        expect_equal(student.weight_bytes(QWEN3_06B, "bf16"), PARAMS["Qwen3-0.6B"] * 2,
                     "weight_bytes(Qwen3-0.6B, 'bf16'): q/k norms of head_dim each, one tied embedding")
        expect_equal(student.weight_bytes(qwen2, "fp32"),
                     4 * (2 * (64 * (64 + 2 * 32) + 64 * 64 + (64 + 2 * 32) + 3 * 64 * 96 + 2 * 64) + 2 * 100 * 64 + 64),
                     "weight_bytes of a 2-layer Qwen2 (hidden 64, 4:2 heads, q/k/v bias, no o bias), fp32")
        expect_equal(student.weight_bytes(llama, "fp32"),
                     4 * (2 * (64 * (64 + 2 * 16) + 64 * 64 + (64 + 2 * 16) + 64 + 3 * 64 * 96 + 2 * 64) + 100 * 64 + 64),
                     "weight_bytes of a 2-layer tied Llama with attention_bias (q/k/v and o bias, 4:1 heads), fp32")


# ---- task 2b: 4-bit GPTQ weights -------------------------------------------------------------

# A GPTQ linear of K inputs and N outputs at group size g holds qweight (K N / 2 bytes: 4 bits each), scales
# (K/g x N fp16: 2 bytes), qzeros (K/g x N at 4 bits: half a byte) and g_idx (K int32); per layer the projections
# (K x N) are q, k, v, o, gate, up, down (every expert's); the embedding, LM head, norms (and a router) stay fp16.
INT4_G128 = {
    # q, o 4096x4096; k, v 4096x1024; gate, up 4096x14336; down 14336x4096 (112 groups of 128)
    "Llama-3-8B": 32 * ((2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) // 2
                        + (2 * 32 * 4096 + 2 * 32 * 1024 + 2 * 32 * 14336 + 112 * 4096) * 5 // 2
                        + 4 * (6 * 4096 + 14336) + 2 * 2 * 4096)
    + 2 * (2 * 128256 * 4096 + 4096),  # 5,732,835,328
    # q, o 8192x8192; k, v 8192x1024; gate, up 8192x28672; down 28672x8192 (224 groups)
    "Llama-2-70B": 80 * ((2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672) // 2
                         + (2 * 64 * 8192 + 2 * 64 * 1024 + 2 * 64 * 28672 + 224 * 8192) * 5 // 2
                         + 4 * (6 * 8192 + 28672) + 2 * 2 * 8192)
    + 2 * (2 * 32000 * 8192 + 8192),  # 36,638,572,544
    # 8 experts of gate, up, down; the router 4096x8 in fp16
    "Mixtral-8x7B": 32 * ((2 * 4096 * 4096 + 2 * 4096 * 1024 + 8 * 3 * 4096 * 14336) // 2
                          + (2 * 32 * 4096 + 2 * 32 * 1024 + 8 * (2 * 32 * 14336 + 112 * 4096)) * 5 // 2
                          + 4 * (4 * 4096 + 8 * (2 * 4096 + 14336)) + 2 * 4096 * 8 + 2 * 2 * 4096)
    + 2 * (2 * 32000 * 4096 + 4096),
    # q 1024x2048, k, v 1024x1024, o 2048x1024 (16 groups), gate, up 1024x3072, down 3072x1024 (24 groups); q/k
    # norms of 128; one tied embedding
    "Qwen3-0.6B": 28 * ((1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072) // 2
                        + (8 * 2048 + 2 * 8 * 1024 + 16 * 1024 + 2 * 8 * 3072 + 24 * 1024) * 5 // 2
                        + 4 * (5 * 1024 + 2048 + 3072) + 2 * (2 * 1024 + 2 * 128))
    + 2 * (151936 * 1024 + 1024),
}
# Llama-2-7B (32 layers of hidden 4096, 32 KV heads, MLP 11008 = 86 groups of 128, vocabulary 32000), to compare
# with published checkpoints below.
LLAMA2_7B = dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                 num_key_value_heads=32, intermediate_size=11008, vocab_size=32000, tie_word_embeddings=False)
LLAMA2_7B_INT4_G128 = 32 * ((4 * 4096 * 4096 + 3 * 4096 * 11008) // 2
                            + (4 * 32 * 4096 + 2 * 32 * 11008 + 86 * 4096) * 5 // 2
                            + 4 * (6 * 4096 + 11008) + 2 * 2 * 4096) + 2 * (2 * 32000 * 4096 + 4096)  # 3,893,862,400


def _published_sizes_agree():
    """The arithmetic above against published GPTQ checkpoints (4 bits, group 128; GB = 1e9 bytes, as listed):
    TinyLamda/llama-2-7b-4bit-128g's gptq_model-4bit-128g.safetensors (AutoGPTQ, desc_act=False) is 3.89 GB.
    TheBloke's 2023 files list 3.90 GB (Llama-2-7B-GPTQ, branch main) and 36.65 GB (Llama-2-70B-chat-GPTQ, branch
    gptq-4bit-128g-actorder_True): the AutoGPTQ of 2023 also wrote an fp16 bias of zeros for every output of each
    quantized linear (N x 2 bytes; vLLM loads no bias for Llama), and with it both sizes round exactly."""
    zero_biases_7b = 32 * 2 * (4 * 4096 + 2 * 11008 + 4096)
    zero_biases_70b = 80 * 2 * (2 * 8192 + 2 * 1024 + 2 * 28672 + 8192)
    assert round(LLAMA2_7B_INT4_G128 / 1e9, 2) == 3.89, "Llama-2-7B against TinyLamda's checkpoint (a test bug)"
    assert round((LLAMA2_7B_INT4_G128 + zero_biases_7b) / 1e9, 2) == 3.90, "Llama-2-7B against TheBloke's (a test bug)"
    assert round((INT4_G128["Llama-2-70B"] + zero_biases_70b) / 1e9, 2) == 36.65, "70B against TheBloke's (a test bug)"


@pytest.mark.points(2)
@pytest.mark.task("predicted_int4_fraction")
def test_predicted_int4_fraction(student):
    """The prediction, answered before Task 2b: Llama-3-8B's 4-bit GPTQ weights (group 128) over its bf16 weights:
    5.73 GB / 16.06 GB = 0.357, not a quarter: the embedding and the LM head (128,256 x 4,096 each, 2.1 GB) stay
    16-bit and each group of 128 weights carries a 2-byte scale and a 4-bit zero. Tolerance 2%: leaving out g_idx
    (0.1%) is inside; a quarter (0.25), 4-bit embeddings (0.26) or forgetting the scales and zeros (0.349) are not."""
    expect_prediction(student.predicted_int4_fraction(), INT4_G128["Llama-3-8B"] / (PARAMS["Llama-3-8B"] * 2),
                      "predicted_int4_fraction(): Llama-3-8B's 4-bit GPTQ weights (group 128) / its bf16 weights",
                      rtol=0.02)


@pytest.mark.points(2)
@pytest.mark.task("int4_weight_bytes")
def test_int4_weight_bytes_llama(student):
    """Llama-3-8B, Llama-2-70B and Llama-2-7B at group size 128: packed 4-bit weights, fp16 scales, 4-bit zeros,
    int32 g_idx; embeddings, LM head and norms in 16 bits. The hand numbers match published checkpoints."""
    _published_sizes_agree()
    with plug(student, LAB, only=INT4_ONLY):
        for name in ("Llama-3-8B", "Llama-2-70B"):
            expect_equal(student.int4_weight_bytes(CONFIGS[name]), INT4_G128[name],
                         f"int4_weight_bytes({name}): qweight + scales + qzeros + g_idx of every projection, "
                         f"the rest in 16 bits")
        expect_equal(student.int4_weight_bytes(LLAMA2_7B, 128), LLAMA2_7B_INT4_G128,
                     "int4_weight_bytes(Llama-2-7B, 128): 3.89 GB, the size of a published AutoGPTQ checkpoint")


@pytest.mark.points(1)
@pytest.mark.task("int4_weight_bytes")
def test_int4_weight_bytes_rejects_bad_group_size(student):
    """A group is group_size input rows of one column: it must divide every projection's input size."""
    with plug(student, LAB, only=INT4_ONLY):
        for bad in (100, 0):
            expect_raises(ValueError, lambda: student.int4_weight_bytes(LLAMA3_8B, bad), match="group_size",
                          message=f"int4_weight_bytes(Llama-3-8B, group_size={bad}): 4096 and 14336 inputs")


@pytest.mark.points(2)
@pytest.mark.task("int4_weight_bytes")
def test_int4_weight_bytes_groups_moe_tied(student):
    """Smaller groups cost more scales (group 32: 4x the scales and zeros); Mixtral's experts are quantized and its
    router is not; Qwen3-0.6B's one tied embedding stays 16-bit."""
    with plug(student, LAB, only=INT4_ONLY):
        for g in (32, 64):
            groups = 128 // g
            expect_equal(student.int4_weight_bytes(LLAMA3_8B, g),
                         INT4_G128["Llama-3-8B"] + 32 * (groups - 1) * (2 * 32 * 4096 + 2 * 32 * 1024 + 2 * 32 * 14336
                                                                        + 112 * 4096) * 5 // 2,
                         f"int4_weight_bytes(Llama-3-8B, {g}): {groups}x the scales and zeros of group size 128")
        expect_equal(student.int4_weight_bytes(MIXTRAL_8X7B), INT4_G128["Mixtral-8x7B"],
                     "int4_weight_bytes(Mixtral-8x7B): 8 experts in 4 bits, the router in 16")
        expect_equal(student.int4_weight_bytes(QWEN3_06B), INT4_G128["Qwen3-0.6B"],
                     "int4_weight_bytes(Qwen3-0.6B): q/k norms and the tied embedding in 16 bits")


# ---- task 3: activations and max concurrent requests -----------------------------------------

@pytest.mark.points(1)
@pytest.mark.task("activation_bytes")
def test_activation_bytes_dense(student):
    """Per token: residual + normed copy (2 h) and gate, up, activated product (3 i), 16 bits or wider;
    one layer at a time, so the layer count does not enter."""
    with plug(student, LAB, only=ACTIVATION_ONLY):
        for dtype, size in (("bf16", 2), ("fp32", 4), ("fp8", 2)):
            expect_equal(student.activation_bytes(LLAMA3_8B, dtype, 8192), 8192 * (2 * 4096 + 3 * 14336) * size,
                         f"activation_bytes(Llama-3-8B, {dtype!r}, 8192 tokens): activations are {size} bytes "
                         f"(fp8 weights still compute in 16 bits)")
        expect_equal(student.activation_bytes(LLAMA2_70B, "fp16", 2048), 2048 * (2 * 8192 + 3 * 28672) * 2,
                     "activation_bytes(Llama-2-70B, 'fp16', 2048 tokens)")
        expect_equal(student.activation_bytes(LLAMA3_8B, "bf16", 0), 0, "activation_bytes(Llama-3-8B, 'bf16', 0)")


@pytest.mark.points(1)
@pytest.mark.task("activation_bytes")
def test_activation_bytes_moe(student):
    """An MoE token runs through top-k experts: 3 x intermediate x k of them at the peak."""
    with plug(student, LAB, only=ACTIVATION_ONLY):
        expect_equal(student.activation_bytes(MIXTRAL_8X7B, "bf16", 1000), 1000 * (2 * 4096 + 3 * 2 * 14336) * 2,
                     "activation_bytes(Mixtral-8x7B, 'bf16', 1000 tokens): each token in 2 of 8 experts")


@pytest.mark.points(1)
@pytest.mark.task("max_concurrent_requests")
def test_max_concurrent_by_hand(student):
    """Free memory after the weights over the KV of one full request; 0 when the weights do not fit."""
    with plug(student, LAB, only=CONCURRENCY_ONLY):
        f = student.max_concurrent_requests
        expect_equal(f(H100.memory_bytes, 0.9, LLAMA3_8B, 4096, "bf16"),
                     int((H100.memory_bytes * 0.9 - PARAMS["Llama-3-8B"] * 2) // (4096 * 131072)),
                     "max_concurrent_requests: Llama-3-8B bf16 on an H100 at 0.9, 4096-token requests")
        expect_equal(f(A100.memory_bytes, 0.9, LLAMA2_70B, 2500, "fp16"), 0,
                     "max_concurrent_requests: Llama-2-70B fp16 (138 GB of weights) on one 80 GB A100 at 0.9")
        expect_equal(f(100e9, 1.0, QWEN3_06B, 1000, "fp8"), int((100e9 - PARAMS["Qwen3-0.6B"]) // (1000 * 57344)),
                     "max_concurrent_requests: Qwen3-0.6B fp8, 100 GB at utilization 1.0, 1000-token requests")


@pytest.mark.points(1)
@pytest.mark.task("max_concurrent_requests")
def test_max_concurrent_rejects_bad_input(student):
    """utilization outside (0, 1], context_len < 1 and a negative max_num_batched_tokens are ValueErrors
    naming the parameter."""
    with plug(student, LAB, only=CONCURRENCY_ONLY):
        f = student.max_concurrent_requests
        expect_equal(f(80e9, 0.5, LLAMA3_8B, 100, "bf16"), int((40e9 - PARAMS["Llama-3-8B"] * 2) // (100 * 131072)),
                     "max_concurrent_requests(80e9, 0.5, Llama-3-8B, 100, 'bf16')")
        for bad, name in ((dict(utilization=0.0), "utilization"), (dict(utilization=1.2), "utilization"),
                          (dict(context_len=0), "context_len"), (dict(max_num_batched_tokens=-1), "max_num_batched_tokens")):
            args = dict(gpu_bytes=80e9, utilization=0.9, config=LLAMA3_8B, context_len=100, dtype="bf16") | bad
            expect_raises(ValueError, lambda: f(**args), match=name,
                          message=f"max_concurrent_requests with {bad} (else 80e9, 0.9, Llama-3-8B, 100, 'bf16')")


@pytest.mark.points(1)
@pytest.mark.task("max_concurrent_requests")
def test_max_concurrent_blocks(student):
    """Requests hold whole blocks: 4001 tokens in 16-token blocks reserve 251 blocks = 4016 tokens."""
    with plug(student, LAB, only=CONCURRENCY_ONLY):
        for tokens, rounded in ((4000, 4000), (4001, 4016), (1, 16)):
            expect_equal(student.max_concurrent_requests(80e9, 1.0, LLAMA3_8B, tokens, "bf16", block_size=16),
                         int((80e9 - PARAMS["Llama-3-8B"] * 2) // (rounded * 131072)),
                         f"Llama-3-8B bf16, 80e9 bytes at 1.0, {tokens}-token requests in 16-token blocks "
                         f"(each holds {rounded} tokens of KV)")


@pytest.mark.points(2)
@pytest.mark.task("max_concurrent_requests")
def test_max_concurrent_budget_holds_activations(student):
    """vLLM's utilization budget holds the weights, the profiled activation peak (a forward of
    max_num_batched_tokens), non-torch memory and the KV cache: the KV gets only what is left."""
    with plug(student, LAB, only=CONCURRENCY_ONLY):
        f = student.max_concurrent_requests
        for tokens, other in ((8192, 0), (2048, 0), (8192, 3e9)):
            expect_equal(f(H100.memory_bytes, 0.9, LLAMA3_8B, 4096, "bf16", block_size=16, max_num_batched_tokens=tokens,
                           non_torch_bytes=other),
                         int((H100.memory_bytes * 0.9 - PARAMS["Llama-3-8B"] * 2 - tokens * LLAMA3_8B_ACT - other)
                             // (4096 * 131072)),
                         f"Llama-3-8B bf16 on an H100 at 0.9, 4096-token requests, max_num_batched_tokens={tokens}, "
                         f"non_torch_bytes={other:g}")
        expect_equal(f(18.3e9, 0.9, LLAMA3_8B, 100, "bf16", max_num_batched_tokens=8192), 0,
                     "Llama-3-8B bf16 (16.06 GB of weights) on 18.3 GB at 0.9 with an 8192-token activation peak (0.84 GB): weights "
                     "and activations leave no room")


# ---- task 4: roofline lower bounds and all-reduces -------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("predicted_min_decode_ms")
def test_predicted_min_decode_ms(student):
    """The prediction, answered before the roofline: one decode step of Llama-3-8B bf16 on one H100,
    64 requests each attending 4096 keys. Memory-bound: (weights + 64 x 4096 x 128 KiB of KV) / HBM
    bandwidth = 15.05 ms (the FLOPs take 1.2 ms). Tolerance 3%: rounding the weights to 16 GB and the
    KV to 34.4 GB stays within 0.5%; forgetting the KV (4.8 ms), counting query heads (~60 ms) or
    taking GiB for GB (7.4% off) are outside."""
    expect_prediction(student.predicted_min_decode_ms(),
                 (PARAMS["Llama-3-8B"] * 2 + 64 * 4096 * 131_072) / 3.35e12 * 1e3,
                 "predicted_min_decode_ms(): Llama-3-8B bf16, one H100, batch 64 x 4096 keys, in milliseconds",
                 rtol=0.03)


@pytest.mark.points(1)
@pytest.mark.task("allreduce_seconds")
def test_allreduce_alpha_beta(student):
    """Two all-reduces per layer, each latency + 2 (tp - 1) / tp x num_tokens x hidden x bytes over the
    link; none at TP 1."""
    with plug(student, LAB, only=ALLREDUCE_ONLY):
        expect_equal(student.allreduce_seconds(LLAMA2_70B, "fp16", 64, H100, 1), 0.0,
                     "allreduce_seconds(Llama-2-70B, 'fp16', 64 tokens, H100, tp=1): nothing to reduce")
        expect_close(student.allreduce_seconds(LLAMA2_70B, "fp16", 64, H100, 8),
                     2 * 80 * (NVLINK_LATENCY + 2 * 7 / 8 * (64 * 8192 * 2) / 450e9),
                     "allreduce_seconds(Llama-2-70B, 'fp16', 64 tokens, H100, tp=8): 160 all-reduces of 1 MiB",
                     rtol=RTOL)
        expect_close(student.allreduce_seconds(LLAMA3_8B, "fp8", 4096, H100, 2),
                     2 * 32 * (NVLINK_LATENCY + 2 * 1 / 2 * (4096 * 4096 * 2) / 450e9),
                     "allreduce_seconds(Llama-3-8B, 'fp8', 4096 tokens, H100, tp=2): activations travel in 16 bits",
                     rtol=RTOL)


@pytest.mark.points(1)
@pytest.mark.task("allreduce_seconds")
def test_allreduce_latency_term(student):
    """One token at TP 8: 16 KiB per all-reduce, so the 160 latencies (0.8 ms) dwarf the bytes; across
    nodes (50 GB/s, 20 us) both terms grow."""
    import dataclasses

    cross_node = dataclasses.replace(H100, nvlink_bytes_per_s=50e9, allreduce_latency_s=20e-6)
    with plug(student, LAB, only=ALLREDUCE_ONLY):
        expect_close(student.allreduce_seconds(LLAMA2_70B, "bf16", 1, H100, 8),
                     2 * 80 * (NVLINK_LATENCY + 2 * 7 / 8 * (8192 * 2) / 450e9),
                     "allreduce_seconds(Llama-2-70B, 'bf16', 1 token, H100, tp=8): 160 x (5 us + 16 KiB x 7/4 / 450 GB/s)",
                     rtol=RTOL)
        expect_close(student.allreduce_seconds(LLAMA2_70B, "bf16", 64, cross_node, 16),
                     2 * 80 * (20e-6 + 2 * 15 / 16 * (64 * 8192 * 2) / 50e9),
                     "allreduce_seconds(Llama-2-70B, 'bf16', 64 tokens, tp=16 over a 50 GB/s, 20 us link)",
                     rtol=RTOL)


@pytest.mark.points(1)
@pytest.mark.task("lower_bounds")
def test_decode_bound_memory_bound(student):
    """Small batches: every weight and each request's KV over HBM bandwidth."""
    with plug(student, LAB, only=BOUNDS_ONLY):
        expect_close(student.decode_step_lower_bound(LLAMA2_70B, "fp16", 1, 1000, H100),
                     (PARAMS["Llama-2-70B"] * 2 + 1000 * 327_680) / 3.35e12,
                     "decode_step_lower_bound(Llama-2-70B fp16, batch 1, context 1000, H100)", rtol=RTOL)
        expect_close(student.decode_step_lower_bound(LLAMA3_8B, "bf16", 8, 4096, A100),
                     (PARAMS["Llama-3-8B"] * 2 + 8 * 4096 * 131_072) / 2.039e12,
                     "decode_step_lower_bound(Llama-3-8B bf16, batch 8, context 4096, A100)", rtol=RTOL)


@pytest.mark.points(1)
@pytest.mark.task("lower_bounds")
def test_decode_bound_compute_bound(student):
    """A batch of 4096 short requests on Llama-3-8B: FLOPs over peak, the roofline's other side."""
    batch, context = 4096, 16
    flops = batch * (2 * LLAMA3_8B_LAYER_MATMULS + 2 * LLAMA3_8B_HEAD + 4 * 32 * 32 * 128 * context)
    assert flops / 989e12 > (PARAMS["Llama-3-8B"] * 2 + batch * context * 131_072) / 3.35e12, \
        "the case must be compute-bound (a test bug)"
    with plug(student, LAB, only=BOUNDS_ONLY):
        expect_close(student.decode_step_lower_bound(LLAMA3_8B, "bf16", batch, context, H100),
                     batch * (2 * LLAMA3_8B_LAYER_MATMULS + 2 * LLAMA3_8B_HEAD + 4 * 32 * 32 * 128 * context) / 989e12,
                     f"decode_step_lower_bound(Llama-3-8B bf16, batch {batch}, context {context}, H100)", rtol=RTOL)


@pytest.mark.points(1)
@pytest.mark.task("lower_bounds")
def test_prefill_bound(student):
    """A 2048-token prompt is compute-bound; a 4-token one is bound by reading the weights."""
    with plug(student, LAB, only=BOUNDS_ONLY):
        expect_close(student.prefill_lower_bound(LLAMA3_8B, "bf16", 2048, A100),
                     (2 * LLAMA3_8B_LAYER_MATMULS * 2048 + 2 * LLAMA3_8B_HEAD + 4 * 32 * 32 * 128 * 2048 * 2049 / 2)
                     / 312e12,
                     "prefill_lower_bound(Llama-3-8B bf16, 2048 tokens, A100)", rtol=RTOL)
        expect_close(student.prefill_lower_bound(LLAMA3_8B, "bf16", 4, A100),
                     (PARAMS["Llama-3-8B"] * 2 + 4 * 131_072) / 2.039e12,
                     "prefill_lower_bound(Llama-3-8B bf16, 4 tokens, A100)", rtol=RTOL)


@pytest.mark.points(1)
@pytest.mark.task("lower_bounds")
def test_bounds_tensor_parallel(student):
    """TP t: weights, KV heads (at least one per GPU) and FLOPs over t, plus 2 all-reduces per layer
    (latency + ring bytes)."""
    with plug(student, LAB, only=BOUNDS_ONLY):
        expect_close(student.decode_step_lower_bound(LLAMA2_70B, "fp16", 8, 2000, H100, tp=4),
                     (PARAMS["Llama-2-70B"] * 2 / 4 + 8 * 2000 * 327_680 / 4) / 3.35e12
                     + 2 * 80 * (NVLINK_LATENCY + 2 * 3 / 4 * (8 * 8192 * 2) / 450e9),
                     "decode_step_lower_bound(Llama-2-70B fp16, batch 8, context 2000, H100, tp=4)", rtol=RTOL)
        # TP 16 on Llama-3-8B's 8 KV heads: each GPU still holds one whole KV head, 1/8 of the KV.
        expect_close(student.decode_step_lower_bound(LLAMA3_8B, "bf16", 4, 8192, H100, tp=16),
                     (PARAMS["Llama-3-8B"] * 2 / 16 + 4 * 8192 * 131_072 / 8) / 3.35e12
                     + 2 * 32 * (NVLINK_LATENCY + 2 * 15 / 16 * (4 * 4096 * 2) / 450e9),
                     "decode_step_lower_bound(Llama-3-8B bf16, batch 4, context 8192, H100, tp=16): one KV head per GPU",
                     rtol=RTOL)
        expect_close(student.prefill_lower_bound(LLAMA3_8B, "bf16", 4096, H100, tp=8),
                     (2 * LLAMA3_8B_LAYER_MATMULS * 4096 + 2 * LLAMA3_8B_HEAD + 4 * 32 * 32 * 128 * 4096 * 4097 / 2)
                     / 8 / 989e12 + 2 * 32 * (NVLINK_LATENCY + 2 * 7 / 8 * (4096 * 4096 * 2) / 450e9),
                     "prefill_lower_bound(Llama-3-8B bf16, 4096 tokens, H100, tp=8)", rtol=RTOL)


# ---- task 5: capacity plan -------------------------------------------------------------------

SCENARIOS = [  # config name, dtype, requests/s, prompt, output, TTFT, TPOT, GPU
    ("Llama-2-70B", "fp16", 10.0, 2000, 500, 2.0, 0.05, "H100-80GB"),
    ("Llama-2-70B", "fp8", 3.0, 1000, 200, 1.0, 0.03, "A100-80GB"),
    ("Llama-3-8B", "bf16", 50.0, 512, 256, 0.5, 0.02, "H200-141GB"),
    ("Mixtral-8x7B", "bf16", 5.0, 4000, 1000, 3.0, 0.04, "H100-80GB"),
    ("Qwen3-0.6B", "bf16", 200.0, 256, 128, 0.2, 0.005, "A100-80GB"),
]


def _plans(student, *scenarios, **kwargs):
    """The learner's capacity plans (with their own bounds inside) for each scenario."""
    with plug(student, LAB):
        return [student.capacity_plan(CONFIGS[name], dtype, rps, prompt, output, ttft, tpot, gpu, **kwargs)
                for name, dtype, rps, prompt, output, ttft, tpot, gpu in scenarios]


def _case(scenario):
    name, dtype, rps, prompt, output, ttft, tpot, gpu = scenario
    return f"{name} {dtype}, {rps} req/s of {prompt}+{output} tokens, TTFT {ttft} s, TPOT {tpot} s on {gpu}"


def _model_at(name, dtype, tp, batch, prompt, output, gpu):
    """This lab's replica model, from the engine's bounds (outside any plug): (TTFT, TPOT, requests/s,
    bytes per GPU)."""
    config = CONFIGS[name]
    prefill = capacity_planner.prefill_lower_bound(config, dtype, prompt, gpu, tp)
    step = capacity_planner.decode_step_lower_bound(config, dtype, batch, prompt + output // 2, gpu, tp)
    tpot = step + batch / output * prefill
    kv = KV_ELEMENTS[name] * memory.dtype_bytes(dtype) * max(1, 8 // tp) // 8  # all four models have 8 KV heads
    per_gpu = PARAMS[name] * memory.dtype_bytes(dtype) / tp + batch * math.ceil((prompt + output) / 16) * 16 * kv
    return prefill + tpot, tpot, batch / (output * tpot), per_gpu


@functools.cache
def _options(index):
    """Every TP degree's best replica for SCENARIOS[index], by brute force over batch sizes 1..256:
    [(GPUs for the load, tp, the largest batch that fits and meets both targets)]."""
    name, dtype, rps, prompt, output, ttft, tpot, gpu_name = SCENARIOS[index]
    gpu, options = GPUS[gpu_name], []
    for tp in (1, 2, 4, 8):
        feasible = []
        for batch in range(1, 257):
            t_ttft, t_tpot, _, per_gpu = _model_at(name, dtype, tp, batch, prompt, output, gpu)
            if per_gpu > gpu.memory_bytes * 0.9:
                break  # a larger batch needs even more memory
            if t_ttft <= ttft and t_tpot <= tpot:
                feasible.append(batch)
        if feasible:
            rate = _model_at(name, dtype, tp, feasible[-1], prompt, output, gpu)[2]
            options.append((tp * math.ceil(rps / rate), tp, feasible[-1]))
    return options


def _best_estimates(index):
    """The best plan's (TTFT, TPOT, requests/s, bytes per GPU) for SCENARIOS[index]."""
    name, dtype, _, prompt, output, _, _, gpu_name = SCENARIOS[index]
    _, tp, batch = min(_options(index))
    return list(_model_at(name, dtype, tp, batch, prompt, output, GPUS[gpu_name]))


@pytest.mark.points(1)
@pytest.mark.task("capacity_plan")
def test_capacity_plan_interview_question(student):
    """Llama-2-70B fp16, 10 req/s of 2000 + 500 tokens, TTFT 2 s, TPOT 50 ms on H100s: 2 replicas x TP 4."""
    (plan,) = _plans(student, SCENARIOS[0])
    expect_equal(None if plan is None else (plan.gpu, plan.tp, plan.replicas, plan.num_gpus),
                 ("H100-80GB", 4, 2, 8), f"(gpu, tp, replicas, num_gpus) of the plan for {_case(SCENARIOS[0])}")


@pytest.mark.points(1)
@pytest.mark.task("capacity_plan")
def test_capacity_plan_reports_the_models_estimates(student):
    """Each plan reports this lab's model at its TP degree and batch: TTFT, TPOT, requests/s per replica
    and bytes per GPU (weight shard + the batch's KV at full length, in blocks)."""
    for index, plan in enumerate(_plans(student, *SCENARIOS)):
        expect_close(None if plan is None else [plan.ttft_s, plan.tpot_s, plan.replica_requests_per_s,
                                                 plan.memory_per_gpu_bytes],
                     _best_estimates(index),
                     f"{_case(SCENARIOS[index])}: [ttft_s, tpot_s, replica_requests_per_s, memory_per_gpu_bytes] of "
                     f"the plan (at the best TP degree and its largest batch that meets both targets)", rtol=RTOL)


@pytest.mark.points(2)
@pytest.mark.task("capacity_plan")
def test_capacity_plan_fewest_gpus(student):
    """No TP degree and batch size serve the load with fewer GPUs; ties go to the smaller TP degree,
    and the replica runs the largest batch that meets the targets."""
    for index, plan in enumerate(_plans(student, *SCENARIOS)):
        expect_equal(None if plan is None else (plan.num_gpus, plan.tp, plan.batch_size), min(_options(index)),
                     f"{_case(SCENARIOS[index])}: (num_gpus, tp, batch_size); every TP degree's best "
                     f"(gpus, tp, batch): {_options(index)}")


@pytest.mark.points(1)
@pytest.mark.task("capacity_plan")
def test_capacity_plan_infeasible(student):
    """None when no TP degree works: 70B fp16 weights on one 80 GB GPU, or a TPOT below the weight read."""
    (plan,) = _plans(student, ("Llama-2-70B", "fp16", 1.0, 1000, 100, 10.0, 1.0, "H100-80GB"), max_tp=1)
    expect_equal(plan, None, "capacity_plan for Llama-2-70B fp16 with max_tp=1 on H100s (138 GB of weights, 80 GB GPUs)")
    # reading 138 GB of weights over 8 x 3.35 TB/s takes at least 5 ms: a 1 ms TPOT is impossible
    (plan,) = _plans(student, ("Llama-2-70B", "fp16", 1.0, 100, 100, 10.0, 0.001, "H100-80GB"))
    expect_equal(plan, None, "capacity_plan for Llama-2-70B fp16 with a 1 ms TPOT target on H100s")
    (plan,) = _plans(student, ("Llama-2-70B", "fp16", 1.0, 1000, 100, 10.0, 1.0, "H100-80GB"))
    expect_equal(None if plan is None else (plan.tp, plan.replicas), (2, 1),
                 "(tp, replicas) for Llama-2-70B fp16, 1 req/s, 1000+100 tokens, loose targets, max_tp=8 on H100s")


# ---- task 6: the slip ------------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("slip")
def test_slip_numbers(student):
    """Llama-2-70B fp16: 2 x 80 x 8 x 128 x 2 = 327,680 bytes (320 KiB) per token, not 655,360."""
    expect_equal(student.slip_kv_bytes_per_token, 327_680,
                 "slip_kv_bytes_per_token: Llama-2-70B fp16, 2 x 80 x 8 x 128 x 2")
    expect_equal(student.slip_request_kv_bytes, 2500 * 327_680, "slip_request_kv_bytes: 2,500 tokens x 327,680")


@pytest.mark.points(1)
@pytest.mark.task("slip")
def test_slip_cause_and_gpus(student):
    """The extra factor of 2 is the slip; and one 80 GB H100 cannot even hold the fp16 weights."""
    expect_equal(student.slip_cause, "b", "slip_cause: recompute the article's formula factor by factor")
    # TP 2 on H100s: 0.9 x 81,559 MiB - 137.95 GB / 2 leaves about 8 GB per GPU for KV; one 2,512-token
    # request needs 2,512 x 327,680 / 2 bytes on each of them.
    room = 0.9 * 81559 * 2**20 - PARAMS["Llama-2-70B"] * 2 / 2
    assert room >= 2512 * 327_680 / 2 and 0.9 * 81559 * 2**20 < PARAMS["Llama-2-70B"] * 2, "TP 2 fits (a test bug)"
    expect_equal(student.slip_min_h100s, 2, "slip_min_h100s: the fewest H100s holding the weights and one request")
