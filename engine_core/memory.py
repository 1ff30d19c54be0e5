"""The capacity model: bytes of weights and KV, how many requests fit, roofline lower bounds,
and a capacity plan (requests/s -> GPUs at a tensor-parallel degree).

Every function takes a model `config` as a `ModelSpec`, a Hugging Face config object
or a plain `config.json` dict, and a dtype as a torch dtype or a name ("fp16", "bf16",
"fp32", "fp8"). The engine sizes its KV cache with `kv_cache_bytes_per_token`; the
scheduler's recompute-or-swap cost model uses `recompute_seconds` / `swap_seconds`.
Lab 01 has the learner rewrite the public functions here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

_DTYPE_BYTES = {
    "fp32": 4, "float32": 4, "float": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "float8_e4m3fn": 1, "fp8_e5m2": 1, "float8_e5m2": 1, "int8": 1,
}


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element of `dtype` (a torch dtype or one of the names above)."""
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be a torch dtype or one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")
    return _DTYPE_BYTES[key]


@dataclass(frozen=True)
class ModelSpec:
    """The shape numbers of a decoder-only transformer that memory and FLOPs depend on."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # per expert for an MoE model
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k and v projections
    o_proj_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0  # 0: dense MLP
    num_experts_per_tok: int = 0

    @classmethod
    def of(cls, config: Any) -> "ModelSpec":
        """Accept a ModelSpec, a Hugging Face config, or a config.json dict."""
        if isinstance(config, ModelSpec):
            return config
        c = config if isinstance(config, dict) else config.to_dict()
        if "text_config" in c:
            c = c["text_config"]
        heads = c["num_attention_heads"]
        experts = c.get("num_local_experts") or c.get("num_experts") or 0
        model_type = c.get("model_type") or ""
        # Qwen2 always has q/k/v bias and no o bias; Mistral/Mixtral never have bias;
        # Llama and Qwen3 put `attention_bias` on all four projections.
        qkv_bias = model_type == "qwen2" or (model_type not in ("mistral", "mixtral") and bool(c.get("attention_bias")))
        o_bias = model_type not in ("qwen2", "mistral", "mixtral") and bool(c.get("attention_bias"))
        return cls(
            num_layers=c["num_hidden_layers"],
            hidden_size=c["hidden_size"],
            num_attention_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            intermediate_size=(c.get("moe_intermediate_size") if experts else None) or c["intermediate_size"],
            vocab_size=c["vocab_size"],
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            qk_norm=model_type.startswith("qwen3"),
            num_experts=experts,
            num_experts_per_tok=c.get("num_experts_per_tok", 0) if experts else 0,
        )


# seam: lab 01 (grader/seams.py)
def kv_cache_bytes_per_token(config: Any, dtype: torch.dtype | str) -> int:
    """K and V, every layer, every KV head: 2 * layers * kv_heads * head_dim * bytes."""
    s = ModelSpec.of(config)
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * dtype_bytes(dtype)


def _layer_matmul_params(s: ModelSpec, active_only: bool) -> int:
    """Weights of one layer's matrix multiplies (projections, experts, router)."""
    q = s.num_attention_heads * s.head_dim
    kv = s.num_kv_heads * s.head_dim
    mlp = 3 * s.hidden_size * s.intermediate_size  # gate, up, down (SwiGLU)
    if s.num_experts:
        experts = s.num_experts_per_tok if active_only else s.num_experts
        mlp = experts * mlp + s.hidden_size * s.num_experts  # + router
    return s.hidden_size * (q + 2 * kv) + q * s.hidden_size + mlp


def _layer_params(s: ModelSpec, active_only: bool) -> int:
    q = s.num_attention_heads * s.head_dim
    kv = s.num_kv_heads * s.head_dim
    extra = 2 * s.hidden_size  # two RMSNorm weights
    extra += (q + 2 * kv) if s.attention_bias else 0
    extra += s.hidden_size if s.o_proj_bias else 0
    extra += 2 * s.head_dim if s.qk_norm else 0
    return _layer_matmul_params(s, active_only) + extra


def num_params(config: Any, active_only: bool = False) -> int:
    """Parameters; `active_only` counts only the experts one token runs through (MoE)."""
    s = ModelSpec.of(config)
    embed = s.vocab_size * s.hidden_size
    head = 0 if s.tie_word_embeddings else embed
    return s.num_layers * _layer_params(s, active_only) + embed + head + s.hidden_size


# seam: lab 01 (grader/seams.py)
def weight_bytes(config: Any, dtype: torch.dtype | str) -> int:
    """Bytes of all weights (every expert of an MoE model sits in memory)."""
    return num_params(config) * dtype_bytes(dtype)


# seam: lab 01 (grader/seams.py)
def activation_bytes(config: Any, dtype: torch.dtype | str, num_tokens: int) -> int:
    """Peak activation bytes of one forward pass over `num_tokens` tokens (vLLM profiles this peak
    with a dummy batch of `max_num_batched_tokens`): the largest set of tensors one layer holds at
    once, at the MLP: the residual stream and its normed copy (2 x hidden), the gate and up outputs
    and their activated product (3 x intermediate, x top-k experts for an MoE model), per token, in
    16 bits or wider (activations stay 16-bit even with fp8 weights). Layers run one after another,
    so this does not grow with the number of layers; it grows linearly with `num_tokens`."""
    s = ModelSpec.of(config)
    experts = s.num_experts_per_tok if s.num_experts else 1
    return num_tokens * (2 * s.hidden_size + 3 * experts * s.intermediate_size) * max(2, dtype_bytes(dtype))


# seam: lab 01 (grader/seams.py)
def max_concurrent_requests(gpu_bytes: float, utilization: float, config: Any, context_len: int,
                            dtype: torch.dtype | str, block_size: int = 1, max_num_batched_tokens: int = 0,
                            non_torch_bytes: float = 0) -> int:
    """Requests of `context_len` tokens whose KV fits in `utilization` of the GPU beside the weights,
    the activation peak of a `max_num_batched_tokens` forward (`activation_bytes`), and
    `non_torch_bytes` (CUDA graphs, NCCL buffers, the CUDA context); the rest of the GPU is headroom."""
    if not gpu_bytes > 0:
        raise ValueError(f"gpu_bytes must be > 0, got {gpu_bytes!r}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    if not (isinstance(context_len, int) and context_len >= 1):
        raise ValueError(f"context_len must be an int >= 1, got {context_len!r}")
    if not (isinstance(block_size, int) and block_size >= 1):
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    if not (isinstance(max_num_batched_tokens, int) and max_num_batched_tokens >= 0):
        raise ValueError(f"max_num_batched_tokens must be an int >= 0, got {max_num_batched_tokens!r}")
    if not non_torch_bytes >= 0:
        raise ValueError(f"non_torch_bytes must be >= 0, got {non_torch_bytes!r}")
    free = (gpu_bytes * utilization - weight_bytes(config, dtype)
            - activation_bytes(config, dtype, max_num_batched_tokens) - non_torch_bytes)
    if free <= 0:
        return 0
    per_request = math.ceil(context_len / block_size) * block_size * kv_cache_bytes_per_token(config, dtype)
    return int(free // per_request)


@dataclass(frozen=True)
class GPUSpec:
    """Peak datasheet figures (dense, no sparsity). memory_bytes is what nvidia-smi reports."""

    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float | None
    nvlink_bytes_per_s: float  # per direction, per GPU
    pcie_bytes_per_s: float  # per direction (x16 link)
    # Fixed cost of one all-reduce over the TP group's link, whatever its size (the alpha of the
    # alpha-beta model): launch, synchronisation and link hops. Not a datasheet figure: small-message
    # all-reduces inside an NVLink node take a few microseconds (NCCL, vLLM's custom all-reduce).
    allreduce_latency_s: float = 5e-6


# Sources: NVIDIA's A100, H100 and H200 datasheets, SXM boards, dense peaks (sparsity halved away).
# memory_bytes is nvidia-smi's MiB total; NVLink's 600 / 900 GB/s are both directions together, so
# half per direction; PCIe Gen4 / Gen5 x16 move about 32 / 64 GB/s per direction. The A100 has no FP8
# tensor cores (fp8_flops None): FP8 weights run there as W8A16 (upcast before the matmul), and an
# FP8 KV cache only halves the bytes. All-reduce latency: the 5 us default of GPUSpec.
GPUS: dict[str, GPUSpec] = {
    # A100 SXM4 80GB: HBM2e 2.039 TB/s, 312 TFLOP/s bf16, NVLink3 600 GB/s total, PCIe Gen4 x16.
    "A100-80GB": GPUSpec("A100-80GB", 81920 * 2**20, 2.039e12, 312e12, None, 300e9, 32e9),
    # H100 SXM5 80GB: HBM3 3.35 TB/s, 989 TFLOP/s bf16, 1979 fp8, NVLink4 900 GB/s total, PCIe Gen5 x16.
    "H100-80GB": GPUSpec("H100-80GB", 81559 * 2**20, 3.35e12, 989e12, 1979e12, 450e9, 64e9),
    # H200 SXM 141GB: HBM3e 4.8 TB/s, same compute and links as H100.
    "H200-141GB": GPUSpec("H200-141GB", 143771 * 2**20, 4.8e12, 989e12, 1979e12, 450e9, 64e9),
}

# Cost-model defaults per device type (overridable in EngineConfig). "cpu" is a 2-core
# machine like CI's: fp32 GEMMs near 50 GFLOP/s and a memcpy near 5 GB/s.
DEFAULT_RATES: dict[str, tuple[float, float]] = {  # device type -> (prefill FLOP/s, swap bytes/s one way)
    "cpu": (50e9, 5e9),
    "cuda": (GPUS["H100-80GB"].bf16_flops * 0.5, GPUS["H100-80GB"].pcie_bytes_per_s),
}


def prefill_flops(config: Any, num_tokens: int, context_start: int = 0) -> float:
    """FLOPs to run `num_tokens` new tokens after `context_start` cached ones: 2 per matmul
    weight per token (the embedding is a lookup, not a matmul), the LM head for the last
    token only (the engine computes logits only for rows that emit), and causal attention
    (QK^T and PV, 2 FLOPs per multiply-add each)."""
    s = ModelSpec.of(config)
    dense = 2 * s.num_layers * _layer_matmul_params(s, active_only=True) * num_tokens
    head = 2 * s.vocab_size * s.hidden_size
    # token i attends to context_start + i + 1 keys
    keys = num_tokens * context_start + num_tokens * (num_tokens + 1) / 2
    attn = 4 * s.num_layers * s.num_attention_heads * s.head_dim * keys
    return dense + head + attn


def check_tp(config: Any, tp: int) -> None:
    """Raise unless `tp` shards the model the way vLLM does: query heads split evenly, and
    KV heads either split evenly or each replicated on tp / kv_heads GPUs."""
    s = ModelSpec.of(config)
    if not (isinstance(tp, int) and tp >= 1 and s.num_attention_heads % tp == 0
            and (s.num_kv_heads % tp == 0 or tp % s.num_kv_heads == 0)):
        raise ValueError(f"tp must be an int >= 1 that divides num_attention_heads={s.num_attention_heads} "
                         f"and divides or is a multiple of num_kv_heads={s.num_kv_heads}, got {tp!r}")


def kv_heads_per_gpu(config: Any, tp: int) -> int:
    """KV heads each GPU holds at TP degree `tp` (replicated once tp exceeds the KV heads)."""
    check_tp(config, tp)
    return max(1, ModelSpec.of(config).num_kv_heads // tp)


# seam: lab 01 (grader/seams.py)
def allreduce_seconds(config: Any, dtype: torch.dtype | str, num_tokens: int, gpu: GPUSpec, tp: int) -> float:
    """Time of one forward's all-reduces at TP degree `tp`, alpha-beta model: two per layer (after
    the attention output and the MLP down projection), each costing the link's fixed latency
    (`gpu.allreduce_latency_s`, alpha) plus its bytes over the link's bandwidth (beta): a ring
    all-reduce of num_tokens x hidden activations sends 2 (tp - 1) / tp of the tensor per GPU over
    `gpu.nvlink_bytes_per_s`. Activations travel in 16 bits or wider even with fp8 weights."""
    if tp == 1:
        return 0.0
    s = ModelSpec.of(config)
    tensor_bytes = num_tokens * s.hidden_size * max(2, dtype_bytes(dtype))
    one = gpu.allreduce_latency_s + 2 * (tp - 1) / tp * tensor_bytes / gpu.nvlink_bytes_per_s
    return 2 * s.num_layers * one


# seam: lab 01 (grader/seams.py)
def decode_step_lower_bound(config: Any, dtype: torch.dtype | str, batch_size: int, context_len: int,
                            gpu: GPUSpec, tp: int = 1) -> float:
    """Seconds for one decode step of `batch_size` requests, each attending `context_len` keys,
    on `tp` GPUs: the larger of reading the shard's weights + live KV over HBM bandwidth and
    its FLOPs over peak bf16 compute, plus the all-reduces. Small batches are memory-bound.
    MoE: every expert is read (a batch touches all of them once batch * top_k >= experts)."""
    s = ModelSpec.of(config)
    kv_per_token = kv_cache_bytes_per_token(config, dtype) * kv_heads_per_gpu(config, tp) // s.num_kv_heads
    bytes_read = weight_bytes(config, dtype) / tp + batch_size * context_len * kv_per_token
    flops = batch_size * prefill_flops(config, 1, context_start=context_len - 1) / tp
    roofline = max(bytes_read / gpu.hbm_bytes_per_s, flops / gpu.bf16_flops)
    return roofline + allreduce_seconds(config, dtype, batch_size, gpu, tp)


# seam: lab 01 (grader/seams.py)
def prefill_lower_bound(config: Any, dtype: torch.dtype | str, num_tokens: int, gpu: GPUSpec, tp: int = 1) -> float:
    """Seconds to prefill one prompt of `num_tokens` on `tp` GPUs: the larger of moving the
    shard's weights + writing the prompt's KV over HBM and its FLOPs over peak compute, plus
    the all-reduces. Compute-bound for all but tiny prompts."""
    s = ModelSpec.of(config)
    kv_per_token = kv_cache_bytes_per_token(config, dtype) * kv_heads_per_gpu(config, tp) // s.num_kv_heads
    bytes_moved = weight_bytes(config, dtype) / tp + num_tokens * kv_per_token
    flops = prefill_flops(config, num_tokens) / tp
    roofline = max(bytes_moved / gpu.hbm_bytes_per_s, flops / gpu.bf16_flops)
    return roofline + allreduce_seconds(config, dtype, num_tokens, gpu, tp)


def recompute_seconds(config: Any, num_tokens: int, flops_per_s: float) -> float:
    """Cost of preempting by recompute: prefilling the request's tokens again."""
    return prefill_flops(config, num_tokens) / flops_per_s


def swap_seconds(config: Any, num_tokens: int, dtype: torch.dtype | str, bytes_per_s: float) -> float:
    """Cost of preempting by swap: the request's KV over the host link, out and back in."""
    return 2 * num_tokens * kv_cache_bytes_per_token(config, dtype) / bytes_per_s


@dataclass(frozen=True)
class CapacityPlan:
    """How many GPUs serve a load, and the model's estimates that show the targets hold."""

    gpu: str
    tp: int  # tensor-parallel degree of one replica
    replicas: int
    num_gpus: int  # tp * replicas
    batch_size: int  # running requests per replica in steady state
    ttft_s: float
    tpot_s: float
    replica_requests_per_s: float  # what one replica sustains at batch_size
    memory_per_gpu_bytes: float  # weight shard + the batch's KV at full length


def replica_estimates(config: Any, dtype: torch.dtype | str, tp: int, batch_size: int, prompt_len: int,
                      output_len: int, gpu: GPUSpec) -> tuple[float, float, float]:
    """(TTFT, TPOT, requests/s) of one replica at steady state with `batch_size` running.

    Running requests sit evenly spread over their output, so the mean context is
    prompt + output/2, and each step batch/output of them finish and are replaced: a step
    is one decode step plus batch/output prefills (chunked prefill spreads them over steps).
    A new request waits at most one step, then its own prefill gives its first token.
    """
    prefill = prefill_lower_bound(config, dtype, prompt_len, gpu, tp)
    step = decode_step_lower_bound(config, dtype, batch_size, prompt_len + output_len // 2, gpu, tp)
    tpot = step + batch_size / output_len * prefill
    return prefill + tpot, tpot, batch_size / (output_len * tpot)


def tp_degrees(config: Any, max_tp: int) -> list[int]:
    """TP degrees 1, 2, 4, ... up to `max_tp` (8: one NVLink node) that shard the model (`check_tp`)."""
    degrees, tp = [], 1
    while tp <= max_tp:
        try:
            check_tp(config, tp)
            degrees.append(tp)
        except ValueError:
            pass
        tp *= 2
    return degrees


def check_capacity_args(requests_per_s: float, prompt_len: int, output_len: int, ttft_s: float, tpot_s: float,
                        gpu: GPUSpec | str, utilization: float, max_tp: int, max_batch_size: int,
                        block_size: int) -> GPUSpec:
    """Validate `capacity_plan`'s arguments (ValueError naming the first bad one); returns the GPUSpec."""
    if isinstance(gpu, str):
        if gpu not in GPUS:
            raise ValueError(f"gpu must be a GPUSpec or one of {sorted(GPUS)}, got {gpu!r}")
        gpu = GPUS[gpu]
    if not isinstance(gpu, GPUSpec):
        raise ValueError(f"gpu must be a GPUSpec or one of {sorted(GPUS)}, got {gpu!r}")
    for name, value in (("requests_per_s", requests_per_s), ("ttft_s", ttft_s), ("tpot_s", tpot_s)):
        if not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    for name, value in (("prompt_len", prompt_len), ("output_len", output_len), ("max_tp", max_tp),
                        ("max_batch_size", max_batch_size), ("block_size", block_size)):
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not (isinstance(utilization, (int, float)) and 0 < utilization <= 1):
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    return gpu


# seam: lab 01 (grader/seams.py)
def capacity_plan(config: Any, dtype: torch.dtype | str, requests_per_s: float, prompt_len: int, output_len: int,
                  ttft_s: float, tpot_s: float, gpu: GPUSpec | str, utilization: float = 0.9,
                  max_tp: int = 8, max_batch_size: int = 256, block_size: int = 16) -> CapacityPlan | None:
    """The fewest GPUs that serve `requests_per_s` within the TTFT and TPOT targets, or None.

    For each TP degree t of `tp_degrees`: each GPU holds weights/t plus its share of the
    batch's KV at full length (prompt + output, rounded up to blocks) within `utilization`
    of its memory; the largest batch (<= max_batch_size, vLLM's max_num_seqs) whose
    `replica_estimates` meet both targets sets the replica's throughput; replicas =
    ceil(load / that). Ties go to the smaller t (less communication).
    """
    gpu = check_capacity_args(requests_per_s, prompt_len, output_len, ttft_s, tpot_s, gpu, utilization, max_tp,
                              max_batch_size, block_size)
    s = ModelSpec.of(config)
    best: CapacityPlan | None = None
    for tp in tp_degrees(s, max_tp):
        plan = _replica_plan(s, dtype, tp, prompt_len, output_len, ttft_s, tpot_s, gpu, utilization,
                             max_batch_size, block_size)
        if plan is not None:
            replicas = math.ceil(requests_per_s / plan.replica_requests_per_s)
            plan = replace(plan, replicas=replicas, num_gpus=tp * replicas)
            if best is None or plan.num_gpus < best.num_gpus:
                best = plan
    return best


def _replica_plan(s: ModelSpec, dtype: torch.dtype | str, tp: int, prompt_len: int, output_len: int,
                  ttft_s: float, tpot_s: float, gpu: GPUSpec, utilization: float, max_batch_size: int,
                  block_size: int) -> CapacityPlan | None:
    """One replica at TP degree `tp` with its largest batch that fits and meets both targets."""
    kv_per_token = kv_cache_bytes_per_token(s, dtype) * kv_heads_per_gpu(s, tp) // s.num_kv_heads
    per_request = math.ceil((prompt_len + output_len) / block_size) * block_size * kv_per_token
    weights = weight_bytes(s, dtype) / tp
    fits = int((gpu.memory_bytes * utilization - weights) // per_request)
    for batch in range(min(fits, max_batch_size), 0, -1):  # the estimates grow with the batch
        ttft, tpot, rate = replica_estimates(s, dtype, tp, batch, prompt_len, output_len, gpu)
        if ttft <= ttft_s and tpot <= tpot_s:
            return CapacityPlan(gpu.name, tp, 0, 0, batch, ttft, tpot, rate, weights + batch * per_request)
    return None
