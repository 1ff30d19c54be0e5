"""Batch metadata for attention, passed explicitly through the forward (no module-global context).

The model runner builds one `AttentionMetadata` per step from the SchedulerOutput; every
attention layer reads the same one, together with its own layer of the KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels


@dataclass
class AttentionMetadata:
    """One flat varlen batch: sequence i owns token rows query_start_loc[i]:query_start_loc[i+1]."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    num_decode_seqs: int  # the leading sequences with exactly one query row (rows 0..num_decode_seqs-1)
    kv_cache_dtype: str = "auto"
    backend: str = "auto"

    @property
    def decode_only(self) -> bool:
        return self.num_decode_seqs == len(self.seq_lens)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend over each sequence's whole context.

    Single-row sequences (decodes) go through the batched decode op in one call; the rest
    (prefill chunks) through the varlen op. Both compute the same thing for a one-row query,
    the decode op just does it for the whole group at once."""
    kernels.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping, kv_cache_dtype=meta.kv_cache_dtype,
                              k_scale=k_scale, v_scale=v_scale, backend=meta.backend)
    nd = meta.num_decode_seqs
    if nd == len(meta.seq_lens):
        return kernels.paged_attention_decode(query, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale,
                                              k_scale=k_scale, v_scale=v_scale, backend=meta.backend)
    if nd == 0:
        return kernels.paged_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, scale, k_scale=k_scale, v_scale=v_scale,
                                       backend=meta.backend)
    out = torch.empty_like(query)
    out[:nd] = kernels.paged_attention_decode(query[:nd], key_cache, value_cache, meta.block_tables[:nd],
                                              meta.seq_lens[:nd], scale, k_scale=k_scale, v_scale=v_scale,
                                              backend=meta.backend)
    out[nd:] = kernels.paged_attention(query[nd:], key_cache, value_cache, meta.block_tables[nd:], meta.seq_lens[nd:],
                                       meta.query_start_loc[nd:] - nd, scale, k_scale=k_scale, v_scale=v_scale,
                                       backend=meta.backend)
    return out
