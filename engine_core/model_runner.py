"""SchedulerOutput -> one flat varlen batch -> forward -> logits of the emitting rows -> tokens.

Per step: run the scheduled KV block copies (swap_out first, then swap_in), build the batch
tensors (input_ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc) with
vectorised index arithmetic (the only per-sequence Python is gathering each chunk's token ids and
padding its block table), run the model, and compute logits only for the rows whose chunk
reaches the end of its request. Decode-only batches on CUDA replay CUDA graphs (cuda_graphs.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine_core.kv_cache import KVCache
from engine_core.models.attention import AttentionMetadata
from engine_core.models.llama import LlamaForCausalLM
from engine_core.request import Request
from engine_core.sampler import Sampler
from engine_core.scheduler_output import ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:
    from engine_core.cuda_graphs import DecodeGraphs


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn_metadata: AttentionMetadata  # .output_rows: the rows whose hidden state gives a new token
    emitting: list[Request]  # the requests of those rows, in row order


def chunk_token_ids(request: Request, start: int, num_tokens: int) -> list[int]:
    """request.all_token_ids[start:start+num_tokens] without concatenating prompt and output."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    p = len(prompt)
    end = start + num_tokens
    if start >= p:
        return output[start - p:end - p]
    if end <= p:
        return prompt[start:end]
    return prompt[start:] + output[:end - p]


def build_model_input(chunks: list[ScheduledChunk], block_size: int, device: torch.device,
                      kv_cache_dtype: str = "auto", backend: str = "auto") -> ModelInput:
    """The flat batch for `chunks`: sequence i owns rows query_start_loc[i]:query_start_loc[i+1].
    Single-token chunks go first, so attention can run all of them through the decode op at once."""
    chunks = sorted(chunks, key=lambda c: c.num_tokens != 1)  # stable: keeps the scheduler's order otherwise
    starts = torch.tensor([c.start for c in chunks], dtype=torch.int64)
    nums = torch.tensor([c.num_tokens for c in chunks], dtype=torch.int64)
    token_ids: list[int] = []
    for c in chunks:
        token_ids += chunk_token_ids(c.request, c.start, c.num_tokens)
    width = max(len(c.block_ids) for c in chunks)
    block_tables = torch.tensor([c.block_ids + [0] * (width - len(c.block_ids)) for c in chunks], dtype=torch.int32)
    query_start_loc = torch.zeros(len(chunks) + 1, dtype=torch.int64)
    torch.cumsum(nums, 0, out=query_start_loc[1:])
    total = int(query_start_loc[-1])
    seq_idx = torch.repeat_interleave(torch.arange(len(chunks)), nums)
    positions = torch.arange(total) - query_start_loc[seq_idx] + starts[seq_idx]
    slot_mapping = block_tables[seq_idx, positions // block_size].long() * block_size + positions % block_size
    emits = torch.tensor([c.emits for c in chunks], dtype=torch.bool)
    emit_seqs = emits.nonzero().flatten()
    logits_indices = (query_start_loc[1:] - 1)[emit_seqs]
    every_row_emits = len(emit_seqs) == total
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device), block_tables=block_tables.to(device),
        seq_lens=(starts + nums).to(device=device, dtype=torch.int32),
        query_start_loc=query_start_loc.to(device=device, dtype=torch.int32),
        num_decode_seqs=int((nums == 1).sum()), kv_cache_dtype=kv_cache_dtype, backend=backend,
        output_rows=None if every_row_emits else logits_indices.to(device),
        output_seqs=None if every_row_emits else emit_seqs.to(device))
    return ModelInput(torch.tensor(token_ids, dtype=torch.int64, device=device), positions.to(device), meta,
                      [c.request for c in chunks if c.emits])


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, sampler: Sampler, device: torch.device,
                 attention_backend: str = "auto", cuda_graphs: "DecodeGraphs | None" = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self.backend = attention_backend
        self.cuda_graphs = cuda_graphs

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> dict[str, int]:
        """Run one step; returns request_id -> sampled token for every request that emits."""
        self.kv_cache.swap_out(scheduler_output.swap_out)
        self.kv_cache.swap_in(scheduler_output.swap_in)
        if not scheduler_output.scheduled:
            return {}
        batch = build_model_input(scheduler_output.scheduled, self.kv_cache.block_size, self.device,
                                  self.kv_cache.kv_cache_dtype, self.backend)
        hidden = self._forward(batch)
        if not batch.emitting:  # only mid-prompt chunks this step
            return {}
        logits = self.model.compute_logits(hidden)  # the forward returned only the emitting rows
        tokens = self.sampler(logits, batch.emitting)
        return {r.request_id: t for r, t in zip(batch.emitting, tokens)}

    def _forward(self, batch: ModelInput) -> torch.Tensor:
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(batch):
            return self.cuda_graphs.run(batch)
        return self.model(batch.input_ids, batch.positions, self.kv_cache, batch.attn_metadata)
