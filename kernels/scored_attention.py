"""Paged attention that also reports how much attention each cached block received: what H2O (heavy-hitter
eviction) ranks blocks by. Plain PyTorch, like `kernels.reference.paged_attention`, whose output it computes;
the softmax is explicit because SDPA does not return its probabilities.
"""
from __future__ import annotations

import torch

from kernels.reference import gather_blocks


def paged_attention_scored(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                           scale: float, k_scale: float | torch.Tensor = 1.0,
                           v_scale: float | torch.Tensor = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(`paged_attention`'s output, block_scores `[num_seqs, max_blocks]` fp32): the attention probability each
    block of sequence i's table received, summed over its tokens, the query heads and the sequence's query rows
    (each row gives 1 per head in all). Causal, fp32, one sequence at a time."""
    out = torch.empty_like(query)
    block_size = key_cache.shape[1]
    scores = torch.zeros(block_tables.shape, dtype=torch.float32, device=query.device)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        a, b = starts[i], starts[i + 1]
        if a == b:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        table = block_tables[i:i + 1, :num_blocks]
        k = gather_blocks(key_cache, table, k_scale)[0, :seq_len]  # [seq_len, H_kv, D]
        v = gather_blocks(value_cache, table, v_scale)[0, :seq_len]
        q = query[a:b].float()  # [q_len, H, D]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        logits = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - (b - a), seq_len, device=query.device)[:, None]
        logits = logits.masked_fill(torch.arange(seq_len, device=query.device)[None, :] > q_pos, float("-inf"))
        probs = logits.softmax(-1)  # [H, q_len, seq_len]
        out[a:b] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
        per_key = probs.sum((0, 1))
        per_key = torch.nn.functional.pad(per_key, (0, num_blocks * block_size - seq_len))
        scores[i, :num_blocks] = per_key.view(num_blocks, block_size).sum(1)
    return out, scores
