"""The semantics of every kernel, in plain PyTorch. The CPU engine runs these; every Triton
kernel is tested against them.

KV cache per layer: `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V;
token slot = block_id * block_size + offset; slot -1 means "skip this row".
fp8 caches (`torch.float8_e4m3fn`) store value / scale; reads multiply the scale back.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0


def quantize_fp8(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """x / scale, saturated to e4m3's range (no inf/nan in the cache)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


def _is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                      k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0) -> None:
    """Write key/value `[num_tokens, num_kv_heads, head_dim]` into the paged caches at `slot_mapping`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k, v = key[keep], value[keep]
    if kv_cache_dtype == "fp8_e4m3" or _is_fp8(key_cache):
        k, v = quantize_fp8(k, k_scale), quantize_fp8(v, v_scale)
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim)[slots] = k.to(key_cache.dtype)
    value_cache.view(-1, num_kv_heads, head_dim)[slots] = v.to(value_cache.dtype)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int, scale: float | torch.Tensor,
            dtype: torch.dtype) -> torch.Tensor:
    """The first `length` tokens of one sequence's K or V: `[length, num_kv_heads, head_dim]`."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    x = cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]
    return dequantize_fp8(x, scale, dtype) if _is_fp8(cache) else x.to(dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_start: int) -> torch.Tensor:
    """Causal attention of q `[q_len, H, D]` at positions q_start.. over k, v `[kv_len, H_kv, D]`."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, kv_len, D]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1).float(), k.float().transpose(1, 2)) * scale  # [H, q_len, kv_len]
    q_pos = torch.arange(q.shape[0], device=q.device) + q_start
    k_pos = torch.arange(k.shape[1], device=q.device)
    scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1), v.float())  # [H, q_len, D]
    return out.transpose(0, 1).to(q.dtype)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, k_scale: float | torch.Tensor = 1.0,
                    v_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Varlen causal attention over paged KV. Sequence i owns query rows
    `query_start_loc[i]:query_start_loc[i+1]`, which are its last q_len_i positions
    of `seq_lens[i]` tokens (prefill chunks over a cached prefix and decode rows alike)."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        k = _gather(key_cache, block_tables[i], seq_len, k_scale, query.dtype)
        v = _gather(value_cache, block_tables[i], seq_len, v_scale, query.dtype)
        out[a:b] = _attend(query[a:b], k, v, scale, q_start=seq_len - (b - a))
    return out


def paged_attention_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
                           num_splits: int = 1) -> torch.Tensor:
    """One query row per sequence (its newest token) over its whole context. `num_splits` only
    changes how a kernel divides the work; the result is the same. Vectorised: one gather of
    every sequence's context padded to the longest, one masked softmax."""
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_len = int(seq_lens.max()) if num_seqs else 0
    pos = torch.arange(max_len, device=query.device)
    blocks = block_tables[:, pos // block_size].long()  # [S, max_len]
    slots = blocks * block_size + pos % block_size
    k = key_cache.view(-1, num_kv_heads, head_dim)[slots]  # [S, max_len, H_kv, D]
    v = value_cache.view(-1, num_kv_heads, head_dim)[slots]
    k = dequantize_fp8(k, k_scale, torch.float32) if _is_fp8(key_cache) else k.float()
    v = dequantize_fp8(v, v_scale, torch.float32) if _is_fp8(value_cache) else v.float()
    group = num_heads // num_kv_heads
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("skgd,sjkd->skgj", q, k) * scale  # [S, H_kv, group, max_len]
    valid = pos[None, :] < seq_lens[:, None]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    out = torch.einsum("skgj,sjkd->skgd", scores.softmax(dim=-1), v)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)
