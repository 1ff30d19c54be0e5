"""The Llama-family decoder: Llama 2/3, Mistral, Qwen2 and Qwen3, loaded from a local folder.

The members differ in a few switches, parsed from config.json into `LlamaArgs` (models/config.py):
qkv and o_proj bias, q/k RMSNorm (Qwen3), head_dim, tied embeddings, RoPE scaling.

Weights are fused at load time (q|k|v into one matmul, gate|up into another): fewer, larger
GEMMs. The forward takes the batch metadata explicitly: `forward(input_ids, positions, kv_cache,
attn_metadata)` over one flat varlen batch of tokens. Every projection is a `models.linear.Linear`:
the GEMM, plus each row's LoRA delta when the step has adapters (`attn_metadata.lora`).

With a `ParallelContext` (a worker of a parallel engine) the model holds one TP rank's shard of one
pipeline stage: its query/KV heads, MLP columns and vocab rows (models/parallel_linear.py), and the
stage's layers (`start_layer:end_layer`, whose KV caches the stage's `PagedKVCache` numbers from 0). A
stage after the first receives the hidden state instead of embedding tokens; one before the last
sends it on and returns None. The residual is folded into the hidden state (each layer returns
residual + its output), so that one tensor is all a stage hands the next.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine_core.models.attention import AttentionMetadata, AttentionPlan, PagedKVCache
from engine_core.config import QuantizationConfig
from engine_core.distributed.parallel_state import GroupCoordinator, ParallelContext
from engine_core.models.config import LlamaArgs
from engine_core.models.linear import Linear
from engine_core.models.loader import CheckpointReader
from engine_core.models.lora import LoRAMapping
from engine_core.models.quantization.gguf_q8_0 import Q8_0LinearMethod
from engine_core.models.quantization.scheme import WeightScheme
from engine_core.models.parallel_linear import (COLUMN, ROW, ParallelLMHead, RowParallelLinear, TPShard,
                                                VocabParallelEmbedding)


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
        """`op`: the step's fused RMSNorm (`KernelOps.rms_norm`: one C call for fp32 or bf16 CPU rows) instead of six ops."""
        if op is not None and x.dim() == 2:
            return op(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _param(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


def _sharded_linear(ckpt: CheckpointReader, prefix: str, projections: list[str], bias: bool,
                    shards: dict[str, tuple[int, slice]] | None, tp: TPShard | None, scheme: WeightScheme) -> Linear:
    """`prefix`'s `projections` as one Linear: whole, or (tp) as this rank's `shards` say: column-parallel
    (their rows, stacked; no communication) or one row-parallel projection (its input columns, then an
    all-reduce)."""
    names = [f"{prefix}.{p}" for p in projections]
    if tp is None:
        return scheme.linear(ckpt, names, bias)
    dims = {shards[p][0] for p in projections}
    if dims == {COLUMN}:
        return scheme.linear(ckpt, names, bias, [shards[p][1] for p in projections])
    if dims == {ROW} and len(names) == 1:
        weight = _param(ckpt.get(f"{names[0]}.weight")[:, shards[projections[0]][1]].contiguous())
        return RowParallelLinear(weight, _param(ckpt.get(f"{names[0]}.bias")) if bias else None, tp.group)
    raise ValueError(f"layer_shards: the fused projections {projections} must all be column-parallel, and a "
                     f"row-parallel projection stands alone; got {[shards[p] for p in projections]}")


def _num_heads(shard: tuple[int, slice] | None, head_dim: int, whole: int) -> int:
    """Heads in a rank's slice of q or k rows (`whole` without TP)."""
    if shard is None:
        return whole
    rows = shard[1]
    return (rows.stop - rows.start) // head_dim


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, ckpt: CheckpointReader, prefix: str, layer_idx: int,
                 tp: TPShard | None, scheme: WeightScheme) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # of its stage's KV cache
        d = args.head_dim
        shards = tp.layer(args.num_heads, args.num_kv_heads, d, args.intermediate_size) if tp else None
        self.num_heads = _num_heads(shards and shards["q_proj"], d, args.num_heads)
        self.num_kv_heads, self.head_dim = _num_heads(shards and shards["k_proj"], d, args.num_kv_heads), d
        self.scale = args.head_dim ** -0.5
        self.qkv_proj = _sharded_linear(ckpt, prefix, ["q_proj", "k_proj", "v_proj"], args.qkv_bias, shards, tp,
                                        scheme)
        self.o_proj = _sharded_linear(ckpt, prefix, ["o_proj"], args.o_bias, shards, tp, scheme)
        self.q_norm = RMSNorm(ckpt.get(f"{prefix}.q_norm.weight"), args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(ckpt.get(f"{prefix}.k_norm.weight"), args.rms_norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, rope: "Rope", kv_cache: PagedKVCache, plan: AttentionPlan,
                residual: torch.Tensor, only_output_rows: bool = False) -> torch.Tensor:
        """residual + o_proj(attention). `only_output_rows`: write K/V for every row, compute the
        rest for plan.output_rows only (`residual` is then those rows')."""
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        lora = plan.meta.lora
        qkv = self.qkv_proj(x, lora=lora and lora.all_rows)
        if self.q_norm is None and kv_cache.observer is None and rope.op is not None and not only_output_rows:
            block = plan.decode_block(rope.positions, rope.cos, rope.sin, h, kvh, d)
            if block is not None:  # a decode-only CPU step: RoPE, K/V write and attention in one C call
                kv = kv_cache.layer(self.layer_idx)
                return self.o_proj(block(qkv, kv.key_cache, kv.value_cache, self.scale), residual,
                                   lora and lora.rows(False))
        qkv = qkv.view(-1, h + 2 * kvh, d)
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
        if plan.meta.sliding_window is not None:
            out = plan.attend_window(q, kv, self.scale, only_output_rows)
        elif plan.meta.block_scores is not None:
            out = plan.attend_scored(q, kv, self.scale, only_output_rows)
        else:
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

    def __init__(self, args: LlamaArgs, ckpt: CheckpointReader, prefix: str, tp: TPShard | None,
                 scheme: WeightScheme) -> None:
        super().__init__()
        shards = tp.layer(args.num_heads, args.num_kv_heads, args.head_dim, args.intermediate_size) if tp else None
        self.gate_up_proj = _sharded_linear(ckpt, prefix, ["gate_proj", "up_proj"], args.mlp_bias, shards, tp, scheme)
        self.down_proj = _sharded_linear(ckpt, prefix, ["down_proj"], args.mlp_bias, shards, tp, scheme)

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
    def __init__(self, args: LlamaArgs, ckpt: CheckpointReader, i: int, kv_index: int | None,
                 tp: TPShard | None, scheme: WeightScheme) -> None:
        """Checkpoint layer `i`; `kv_index`: its layer of the KV cache (i unless a later pipeline stage)."""
        super().__init__()
        p = f"model.layers.{i}"
        self.input_norm = RMSNorm(ckpt.get(f"{p}.input_layernorm.weight"), args.rms_norm_eps)
        self.attn = Attention(args, ckpt, f"{p}.self_attn", i if kv_index is None else kv_index, tp, scheme)
        self.post_attn_norm = RMSNorm(ckpt.get(f"{p}.post_attention_layernorm.weight"), args.rms_norm_eps)
        self.mlp = MLP(args, ckpt, f"{p}.mlp", tp, scheme)

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

    def __init__(self, args: LlamaArgs, ckpt: CheckpointReader, max_positions: int,
                 parallel: ParallelContext | None = None, scheme: WeightScheme | None = None) -> None:
        super().__init__()
        scheme = scheme or WeightScheme()  # None: dense
        self.args, self.quant = args, scheme.quant
        tp = TPShard(parallel.tp) if parallel is not None and parallel.tp.world_size > 1 else None
        self.tp = tp
        # the pipeline group when there are stages; the first stage embeds, the last norms and samples
        self.pp: GroupCoordinator | None = parallel.pp if parallel is not None and parallel.pp.world_size > 1 else None
        self.is_first_stage = self.pp is None or self.pp.is_first_rank
        self.is_last_stage = self.pp is None or self.pp.is_last_rank
        self.start_layer, end = (0, args.num_layers) if parallel is None else (parallel.start_layer, parallel.end_layer)
        tied = args.tie_word_embeddings and not ckpt.has("lm_head.weight")
        self.embed = self.vocab_embed = self.lm_head = self.lm_head_proj = None
        if self.is_first_stage or (self.is_last_stage and tied):
            self.embed = _param(self._vocab_rows(ckpt.get("model.embed_tokens.weight")))
        if self.is_first_stage and tp is not None:
            self.vocab_embed = VocabParallelEmbedding(self.embed, args.vocab_size, tp.group)
        self.layers = nn.ModuleList(DecoderLayer(args, ckpt, i, i - self.start_layer, tp, scheme)
                                    for i in range(self.start_layer, end))
        if self.is_last_stage:
            self.norm = RMSNorm(ckpt.get("model.norm.weight"), args.rms_norm_eps)
            self.lm_head = self.embed if tied else _param(self._vocab_rows(ckpt.get("lm_head.weight")))
            head = scheme.lm_head(self.lm_head, tied) if tp is None else None
            if head is None:
                head = Linear(self.lm_head) if tp is None else ParallelLMHead(self.lm_head, args.vocab_size, tp.group)
            self.lm_head_proj = head
        # cos/sin for every position once, as Hugging Face computes them: (pos * inv_freq).cos()
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rope_inv_freq(args)[None, :]
        self.register_buffer("cos", freqs.cos().to(device=ckpt.device, dtype=ckpt.dtype), persistent=False)
        self.register_buffer("sin", freqs.sin().to(device=ckpt.device, dtype=ckpt.dtype), persistent=False)

    def _vocab_rows(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.tp is None else VocabParallelEmbedding.shard(full, self.tp.group)

    def weight_bytes(self) -> int:
        """Bytes of every weight this model holds: the projections as their scheme stores them, plus the
        dense tensors (embedding, LM head when not tied, norms)."""
        return sum(self.weight_bytes_by_scheme().values())

    def weight_bytes_by_scheme(self) -> dict[str, int]:
        """`weight_bytes` split by how the bytes are stored: the projections under their `quantization` scheme's
        name (dense ones under their dtype's; a gguf model's Q8_0 LM head under "gguf"), every other tensor
        (embedding, norms, a dense LM head) under its dtype's."""
        linears = [m for m in self.modules() if isinstance(m, Linear) and m is not self.lm_head_proj]
        dense = {id(p): p for p in self.parameters()}  # a tied LM head counted once
        by_scheme: dict[str, int] = {}
        for lin in linears:
            weight = getattr(lin, "weight", None)
            if weight is not None:
                dense.pop(id(weight), None)
            name = str(weight.dtype).removeprefix("torch.") if self.quant is None else self.quant.method
            by_scheme[name] = by_scheme.get(name, 0) + lin.weight_bytes()
        if isinstance(getattr(self.lm_head_proj, "quant_method", None), Q8_0LinearMethod):  # gguf's Q8_0 head
            by_scheme[self.quant.method] = by_scheme.get(self.quant.method, 0) + self.lm_head_proj.weight_bytes()
        for p in dense.values():
            name = str(p.dtype).removeprefix("torch.")
            by_scheme[name] = by_scheme.get(name, 0) + p.nbytes
        return by_scheme

    @property
    def num_kv_heads(self) -> int:
        """KV heads this model's share of the KV cache holds per layer (its TP rank's)."""
        return self.layers[0].attn.num_kv_heads

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor | None:
        """The final hidden states (see the class docstring), or None on a pipeline stage before the last."""
        if not self.is_first_stage:
            x = self.pp.recv_prev((input_ids.shape[0], self.args.hidden_size), self.cos.dtype, self.cos.device)
        elif self.vocab_embed is not None:
            x = self.vocab_embed(input_ids)
        else:
            x = F.embedding(input_ids, self.embed)
        plan = AttentionPlan(attn_metadata, x.device, x.dtype)  # the step's kernels, picked once
        rope = Rope(self.cos, self.sin, positions, plan.ops.rotary_embedding)
        only_output_rows = attn_metadata.output_rows is not None and self.is_last_stage
        for layer in self.layers[:-1]:
            x = layer(x, rope, kv_cache, plan)
        x = self.layers[-1](x, rope, kv_cache, plan, only_output_rows)
        if not self.is_last_stage:
            self.pp.send_next(x)
            return None
        return self.norm(x, plan.ops.rms_norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits `[rows, vocab]`; None on a TP rank other than 0 (rank 0 gathered them to sample)."""
        logits = self.lm_head_proj(hidden)
        return None if logits is None else logits.float()


def load_model(folder: str | Path, args: LlamaArgs, dtype: torch.dtype, device: torch.device,
               max_positions: int, parallel: ParallelContext | None = None,
               quant: QuantizationConfig | None = None) -> LlamaForCausalLM:
    """Build the model from `folder`'s safetensors; `args` is its parsed config.json; `parallel`: the
    worker's shard (None: the whole model); `quant`: the projections' weight quantization (checked against
    the shapes before any tensor is read)."""
    scheme = WeightScheme.load(folder, quant, args, device)
    ckpt = CheckpointReader(folder, dtype, device)
    return LlamaForCausalLM(args, ckpt, max_positions, parallel, scheme).eval()
