"""Batch metadata for attention, passed explicitly through the forward (no module-global context).

The model runner builds one `AttentionMetadata` per step from the SchedulerOutput; every
attention layer reads the same one, together with its own layer of the KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels
from engine_core.models.lora import LoRABatch


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
    # Rows whose output is needed (their logits), each the last row of sequence `output_seqs[j]`.
    # When set, the last layer writes K/V for every row but computes attention, MLP and the
    # result only for these rows. None: every row.
    output_rows: torch.Tensor | None = None
    output_seqs: torch.Tensor | None = None
    lora: LoRABatch | None = None  # each row's adapter slot; None: no row of the step uses an adapter

    @property
    def decode_only(self) -> bool:
        return self.num_decode_seqs == len(self.seq_lens)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             k_scale: torch.Tensor, v_scale: torch.Tensor, meta: AttentionMetadata) -> None:
    kernels.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping, kv_cache_dtype=meta.kv_cache_dtype,
                              k_scale=k_scale, v_scale=v_scale, backend=meta.backend)


def attend(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, k_scale: torch.Tensor,
           v_scale: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Every query row over its sequence's cached context (this step's K/V already written).

    Single-row sequences (decodes) go through the batched decode op in one call; the rest
    (prefill chunks) through the varlen op. Both compute the same thing for a one-row query,
    the decode op just does it for the whole group at once."""
    nd = meta.num_decode_seqs
    common = dict(k_scale=k_scale, v_scale=v_scale, backend=meta.backend)
    if nd == len(meta.seq_lens):
        return kernels.paged_attention_decode(query, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale,
                                              **common)
    if nd == 0:
        return kernels.paged_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, scale, **common)
    out = torch.empty_like(query)
    out[:nd] = kernels.paged_attention_decode(query[:nd], key_cache, value_cache, meta.block_tables[:nd],
                                              meta.seq_lens[:nd], scale, **common)
    out[nd:] = kernels.paged_attention(query[nd:], key_cache, value_cache, meta.block_tables[nd:], meta.seq_lens[nd:],
                                       meta.query_start_loc[nd:] - nd, scale, **common)
    return out


def attend_output_rows(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       k_scale: torch.Tensor, v_scale: torch.Tensor, meta: AttentionMetadata,
                       scale: float) -> torch.Tensor:
    """Only `meta.output_rows`: each is its sequence's last row, so one decode-op call covers them."""
    if meta.output_rows.numel() == 0:  # a step of mid-prompt chunks only: nothing to compute
        return query[:0]
    return kernels.paged_attention_decode(query[meta.output_rows], key_cache, value_cache,
                                          meta.block_tables[meta.output_seqs], meta.seq_lens[meta.output_seqs], scale,
                                          k_scale=k_scale, v_scale=v_scale, backend=meta.backend)
