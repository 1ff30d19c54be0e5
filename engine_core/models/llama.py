"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 and Qwen3, loaded from a local folder.

The members differ in a few switches, all read from config.json:
- qkv bias (Qwen2 always; Llama/Qwen3 when `attention_bias`), o_proj bias (Llama/Qwen3 `attention_bias`);
- per-head RMSNorm of q and k before RoPE (Qwen3), `head_dim` that is not hidden/heads;
- tied embeddings (the LM head is the embedding matrix);
- RoPE: default, linear or llama3 scaling, from `rope_parameters` (transformers >= 5) or
  `rope_theta` + `rope_scaling` (older checkpoints).

Weights are fused at load time (q|k|v into one matmul, gate|up into another): fewer, larger
GEMMs. The forward takes the batch metadata explicitly: `forward(input_ids, positions, kv_cache,
attn_metadata)` over one flat varlen batch of tokens. Every projection goes through
`models.lora.lora_linear`: the GEMM, plus each row's LoRA delta when the step has adapters.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.worker.kv_cache import KVCache
from engine_core.models.attention import AttentionMetadata, attend, attend_output_rows, write_kv
from engine_core.models.config import LlamaArgs
from engine_core.models.loader import CheckpointReader
from engine_core.models.lora import LoRAMapping, LoRAStack, lora_linear


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Inverse frequencies, computed exactly as Hugging Face does (bit-identical cos/sin tables)."""
    p, dim = args.rope, args.head_dim
    inv_freq = 1.0 / (p["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if p["rope_type"] == "linear":
        return inv_freq / p["factor"]
    if p["rope_type"] == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_len = p["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (Hugging Face's order of operations)."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, ckpt: CheckpointReader, prefix: str, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = args.head_dim ** -0.5
        names = [f"{prefix}.{p}_proj" for p in "qkv"]
        self.qkv_weight = _param(torch.cat([ckpt.get(f"{n}.weight") for n in names]))
        self.qkv_bias = _param(torch.cat([ckpt.get(f"{n}.bias") for n in names])) if args.qkv_bias else None
        self.o_weight = _param(ckpt.get(f"{prefix}.o_proj.weight"))
        self.o_bias = _param(ckpt.get(f"{prefix}.o_proj.bias")) if args.o_bias else None
        self.q_norm = RMSNorm(ckpt.get(f"{prefix}.q_norm.weight"), args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(ckpt.get(f"{prefix}.k_norm.weight"), args.rms_norm_eps) if args.qk_norm else None
        self.qkv_lora: LoRAStack | None = None  # slot weights, set when the engine serves LoRA
        self.o_lora: LoRAStack | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, only_output_rows: bool = False) -> torch.Tensor:
        """`only_output_rows`: write K/V for every row, return results for meta.output_rows only."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        lora = meta.lora
        qkv = lora_linear(x, self.qkv_weight, self.qkv_bias, self.qkv_lora, lora and lora.all_rows)
        qkv = qkv.view(-1, h + 2 * kvh, d)
        q, k, v = qkv.split([h, kvh, kvh], dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        i = self.layer_idx
        if kv_cache.needs_scales:
            kv_cache.calibrate_scales(i, k, v)
        cache = (kv_cache.key[i], kv_cache.value[i], kv_cache.k_scale[i], kv_cache.v_scale[i])
        write_kv(k, v, *cache, meta)
        out = (attend_output_rows if only_output_rows else attend)(q, *cache, meta, self.scale)
        return lora_linear(out.reshape(-1, h * d), self.o_weight, self.o_bias, self.o_lora,
                           lora and lora.rows(only_output_rows))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on `[tokens, heads, head_dim]`; cos/sin are `[tokens, head_dim/2]`."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, args: LlamaArgs, ckpt: CheckpointReader, prefix: str) -> None:
        super().__init__()
        gate_up = [f"{prefix}.gate_proj", f"{prefix}.up_proj"]
        self.gate_up_weight = _param(torch.cat([ckpt.get(f"{n}.weight") for n in gate_up]))
        self.gate_up_bias = _param(torch.cat([ckpt.get(f"{n}.bias") for n in gate_up])) if args.mlp_bias else None
        self.down_weight = _param(ckpt.get(f"{prefix}.down_proj.weight"))
        self.down_bias = _param(ckpt.get(f"{prefix}.down_proj.bias")) if args.mlp_bias else None
        self.gate_up_lora: LoRAStack | None = None  # slot weights, set when the engine serves LoRA
        self.down_lora: LoRAStack | None = None

    def forward(self, x: torch.Tensor, lora: LoRAMapping | None = None) -> torch.Tensor:
        gate, up = lora_linear(x, self.gate_up_weight, self.gate_up_bias, self.gate_up_lora, lora).chunk(2, dim=-1)
        return lora_linear(F.silu(gate) * up, self.down_weight, self.down_bias, self.down_lora, lora)


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, ckpt: CheckpointReader, i: int) -> None:
        super().__init__()
        p = f"model.layers.{i}"
        self.input_norm = RMSNorm(ckpt.get(f"{p}.input_layernorm.weight"), args.rms_norm_eps)
        self.attn = Attention(args, ckpt, f"{p}.self_attn", i)
        self.post_attn_norm = RMSNorm(ckpt.get(f"{p}.post_attention_layernorm.weight"), args.rms_norm_eps)
        self.mlp = MLP(args, ckpt, f"{p}.mlp")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata, only_output_rows: bool = False) -> torch.Tensor:
        attn = self.attn(self.input_norm(x), cos, sin, kv_cache, meta, only_output_rows)
        x = (x[meta.output_rows] if only_output_rows else x) + attn
        return x + self.mlp(self.post_attn_norm(x), meta.lora and meta.lora.rows(only_output_rows))


class LlamaForCausalLM(nn.Module):
    """The whole decoder. `forward` returns final hidden states: of every row, or, when
    `attn_metadata.output_rows` is set, of those rows only (the ones that emit a token), which
    skips the last layer's attention and MLP for every other row. `compute_logits` is the LM head."""

    def __init__(self, args: LlamaArgs, ckpt: CheckpointReader, max_positions: int) -> None:
        super().__init__()
        self.args = args
        self.embed = _param(ckpt.get("model.embed_tokens.weight"))
        self.layers = nn.ModuleList(DecoderLayer(args, ckpt, i) for i in range(args.num_layers))
        self.norm = RMSNorm(ckpt.get("model.norm.weight"), args.rms_norm_eps)
        if args.tie_word_embeddings and not ckpt.has("lm_head.weight"):
            self.lm_head = self.embed
        else:
            self.lm_head = _param(ckpt.get("lm_head.weight"))
        # cos/sin for every position once, as Hugging Face computes them: (pos * inv_freq).cos()
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rope_inv_freq(args)[None, :]
        self.register_buffer("cos", freqs.cos().to(device=self.embed.device, dtype=self.embed.dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device=self.embed.device, dtype=self.embed.dtype), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.cos[positions], self.sin[positions]
        only_output_rows = attn_metadata.output_rows is not None
        for layer in self.layers[:-1]:
            x = layer(x, cos, sin, kv_cache, attn_metadata)
        x = self.layers[-1](x, cos, sin, kv_cache, attn_metadata, only_output_rows)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()


def load_model(folder: str | Path, args: LlamaArgs, dtype: torch.dtype, device: torch.device,
               max_positions: int) -> LlamaForCausalLM:
    """Build the model from `folder`'s safetensors; `args` is its parsed config.json."""
    ckpt = CheckpointReader(folder, dtype, device)
    return LlamaForCausalLM(args, ckpt, max_positions).eval()
