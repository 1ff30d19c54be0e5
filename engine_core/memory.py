"""The engine's memory model: bytes of KV per token, of the weights and of the activation peak, prefill FLOPs,
and what preempting a request costs.

Every function takes a model `config` as a `ModelSpec`, a Hugging Face config object
or a plain `config.json` dict, and a dtype as a torch dtype or a name ("fp16", "bf16",
"fp32", "fp8"). The engine sizes its KV cache with `kv_cache_bytes_per_token` and its activation
peak with `activation_bytes`; the scheduler's recompute-or-swap cost model uses `recompute_seconds` /
`swap_seconds`. Lab 01 has the learner rewrite the seams here and in `capacity_planner.py`, which
builds on them (GPU datasheets, roofline bounds, capacity plans).
"""
from __future__ import annotations

from dataclasses import dataclass
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


# Cost-model defaults per device type (overridable in EngineConfig). "cpu" is a 2-core
# machine like CI's: fp32 GEMMs near 50 GFLOP/s and a memcpy near 5 GB/s.
DEFAULT_RATES: dict[str, tuple[float, float]] = {  # device type -> (prefill FLOP/s, swap bytes/s one way)
    "cpu": (50e9, 5e9),
    # half an H100's dense bf16 peak, its PCIe Gen5 x16 link one way (capacity_planner.GPUS["H100-80GB"])
    "cuda": (989e12 * 0.5, 64e9),
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


def recompute_seconds(config: Any, num_tokens: int, flops_per_s: float) -> float:
    """Cost of preempting by recompute: prefilling the request's tokens again."""
    return prefill_flops(config, num_tokens) / flops_per_s


def swap_seconds(config: Any, num_tokens: int, dtype: torch.dtype | str, bytes_per_s: float) -> float:
    """Cost of preempting by swap: the request's KV over the host link, out and back in."""
    return 2 * num_tokens * kv_cache_bytes_per_token(config, dtype) / bytes_per_s
