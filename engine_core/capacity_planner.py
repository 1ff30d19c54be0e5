"""Lab 01's capacity planner: how many requests fit on a GPU, a 4-bit GPTQ model's bytes, GPU datasheets, roofline
lower bounds of a step, the alpha-beta cost of tensor parallelism's all-reduces, and capacity plans (requests/s ->
GPUs at a tensor-parallel degree). No engine path runs it: it answers sizing questions from a model's shape, with
the engine's memory model (`memory.py`) for the bytes and FLOPs. Lab 01 has the learner rewrite its seams.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine_core.memory import (ModelSpec, activation_bytes, dtype_bytes, kv_cache_bytes_per_token, num_params,
                                prefill_flops, weight_bytes)


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


def _gptq_projections(config: Any) -> list[tuple[int, int, int]]:
    """(in_features K, out_features N, how many) of the projections of one layer a GPTQ checkpoint quantizes: q, k,
    v, o, and gate, up, down of every expert. An MoE router stays 16-bit, as GPTQ checkpoints keep it."""
    s = ModelSpec.of(config)
    q, kv, h, i = s.num_attention_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.hidden_size, s.intermediate_size
    experts = s.num_experts or 1
    return [(h, q, 1), (h, kv, 2), (q, h, 1), (h, i, 2 * experts), (i, h, experts)]


# seam: lab 01 (grader/seams.py)
def int4_weight_bytes(config: Any, group_size: int = 128) -> int:
    """Bytes of a 4-bit GPTQ model's weights: per quantized linear of K inputs and N outputs the four tensors vLLM's
    GPTQ loader reads, `qweight` (4 bits per weight, 8 per int32: K N / 2 bytes), `scales` (fp16, one per group of
    `group_size` input rows and output column), `qzeros` (4 bits per group and column) and `g_idx` (int32 per input
    row); the embeddings, the LM head, norms, biases and an MoE router stay 16-bit, as in GPTQ checkpoints."""
    s = ModelSpec.of(config)
    projections = _gptq_projections(s)
    if not (isinstance(group_size, int) and group_size >= 1 and all(k % group_size == 0 for k, _, _ in projections)):
        raise ValueError(f"group_size must be an int >= 1 that divides every projection's input size "
                         f"{sorted({k for k, _, _ in projections})}, got {group_size!r}")
    packed = quantized = 0
    for k, n, count in projections:
        groups = k // group_size
        packed += count * (k * n // 2 + 2 * groups * n + groups * n // 2 + 4 * k)  # qweight, scales, qzeros, g_idx
        quantized += count * k * n
    return s.num_layers * packed + 2 * (num_params(s) - s.num_layers * quantized)


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
