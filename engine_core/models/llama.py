"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 and Qwen3, loaded from a local folder.

The members differ in a few switches, parsed from config.json into `LlamaArgs` (models/config.py):
qkv and o_proj bias, q/k RMSNorm (Qwen3), head_dim, tied embeddings, RoPE scaling.

Weights are fused at load time (q|k|v into one matmul, gate|up into another): fewer, larger
GEMMs. The forward takes the batch metadata explicitly: `forward(input_ids, positions, kv_cache,
attn_metadata)` over one flat varlen batch of tokens. Every projection is a `models.linear.Linear`:
the GEMM, plus each row's LoRA delta when the step has adapters (`attn_metadata.lora`).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.models.attention import AttentionMetadata, AttentionPlan, PagedKVCache
from engine_core.models.config import LlamaArgs
from engine_core.models.linear import Linear
from engine_core.models.loader import CheckpointReader
from engine_core.models.lora import LoRAMapping


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

    def forward(self, x: torch.Tensor, op: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None
                ) -> torch.Tensor:
        """`op`: the step's fused RMSNorm (`KernelOps.rms_norm`: one C call for fp32 CPU rows) instead of six ops."""
        if op is not None and x.dim() == 2:
            return op(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


def _linear(ckpt: CheckpointReader, names: list[str], bias: bool) -> Linear:
    """One Linear over the checkpoint matrices `names` stacked along the output dimension."""
    weight = torch.cat([ckpt.get(f"{n}.weight") for n in names])
    return Linear(_param(weight), _param(torch.cat([ckpt.get(f"{n}.bias") for n in names])) if bias else None)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, ckpt: CheckpointReader, prefix: str, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = args.head_dim ** -0.5
        self.qkv_proj = _linear(ckpt, [f"{prefix}.{p}_proj" for p in "qkv"], args.qkv_bias)
        self.o_proj = _linear(ckpt, [f"{prefix}.o_proj"], args.o_bias)
        self.q_norm = RMSNorm(ckpt.get(f"{prefix}.q_norm.weight"), args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(ckpt.get(f"{prefix}.k_norm.weight"), args.rms_norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, rope: "Rope", kv_cache: PagedKVCache, plan: AttentionPlan,
                residual: torch.Tensor, only_output_rows: bool = False) -> torch.Tensor:
        """residual + o_proj(attention). `only_output_rows`: write K/V for every row, compute the
        rest for plan.output_rows only (`residual` is then those rows')."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        lora = plan.meta.lora
        qkv = self.qkv_proj(x, lora=lora and lora.all_rows).view(-1, h + 2 * kvh, d)
        if self.q_norm is None:  # q and k rotate in one pass: [tokens, h + kvh, d]
            qk = rope(qkv[:, :h + kvh])
            q, k = qk[:, :h], qk[:, h:]
        else:
            q, k = rope(self.q_norm(qkv[:, :h])), rope(self.k_norm(qkv[:, h:h + kvh]))
        v = qkv[:, h + kvh:]
        i = self.layer_idx
        if kv_cache.observer is not None:  # dynamic fp8 scales or a calibration run
            kv_cache.observer(i, k, v)
        kv = kv_cache.layer(i)
        plan.write_kv(k, v, kv)
        out = (plan.attend_output_rows if only_output_rows else plan.attend)(q, kv, self.scale)
        return self.o_proj(out.reshape(-1, h * d), residual, lora and lora.rows(only_output_rows))


class Rope:
    """One step's rotate-half RoPE on `[tokens, heads, head_dim]`. With the step's fused op
    (`KernelOps.rotary_embedding`, a C kernel) it rotates in place, reading the cos/sin table rows by
    position itself. Otherwise the PyTorch formula, with the rows gathered once per step
    (`[tokens, 1, head_dim/2]`)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 op: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] | None) -> None:
        self.op = op
        if op is not None:
            self.positions, self.cos, self.sin = positions, cos, sin
        else:
            self.cos, self.sin = cos[positions, None], sin[positions, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.op is not None:
            self.op(x, self.positions, self.cos, self.sin)
            return x
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * self.cos - x2 * self.sin, x2 * self.cos + x1 * self.sin), dim=-1)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, args: LlamaArgs, ckpt: CheckpointReader, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = _linear(ckpt, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], args.mlp_bias)
        self.down_proj = _linear(ckpt, [f"{prefix}.down_proj"], args.mlp_bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor,
                silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None,
                lora: LoRAMapping | None = None) -> torch.Tensor:
        """residual + mlp(x). `silu_and_mul`: the step's fused op (`KernelOps.silu_and_mul`, one C call)."""
        gate_up = self.gate_up_proj(x, lora=lora)
        if silu_and_mul is not None:
            return self.down_proj(silu_and_mul(gate_up), residual, lora)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up, residual, lora)


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, ckpt: CheckpointReader, i: int) -> None:
        super().__init__()
        p = f"model.layers.{i}"
        self.input_norm = RMSNorm(ckpt.get(f"{p}.input_layernorm.weight"), args.rms_norm_eps)
        self.attn = Attention(args, ckpt, f"{p}.self_attn", i)
        self.post_attn_norm = RMSNorm(ckpt.get(f"{p}.post_attention_layernorm.weight"), args.rms_norm_eps)
        self.mlp = MLP(args, ckpt, f"{p}.mlp")

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: PagedKVCache, plan: AttentionPlan,
                only_output_rows: bool = False) -> torch.Tensor:
        residual = x[plan.output_rows] if only_output_rows else x
        ops = plan.ops
        x = self.attn(self.input_norm(x, ops.rms_norm), rope, kv_cache, plan, residual, only_output_rows)
        lora = plan.meta.lora
        return self.mlp(self.post_attn_norm(x, ops.rms_norm), x, ops.silu_and_mul, lora and lora.rows(only_output_rows))


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
        self.lm_head_proj = Linear(self.lm_head)
        # cos/sin for every position once, as Hugging Face computes them: (pos * inv_freq).cos()
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rope_inv_freq(args)[None, :]
        self.register_buffer("cos", freqs.cos().to(device=self.embed.device, dtype=self.embed.dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device=self.embed.device, dtype=self.embed.dtype), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed)
        plan = AttentionPlan(attn_metadata, x.device, x.dtype)  # the step's kernels, picked once
        rope = Rope(self.cos, self.sin, positions, plan.ops.rotary_embedding)
        only_output_rows = attn_metadata.output_rows is not None
        for layer in self.layers[:-1]:
            x = layer(x, rope, kv_cache, plan)
        x = self.layers[-1](x, rope, kv_cache, plan, only_output_rows)
        return self.norm(x, plan.ops.rms_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head_proj(hidden).float()


def load_model(folder: str | Path, args: LlamaArgs, dtype: torch.dtype, device: torch.device,
               max_positions: int) -> LlamaForCausalLM:
    """Build the model from `folder`'s safetensors; `args` is its parsed config.json."""
    ckpt = CheckpointReader(folder, dtype, device)
    return LlamaForCausalLM(args, ckpt, max_positions).eval()
