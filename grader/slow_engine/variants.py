"""The slow variants of lab 14's seams: the same results as the engine's functions, computed slowly.

Each is a mistake real inference code makes; the lab's text does not list them (the profile does).
"""
from __future__ import annotations

import torch

from engine_core.request import Request
from engine_core.worker.sampler import INVALID_TOKEN, apply_top_k_top_p, draw_seed


def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv) -> None:
    """AttentionPlan.write_kv: one Python iteration per token, its slot read back to the host, two small copies."""
    if self.meta.kv_cache_dtype != "auto":
        raise ValueError(f"the slow engine writes kv_cache_dtype 'auto' only, got {self.meta.kv_cache_dtype!r}")
    key_cache = kv.key_cache.view(-1, *key.shape[1:])
    value_cache = kv.value_cache.view(-1, *value.shape[1:])
    slot_mapping = self.meta.slot_mapping
    for i in range(len(slot_mapping)):
        slot = int(slot_mapping[i])  # a host sync per token on a GPU
        key_cache[slot] = key[i]
        value_cache[slot] = value[i]


def attend(self, query: torch.Tensor, kv, scale: float) -> torch.Tensor:
    """AttentionPlan.attend: a defensive copy of the whole layer cache, and one decode-op launch per sequence."""
    nd, ops = self.num_decode_seqs, self.ops
    cache = (kv.key_cache.clone(), kv.value_cache.clone())  # "so the kernel cannot change the cache"
    splits = self.meta.decode_num_splits
    out = torch.empty_like(query)
    tables, lens = self.decode
    for i in range(nd):
        out[i:i + 1] = ops.paged_attention_decode(query[i:i + 1], *cache, tables[i:i + 1], lens[i:i + 1], scale,
                                                  kv.k_scale, kv.v_scale, num_splits=splits)
    if nd < self.num_seqs:
        out[nd:] = ops.paged_attention(query[nd:], *cache, *self.prefill, scale, kv.k_scale, kv.v_scale)
    return out


def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """Sampler.__call__: one request at a time, each row's token read back to the host on its own."""
    tokens = []
    for i, request in enumerate(requests):
        p = request.sampling_params
        row = logits[i:i + 1]
        if p.greedy:
            top, token = row.max(dim=-1)
            valid = bool(top.isfinite().item())
        else:
            x = apply_top_k_top_p(row / p.temperature, [p.top_k], [p.top_p])
            probs = x.softmax(dim=-1)
            noise = torch.empty_like(probs)
            if p.seed is None:
                noise.exponential_(generator=self.generator)
            else:
                self.seeded.manual_seed(draw_seed(p.seed, request.num_output_tokens))
                noise.exponential_(generator=self.seeded)
            score, token = (probs / noise).max(dim=-1)
            valid = bool(row.max().isfinite().item()) and not bool(score.isnan().item())
        tokens.append(int(token.item()) if valid else INVALID_TOKEN)
    return tokens


def block_tables(self, rows: list[int]) -> torch.Tensor:
    """InputBatch.block_tables: the step's tables rebuilt from Python lists, padded by hand."""
    tables = [self.block_table[r, :int(self.num_blocks[r])].tolist() for r in rows]
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).reshape(len(rows), width)


def remove_finished(self, finished: list[Request]) -> None:
    """Scheduler._remove_finished: a scan of the finished list for every running request."""
    done_ids = []
    for request in finished:
        done_ids.append(request.request_id)
    kept = []
    for request in self.running:
        if not any(request.request_id == rid for rid in done_ids):
            kept.append(request)
    self.running = kept
