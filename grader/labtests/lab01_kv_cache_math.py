"""Official tests of lab 01_kv_cache_math: the capacity model of `engine_core.memory`.

Expected values are hand arithmetic on public config.json values, written out here, never the
solution's code. Every test runs inside `plug(student, LAB)` (grader/plug.py): the engine's
functions of this lab are the learner's, and calling the engine's own raises. So a later task
uses the learner's own earlier functions (a wrong kv_cache_bytes_per_token also fails the
tests built on it). The end-to-end test plugs the learner's `kv_cache_bytes_per_token` into the
engine and measures the KV tensors the engine then allocates.
"""
import math

import pytest

from grader.harness import GPUS, make_engine, memory
from grader.plug import plug

LAB = "01_kv_cache_math"
H100, A100, H200 = GPUS["H100-80GB"], GPUS["A100-80GB"], GPUS["H200-141GB"]

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


def _close(got, want, what):
    assert isinstance(got, (int, float)), f"{what} returned {got!r}, expected a number near {want:.6g}"
    assert got == pytest.approx(want, rel=1e-9), f"{what} returned {got!r}, expected {want!r}"


# ---- task 1: KV bytes per token --------------------------------------------------------------

@pytest.mark.points(1)
@pytest.mark.task("kv_cache_bytes_per_token")
def test_kv_bytes_public_configs(student):
    """16-bit KV per token of four public models: 2 x layers x KV heads x head_dim x 2 bytes."""
    with plug(student, LAB):
        for name, config in CONFIGS.items():
            for dtype in ("fp16", "bf16"):
                got = student.kv_cache_bytes_per_token(config, dtype)
                want = KV_ELEMENTS[name] * 2
                assert got == want, f"kv_cache_bytes_per_token({name}, {dtype!r}) returned {got!r}, expected {want:,}"


@pytest.mark.points(1)
@pytest.mark.task("kv_cache_bytes_per_token")
def test_kv_bytes_fp8_and_fp32(student):
    """Element size scales it: 1 byte for fp8, 4 for fp32; torch dtypes work like names."""
    import torch

    with plug(student, LAB):
        for name, config in CONFIGS.items():
            for dtype, size in (("fp8", 1), ("fp32", 4), (torch.float8_e4m3fn, 1), (torch.float32, 4)):
                got = student.kv_cache_bytes_per_token(config, dtype)
                want = KV_ELEMENTS[name] * size
                assert got == want, f"kv_cache_bytes_per_token({name}, {dtype!r}) returned {got!r}, expected {want:,}"


@pytest.mark.points(2)
@pytest.mark.task("kv_cache_bytes_per_token")
@pytest.mark.end_to_end
def test_engine_kv_cache_matches(student):
    """The engine sizes its cache with the learner's function; the tensors it allocates must agree."""
    budget = 2**18
    # GQA 4:2, GQA 4:1, head_dim 32 on a 64-wide residual; and one fp8 cache (1 byte per element)
    with plug(student, LAB, only=["kv_cache_bytes_per_token"]) as plugged:
        engines = [(model, make_engine(model, kv_cache_memory_bytes=budget, kv_cache_dtype=kv_dtype, swap_space=0))
                   for model, kv_dtype in (("tiny-llama", "auto"), ("tiny-qwen2", "auto"), ("tiny-qwen3", "auto"),
                                           ("tiny-llama", "fp8_e4m3"))]
        answers = [student.kv_cache_bytes_per_token(engine.cost_model.model_spec, engine.runner.kv_cache.dtype) for _, engine in engines]
    assert not plugged.uncalled(), "the engine never called your kv_cache_bytes_per_token"
    for (model, engine), got in zip(engines, answers):
        cache = engine.runner.kv_cache
        allocated = sum(t.numel() * t.element_size() for t in cache.key + cache.value)
        measured = allocated // (cache.num_blocks * cache.block_size)
        assert got == measured, (f"{model} with a {cache.dtype} KV cache: your function says {got!r} bytes per "
                                 f"token, the engine's K and V tensors hold {measured} ({engine.cost_model.model_spec})")
        want_blocks = budget // (cache.block_size * measured)
        assert cache.num_blocks == want_blocks, (f"{model}: a {budget}-byte budget should hold {want_blocks} "
                                                 f"blocks, the engine sized {cache.num_blocks} with your function")


# ---- task 2: weight bytes --------------------------------------------------------------------

def _assert_weights(student, name, config, dtype, size, want_params):
    got = student.weight_bytes(config, dtype)
    want = want_params * size
    assert got == want, (f"weight_bytes({name}, {dtype!r}) returned {got!r}, expected {want:,} "
                         f"({want_params:,} parameters x {size} bytes)")


@pytest.mark.points(1)
@pytest.mark.task("weight_bytes")
def test_weight_bytes_dense(student):
    """Llama-2-70B and Llama-3-8B: attention, SwiGLU MLP, norms, separate embedding and LM head."""
    with plug(student, LAB):
        for name in ("Llama-2-70B", "Llama-3-8B"):
            for dtype, size in (("fp16", 2), ("fp8", 1), ("fp32", 4)):
                _assert_weights(student, name, CONFIGS[name], dtype, size, PARAMS[name])


@pytest.mark.points(1)
@pytest.mark.task("weight_bytes")
def test_weight_bytes_moe(student):
    """Mixtral-8x7B: all 8 experts and the router sit in memory, though a token uses 2 experts."""
    with plug(student, LAB):
        _assert_weights(student, "Mixtral-8x7B", MIXTRAL_8X7B, "bf16", 2, PARAMS["Mixtral-8x7B"])


@pytest.mark.points(2)
@pytest.mark.task("weight_bytes")
def test_weight_bytes_tied_and_biases(student):
    """Qwen3-0.6B (q/k norms, head_dim 128 on a 1024 residual, tied embedding); q/k/v and o biases."""
    small = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=96, vocab_size=100)
    qwen2 = dict(small, model_type="qwen2", num_key_value_heads=2)  # q 64, k and v 32 wide, bias on q, k, v
    llama = dict(small, model_type="llama", num_key_value_heads=1, attention_bias=True, tie_word_embeddings=True)
    with plug(student, LAB):
        _assert_weights(student, "Qwen3-0.6B", QWEN3_06B, "bf16", 2, PARAMS["Qwen3-0.6B"])
        want = 2 * (64 * (64 + 2 * 32) + 64 * 64 + (64 + 2 * 32) + 3 * 64 * 96 + 2 * 64) + 2 * 100 * 64 + 64
        _assert_weights(student, "a 2-layer Qwen2 (q/k/v bias)", qwen2, "fp32", 4, want)
        want = 2 * (64 * (64 + 2 * 16) + 64 * 64 + (64 + 2 * 16) + 64 + 3 * 64 * 96 + 2 * 64) + 100 * 64 + 64
        _assert_weights(student, "a 2-layer tied Llama with attention_bias (q/k/v/o bias)", llama, "fp32", 4, want)


# ---- task 3: max concurrent requests ---------------------------------------------------------

@pytest.mark.points(1)
@pytest.mark.task("max_concurrent_requests")
def test_max_concurrent_by_hand(student):
    """Free memory after the weights over the KV of one full request; 0 when the weights do not fit."""
    with plug(student, LAB):
        f = student.max_concurrent_requests
        free = H100.memory_bytes * 0.9 - PARAMS["Llama-3-8B"] * 2
        want = int(free // (4096 * 131072))
        got = f(H100.memory_bytes, 0.9, LLAMA3_8B, 4096, "bf16")
        assert got == want, f"Llama-3-8B bf16 on an H100 at 0.9, 4096-token requests: got {got!r}, expected {want}"
        got = f(A100.memory_bytes, 0.9, LLAMA2_70B, 2500, "fp16")
        assert got == 0, f"Llama-2-70B fp16 weights ({PARAMS['Llama-2-70B'] * 2:,} bytes) on one A100: got {got!r}, expected 0"
        got = f(100e9, 1.0, QWEN3_06B, 1000, "fp8")
        want = int((100e9 - PARAMS["Qwen3-0.6B"]) // (1000 * 57344))
        assert got == want, f"Qwen3-0.6B fp8, 100 GB at utilization 1.0, 1000 tokens: got {got!r}, expected {want}"


@pytest.mark.points(1)
@pytest.mark.task("max_concurrent_requests")
def test_max_concurrent_rejects_bad_input(student):
    """utilization outside (0, 1] and context_len < 1 are ValueErrors naming the parameter."""
    with plug(student, LAB):
        f = student.max_concurrent_requests
        assert f(80e9, 0.5, LLAMA3_8B, 100, "bf16") == int((40e9 - PARAMS["Llama-3-8B"] * 2) // (100 * 131072))
        for kwargs, name in ((dict(utilization=0.0), "utilization"), (dict(utilization=1.2), "utilization"),
                             (dict(context_len=0), "context_len")):
            args = dict(gpu_bytes=80e9, utilization=0.9, config=LLAMA3_8B, context_len=100, dtype="bf16") | kwargs
            with pytest.raises(ValueError, match=name):
                f(**args)
                pytest.fail(f"max_concurrent_requests({kwargs}) returned instead of raising ValueError")


@pytest.mark.points(1)
@pytest.mark.task("max_concurrent_requests")
def test_max_concurrent_blocks(student):
    """Requests hold whole blocks: 4001 tokens in 16-token blocks reserve 251 blocks = 4016 tokens."""
    with plug(student, LAB):
        f = student.max_concurrent_requests
        free = 80e9 - PARAMS["Llama-3-8B"] * 2
        for tokens, rounded in ((4000, 4000), (4001, 4016), (1, 16)):
            got = f(80e9, 1.0, LLAMA3_8B, tokens, "bf16", block_size=16)
            want = int(free // (rounded * 131072))
            assert got == want, f"{tokens} tokens in 16-token blocks hold {rounded} tokens of KV: got {got!r}, expected {want}"


# ---- task 4: roofline lower bounds -----------------------------------------------------------

@pytest.mark.points(1)
@pytest.mark.task("lower_bounds")
def test_decode_bound_memory_bound(student):
    """Small batches: every weight and each request's KV over HBM bandwidth."""
    with plug(student, LAB):
        got = student.decode_step_lower_bound(LLAMA2_70B, "fp16", 1, 1000, H100)
        _close(got, (PARAMS["Llama-2-70B"] * 2 + 1000 * 327_680) / 3.35e12, "decode_step_lower_bound(Llama-2-70B fp16, "
               "batch 1, context 1000, H100)")
        got = student.decode_step_lower_bound(LLAMA3_8B, "bf16", 8, 4096, A100)
        _close(got, (PARAMS["Llama-3-8B"] * 2 + 8 * 4096 * 131_072) / 2.039e12,
               "decode_step_lower_bound(Llama-3-8B bf16, batch 8, context 4096, A100)")


@pytest.mark.points(1)
@pytest.mark.task("lower_bounds")
def test_decode_bound_compute_bound(student):
    """A batch of 4096 short requests on Llama-3-8B: FLOPs over peak, the roofline's other side."""
    with plug(student, LAB):
        batch, context = 4096, 16
        flops = batch * (2 * LLAMA3_8B_LAYER_MATMULS + 2 * LLAMA3_8B_HEAD + 4 * 32 * 32 * 128 * context)
        bandwidth = (PARAMS["Llama-3-8B"] * 2 + batch * context * 131_072) / 3.35e12
        assert flops / 989e12 > bandwidth  # the case is compute-bound
        got = student.decode_step_lower_bound(LLAMA3_8B, "bf16", batch, context, H100)
        _close(got, flops / 989e12, f"decode_step_lower_bound(Llama-3-8B bf16, batch {batch}, context {context}, H100)")


@pytest.mark.points(1)
@pytest.mark.task("lower_bounds")
def test_prefill_bound(student):
    """A 2048-token prompt is compute-bound; a 4-token one is bound by reading the weights."""
    with plug(student, LAB):
        n = 2048
        flops = 2 * LLAMA3_8B_LAYER_MATMULS * n + 2 * LLAMA3_8B_HEAD + 4 * 32 * 32 * 128 * n * (n + 1) / 2
        got = student.prefill_lower_bound(LLAMA3_8B, "bf16", n, A100)
        _close(got, flops / 312e12, "prefill_lower_bound(Llama-3-8B bf16, 2048 tokens, A100)")
        got = student.prefill_lower_bound(LLAMA3_8B, "bf16", 4, A100)
        _close(got, (PARAMS["Llama-3-8B"] * 2 + 4 * 131_072) / 2.039e12, "prefill_lower_bound(Llama-3-8B bf16, 4 tokens, A100)")


@pytest.mark.points(1)
@pytest.mark.task("lower_bounds")
def test_bounds_tensor_parallel(student):
    """TP t: weights, KV heads (at least one per GPU) and FLOPs over t, plus 2 ring all-reduces per layer."""
    with plug(student, LAB):
        allreduce = 2 * 80 * 2 * 3 / 4 * (8 * 8192 * 2) / 450e9  # batch 8 x hidden 8192 x 2 bytes, TP 4
        want = (PARAMS["Llama-2-70B"] * 2 / 4 + 8 * 2000 * 327_680 / 4) / 3.35e12 + allreduce
        _close(student.decode_step_lower_bound(LLAMA2_70B, "fp16", 8, 2000, H100, tp=4), want,
               "decode_step_lower_bound(Llama-2-70B fp16, batch 8, context 2000, H100, tp=4)")
        # TP 16 on Llama-3-8B's 8 KV heads: each GPU still holds one whole KV head, 1/8 of the KV.
        allreduce = 2 * 32 * 2 * 15 / 16 * (4 * 4096 * 2) / 450e9
        want = (PARAMS["Llama-3-8B"] * 2 / 16 + 4 * 8192 * 131_072 / 8) / 3.35e12 + allreduce
        _close(student.decode_step_lower_bound(LLAMA3_8B, "bf16", 4, 8192, H100, tp=16), want,
               "decode_step_lower_bound(Llama-3-8B bf16, batch 4, context 8192, H100, tp=16)")
        n = 4096
        flops = 2 * LLAMA3_8B_LAYER_MATMULS * n + 2 * LLAMA3_8B_HEAD + 4 * 32 * 32 * 128 * n * (n + 1) / 2
        allreduce = 2 * 32 * 2 * 7 / 8 * (n * 4096 * 2) / 450e9
        _close(student.prefill_lower_bound(LLAMA3_8B, "bf16", n, H100, tp=8), flops / 8 / 989e12 + allreduce,
               "prefill_lower_bound(Llama-3-8B bf16, 4096 tokens, H100, tp=8)")


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


def _model_at(name, dtype, tp, batch, prompt, output, gpu):
    """This lab's replica model, from the engine's bounds (outside any plug): (TTFT, TPOT, requests/s,
    bytes per GPU)."""
    config = CONFIGS[name]
    prefill = memory.prefill_lower_bound(config, dtype, prompt, gpu, tp)
    tpot = memory.decode_step_lower_bound(config, dtype, batch, prompt + output // 2, gpu, tp) + batch / output * prefill
    kv = KV_ELEMENTS[name] * memory.dtype_bytes(dtype) * max(1, 8 // tp) // 8  # all four models have 8 KV heads
    per_gpu = PARAMS[name] * memory.dtype_bytes(dtype) / tp + batch * math.ceil((prompt + output) / 16) * 16 * kv
    return prefill + tpot, tpot, batch / (output * tpot), per_gpu


def _feasible_batches(name, dtype, tp, prompt, output, ttft, tpot, gpu, max_batch=256):
    """Every batch size 1..max_batch that fits and meets both targets at this TP degree."""
    ok = []
    for batch in range(1, max_batch + 1):
        t_ttft, t_tpot, _, per_gpu = _model_at(name, dtype, tp, batch, prompt, output, gpu)
        if per_gpu > gpu.memory_bytes * 0.9:
            break  # a larger batch needs even more memory
        if t_ttft <= ttft and t_tpot <= tpot:
            ok.append(batch)
    return ok


@pytest.mark.points(1)
@pytest.mark.task("capacity_plan")
def test_capacity_plan_interview_question(student):
    """Llama-2-70B fp16, 10 req/s of 2000 + 500 tokens, TTFT 2 s, TPOT 50 ms on H100s: 2 replicas x TP 4."""
    (plan,) = _plans(student, SCENARIOS[0])
    assert plan is not None, "capacity_plan returned None for the interview question; 8 H100s serve it"
    got = (plan.gpu, plan.tp, plan.replicas, plan.num_gpus)
    assert got == ("H100-80GB", 4, 2, 8), f"(gpu, tp, replicas, num_gpus) = {got}, expected ('H100-80GB', 4, 2, 8)"


@pytest.mark.points(1)
@pytest.mark.task("capacity_plan")
def test_capacity_plan_meets_constraints(student):
    """Each plan fits in memory, meets TTFT and TPOT, serves the load, and reports the model's numbers."""
    for plan, (name, dtype, rps, prompt, output, ttft, tpot, gpu_name) in zip(_plans(student, *SCENARIOS), SCENARIOS):
        case = f"{name} {dtype} {rps} req/s, {prompt}+{output} tokens, TTFT {ttft} s, TPOT {tpot} s on {gpu_name}"
        assert plan is not None, f"{case}: capacity_plan returned None, but a plan exists"
        gpu = GPUS[gpu_name]
        assert plan.gpu == gpu_name and plan.num_gpus == plan.tp * plan.replicas, f"{case}: {plan}"
        assert 1 <= plan.batch_size <= 256, f"{case}: batch_size {plan.batch_size} outside 1..256"
        want_ttft, want_tpot, want_rate, want_bytes = _model_at(name, dtype, plan.tp, plan.batch_size, prompt, output, gpu)
        _close(plan.tpot_s, want_tpot, f"{case}: plan.tpot_s at tp {plan.tp}, batch {plan.batch_size}")
        _close(plan.ttft_s, want_ttft, f"{case}: plan.ttft_s")
        _close(plan.replica_requests_per_s, want_rate, f"{case}: plan.replica_requests_per_s")
        _close(plan.memory_per_gpu_bytes, want_bytes, f"{case}: plan.memory_per_gpu_bytes")
        assert want_ttft <= ttft and want_tpot <= tpot, f"{case}: the plan misses a target: {plan}"
        assert want_bytes <= gpu.memory_bytes * 0.9, f"{case}: {want_bytes:,.0f} bytes per GPU do not fit: {plan}"
        assert plan.replicas * want_rate >= rps, f"{case}: {plan.replicas} replicas serve {plan.replicas * want_rate:.3f} req/s"


@pytest.mark.points(2)
@pytest.mark.task("capacity_plan")
def test_capacity_plan_fewest_gpus(student):
    """No TP degree and batch size serve the load with fewer GPUs; ties go to the smaller TP degree,
    and the replica runs the largest batch that meets the targets."""
    for plan, (name, dtype, rps, prompt, output, ttft, tpot, gpu_name) in zip(_plans(student, *SCENARIOS), SCENARIOS):
        gpu = GPUS[gpu_name]
        options = []  # (gpus, tp, largest feasible batch)
        for tp in (1, 2, 4, 8):
            batches = _feasible_batches(name, dtype, tp, prompt, output, ttft, tpot, gpu)
            if batches:
                rate = _model_at(name, dtype, tp, batches[-1], prompt, output, gpu)[2]
                options.append((tp * math.ceil(rps / rate), tp, batches[-1]))
        want = min(options)
        got = None if plan is None else (plan.num_gpus, plan.tp, plan.batch_size)
        assert got == want, (f"{name} {dtype} {rps} req/s on {gpu_name}: (num_gpus, tp, batch_size) = {got}, "
                             f"expected {want}; every option (gpus, tp, batch): {options}")


@pytest.mark.points(1)
@pytest.mark.task("capacity_plan")
def test_capacity_plan_infeasible(student):
    """None when no TP degree works: 70B fp16 weights on one 80 GB GPU, or a TPOT below the weight read."""
    (plan,) = _plans(student, ("Llama-2-70B", "fp16", 1.0, 1000, 100, 10.0, 1.0, "H100-80GB"), max_tp=1)
    assert plan is None, f"Llama-2-70B fp16 at max_tp=1 on one H100 (weights do not fit): got {plan}, expected None"
    # reading 138 GB of weights over 8 x 3.35 TB/s takes at least 5 ms: a 1 ms TPOT is impossible
    (plan,) = _plans(student, ("Llama-2-70B", "fp16", 1.0, 100, 100, 10.0, 0.001, "H100-80GB"))
    assert plan is None, f"Llama-2-70B fp16 with a 1 ms TPOT target: got {plan}, expected None"
    (plan,) = _plans(student, ("Llama-2-70B", "fp16", 1.0, 1000, 100, 10.0, 1.0, "H100-80GB"))
    assert plan is not None and plan.tp >= 2, f"with max_tp=8 the 70B model fits at TP >= 2: got {plan}"


# ---- task 6: the slip ------------------------------------------------------------------------

@pytest.mark.points(2)
@pytest.mark.task("slip")
def test_slip_numbers(student):
    """Llama-2-70B fp16: 2 x 80 x 8 x 128 x 2 = 327,680 bytes (320 KiB) per token, not 655,360."""
    got = student.slip_kv_bytes_per_token
    assert got == 327_680, f"slip_kv_bytes_per_token = {got!r}, expected 2 x 80 x 8 x 128 x 2 = 327,680"
    got = student.slip_request_kv_bytes
    assert got == 2500 * 327_680, f"slip_request_kv_bytes = {got!r}, expected 2,500 x 327,680 = {2500 * 327_680:,}"


@pytest.mark.points(1)
@pytest.mark.task("slip")
def test_slip_cause_and_gpus(student):
    """The extra factor of 2 is the slip; and one 80 GB H100 cannot even hold the fp16 weights."""
    assert student.slip_cause == "b", f"slip_cause = {student.slip_cause!r}: recompute the article's formula factor by factor"
    # TP 2 on H100s: 0.9 x 81,559 MiB - 137.95 GB / 2 leaves about 8 GB per GPU for KV; one 2,512-token
    # request needs 2,512 x 327,680 / 2 bytes on each of them.
    room = 0.9 * 81559 * 2**20 - PARAMS["Llama-2-70B"] * 2 / 2
    assert room >= 2512 * 327_680 / 2 and 0.9 * 81559 * 2**20 < PARAMS["Llama-2-70B"] * 2
    assert student.slip_min_h100s == 2, f"slip_min_h100s = {student.slip_min_h100s!r}, expected 2"
