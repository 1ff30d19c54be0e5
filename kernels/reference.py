"""The semantics of every kernel, in plain PyTorch. The CPU engine runs these; every Triton
kernel is tested against them.

KV cache per layer: `[num_blocks, block_size, num_kv_heads, head_dim]` for K and for V;
token slot = block_id * block_size + offset; slot -1 means "skip this row".
fp8 caches (`float8_e4m3fn` or `float8_e5m2`) and int8 caches store value / scale, saturated (int8 rounded to
nearest); reads multiply the scale back (`kernels.fp8`, `kernels.int8_kv`). A scale is a float, a 0-dim tensor or
one value per KV head `[H_kv]`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8 import cache_format, dequantize_fp8, is_fp8, quantize_fp8
from kernels.int8_kv import dequantize_int8, quantize_int8

DECODE_GROUP = 8  # sequences per padded group in paged_attention_decode


# seam: lab 08 (grader/seams.py)
def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                      k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0) -> None:
    """Write key/value `[num_tokens, num_kv_heads, head_dim]` into the paged caches at `slot_mapping`."""
    fmt = cache_format(kv_cache_dtype, key_cache)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k, v = key[keep], value[keep]
    if fmt == torch.int8:
        k, v = quantize_int8(k, k_scale), quantize_int8(v, v_scale)
    elif fmt is not None:
        k, v = quantize_fp8(k, k_scale, fmt), quantize_fp8(v, v_scale, fmt)
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim)[slots] = k.to(key_cache.dtype)
    value_cache.view(-1, num_kv_heads, head_dim)[slots] = v.to(value_cache.dtype)


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """Whole blocks of K or V for each row of `block_tables` `[S, W]`, in fp32: `[S, W * block_size, H_kv, D]`.
    Copying whole blocks (contiguous runs of block_size * H_kv * D values) is far cheaper than a gather per token,
    and index_select's row copy is about twice as fast on CPU as advanced indexing of the same rows."""
    num_seqs, width = block_tables.shape
    ids = block_tables.reshape(-1).long().clamp(min=0)  # padding past a sequence's blocks (-1 or junk) is masked later
    x = cache.index_select(0, ids).view(num_seqs, width * cache.shape[1], *cache.shape[2:])
    if cache.dtype == torch.int8:
        return dequantize_int8(x, scale, torch.float32)
    return dequantize_fp8(x, scale, torch.float32) if is_fp8(cache.dtype) else x.float()


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0, *,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Varlen causal attention over paged KV. Sequence i owns query rows
    `query_start_loc[i]:query_start_loc[i+1]`, which are its last q_len_i positions
    of `seq_lens[i]` tokens (prefill chunks over a cached prefix and decode rows alike).
    Computed in fp32, one sequence at a time.

    `sliding_window` (vLLM's name; None: full attention): the query at position p attends to the keys at
    p - sliding_window + 1 .. p only (Hugging Face's `kv_idx > q_idx - window`). The torch backend's path for a
    model that declares one (the C and Triton kernels have no window; the engine refuses them for such a model).
    Only the blocks from the first one any query row of a sequence can see are gathered, block
    max(0, seq_len - q_len - sliding_window + 1) // block_size: the engine freed the ones before it (the same
    rule at the chunk's first position, `engine_core.core.sliding_window`) and their table slots are never read."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    out = torch.empty_like(query)
    block_size = key_cache.shape[1]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        q_len = b - a
        first_block = 0 if sliding_window is None else max(0, seq_len - q_len - sliding_window + 1) // block_size
        base = first_block * block_size  # the position of the first gathered key
        table = block_tables[i:i + 1, first_block:(seq_len + block_size - 1) // block_size]
        k = gather_blocks(key_cache, table, k_scale)[:, :seq_len - base].transpose(1, 2)  # [1, H_kv, n, D]
        v = gather_blocks(value_cache, table, v_scale)[:, :seq_len - base].transpose(1, 2)
        q = query[a:b].float().transpose(0, 1)[None]  # [1, H, q_len, D]
        mask = None  # a whole prompt without a window: SDPA's own causal mask
        if q_len != seq_len or sliding_window is not None:
            # causal, aligned bottom-right: query row r sits at position seq_len - q_len + r
            key_pos = torch.arange(base, seq_len, device=query.device)[None, :]
            query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
            mask = key_pos <= query_pos
            if sliding_window is not None:
                mask &= key_pos > query_pos - sliding_window
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=True)
        out[a:b] = o[0].transpose(0, 1).to(query.dtype)
    return out


def paged_attention_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0,
                           num_splits: int = 1) -> torch.Tensor:
    """One query row per sequence (its newest token) over its whole context. `num_splits` only
    changes how a kernel divides the work; the result is the same.

    Vectorised in groups: sequences sorted by length, DECODE_GROUP at a time, each group's blocks
    gathered padded only to the group's longest, one masked attention per group in fp32. Padding
    every sequence to the batch's longest would waste about half the work when lengths vary."""
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_seqs = query.shape[0]
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    block_size = key_cache.shape[1]
    order = torch.argsort(seq_lens)
    sorted_lens = seq_lens[order].tolist()
    for a in range(0, num_seqs, DECODE_GROUP):
        idx = order[a:a + DECODE_GROUP]
        width = (sorted_lens[min(a + DECODE_GROUP, num_seqs) - 1] + block_size - 1) // block_size
        tables = block_tables[idx, :width]
        k = gather_blocks(key_cache, tables, k_scale).transpose(1, 2)  # [G, H_kv, width * block_size, D]
        v = gather_blocks(value_cache, tables, v_scale).transpose(1, 2)
        valid = torch.arange(width * block_size, device=query.device)[None, :] < seq_lens[idx, None]
        o = F.scaled_dot_product_attention(query[idx].float()[:, :, None], k, v, attn_mask=valid[:, None, None, :],
                                           scale=scale, enable_gqa=True)  # [G, H, 1, D]
        out[idx] = o[:, :, 0].to(query.dtype)
    return out
