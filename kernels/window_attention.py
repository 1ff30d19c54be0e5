"""Sliding-window attention over the paged KV cache, in plain PyTorch: the `torch` backend's path for models that
declare `sliding_window` (the C and Triton kernels have no window, and the engine refuses them for such a model).

The query at position p attends to the keys at p - window + 1 .. p (Hugging Face's `kv_idx > q_idx - window`).
Only the blocks from the first one any query row of a sequence can see are gathered: the table entries before it
may name blocks the engine freed (`engine_core.core.sliding_window`), and are never read.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference import gather_blocks


def paged_attention_window(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           scale: float, window: int, k_scale: float | torch.Tensor = 1.0,
                           v_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """`kernels.reference.paged_attention` with each query row limited to its last `window` keys (itself
    included); decode rows are sequences with one query row. Computed in fp32, one sequence at a time."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out = torch.empty_like(query)
    block_size = key_cache.shape[1]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        q_len = b - a
        first_block = max(0, seq_len - q_len - window + 1) // block_size  # the first block any row sees
        base = first_block * block_size  # the position of the first gathered key
        table = block_tables[i:i + 1, first_block:(seq_len + block_size - 1) // block_size]
        k = gather_blocks(key_cache, table, k_scale)[:, :seq_len - base].transpose(1, 2)  # [1, H_kv, n, D]
        v = gather_blocks(value_cache, table, v_scale)[:, :seq_len - base].transpose(1, 2)
        q = query[a:b].float().transpose(0, 1)[None]  # [1, H, q_len, D]
        key_pos = torch.arange(base, seq_len, device=query.device)[None, :]
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[a:b] = o[0].transpose(0, 1).to(query.dtype)
    return out
