"""The capacity model: bytes of weights and KV, how many requests fit, roofline lower bounds.

Every function takes a model `config` as a `ModelSpec`, a Hugging Face config object
or a plain `config.json` dict, and a dtype as a torch dtype or a name ("fp16", "bf16",
"fp32", "fp8"). The engine sizes its KV cache with `kv_cache_bytes_per_token`; the
scheduler's recompute-or-swap cost model uses `recompute_seconds` / `swap_seconds`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

_DTYPE_BYTES = {
    "fp32": 4, "float32": 4, "float": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "float8_e4m3fn": 1, "int8": 1,
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
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
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
        return cls(
            num_layers=c["num_hidden_layers"],
            hidden_size=c["hidden_size"],
            num_attention_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            intermediate_size=(c.get("moe_intermediate_size") if experts else None) or c["intermediate_size"],
            vocab_size=c["vocab_size"],
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            attention_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
            qk_norm=c.get("model_type", "").startswith("qwen3"),
            num_experts=experts,
            num_experts_per_tok=c.get("num_experts_per_tok", 0) if experts else 0,
        )


def kv_cache_bytes_per_token(config: Any, dtype: torch.dtype | str) -> int:
    """K and V, every layer, every KV head: 2 * layers * kv_heads * head_dim * bytes."""
    s = ModelSpec.of(config)
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * dtype_bytes(dtype)


def _layer_params(s: ModelSpec, active_only: bool) -> int:
    q = s.num_attention_heads * s.head_dim
    kv = s.num_kv_heads * s.head_dim
    attn = s.hidden_size * (q + 2 * kv) + q * s.hidden_size
    if s.attention_bias:
        attn += q + 2 * kv
    if s.qk_norm:
        attn += 2 * s.head_dim
    mlp = 3 * s.hidden_size * s.intermediate_size  # gate, up, down (SwiGLU)
    if s.num_experts:
        experts = s.num_experts_per_tok if active_only else s.num_experts
        mlp = experts * mlp + s.hidden_size * s.num_experts  # + router
    return attn + mlp + 2 * s.hidden_size  # + two RMSNorm weights


def num_params(config: Any, active_only: bool = False) -> int:
    """Parameters; `active_only` counts only the experts one token runs through (MoE)."""
    s = ModelSpec.of(config)
    embed = s.vocab_size * s.hidden_size
    head = 0 if s.tie_word_embeddings else embed
    return s.num_layers * _layer_params(s, active_only) + embed + head + s.hidden_size


def weight_bytes(config: Any, dtype: torch.dtype | str) -> int:
    """Bytes of all weights (every expert of an MoE model sits in memory)."""
    return num_params(config) * dtype_bytes(dtype)


def max_concurrent_requests(gpu_bytes: float, utilization: float, config: Any, context_len: int,
                            dtype: torch.dtype | str, block_size: int = 1) -> int:
    """Requests of `context_len` tokens whose KV fits beside the weights in `utilization` of the GPU."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization!r}")
    free = gpu_bytes * utilization - weight_bytes(config, dtype)
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
    """FLOPs to run `num_tokens` new tokens after `context_start` cached ones: 2 per weight
    per token plus causal attention (QK^T and PV, 2 FLOPs per multiply-add each)."""
    s = ModelSpec.of(config)
    dense = 2 * num_params(config, active_only=True) * num_tokens
    # token i attends to context_start + i + 1 keys
    keys = num_tokens * context_start + num_tokens * (num_tokens + 1) / 2
    attn = 4 * s.num_layers * s.num_attention_heads * s.head_dim * keys
    return dense + attn


def decode_step_lower_bound(config: Any, dtype: torch.dtype | str, batch_size: int, context_len: int,
                            gpu: GPUSpec) -> float:
    """Seconds for one decode step: the larger of reading weights + live KV over HBM
    bandwidth and the step's FLOPs over peak compute. Small batches are memory-bound."""
    bytes_read = weight_bytes(config, dtype) + batch_size * context_len * kv_cache_bytes_per_token(config, dtype)
    flops = batch_size * prefill_flops(config, 1, context_start=context_len - 1)
    return max(bytes_read / gpu.hbm_bytes_per_s, flops / gpu.bf16_flops)


def prefill_lower_bound(config: Any, dtype: torch.dtype | str, num_tokens: int, gpu: GPUSpec) -> float:
    """Seconds to prefill one prompt of `num_tokens`: compute-bound for all but tiny prompts."""
    bytes_moved = weight_bytes(config, dtype) + num_tokens * kv_cache_bytes_per_token(config, dtype)
    return max(bytes_moved / gpu.hbm_bytes_per_s, prefill_flops(config, num_tokens) / gpu.bf16_flops)


def recompute_seconds(config: Any, num_tokens: int, flops_per_s: float) -> float:
    """Cost of preempting by recompute: prefilling the request's tokens again."""
    return prefill_flops(config, num_tokens) / flops_per_s


def swap_seconds(config: Any, num_tokens: int, dtype: torch.dtype | str, bytes_per_s: float) -> float:
    """Cost of preempting by swap: the request's KV over the host link, out and back in."""
    return 2 * num_tokens * kv_cache_bytes_per_token(config, dtype) / bytes_per_s
