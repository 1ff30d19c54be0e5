"""CUDA graphs for decode-only batches: one captured forward per padded batch size.

A decode step on a small model is dominated by kernel-launch overhead; replaying a captured
graph launches the whole forward at once. Inputs live in static buffers; a batch of n rows runs
the graph of the smallest captured size >= n, padding rows write nowhere (slot -1) and read
block 0, and their outputs are dropped. A graph is captured on first use of its size. If capture
fails (an attention backend that synchronises with the host cannot be captured) graphs are
switched off with a warning and the runner stays eager: slower, never wrong. Batches with LoRA
adapters run eagerly (their slot mapping is not in the static buffers).
"""
from __future__ import annotations

import warnings

import torch

from engine_core.models.attention import AttentionMetadata
from engine_core.models.llama import LlamaForCausalLM
from engine_core.worker.kv_cache import KVCache


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to max_num_seqs (always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device, backend: str) -> None:
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.sizes = graph_batch_sizes(max_num_seqs)
        n, w = max_num_seqs, max_blocks_per_seq
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, w, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.enabled = True

    def can_run(self, m: AttentionMetadata) -> bool:
        return (self.enabled and m.output_rows is None and m.lora is None and m.decode_only
                and len(m.seq_lens) <= self.sizes[-1]
                and m.block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, m: AttentionMetadata) -> torch.Tensor:
        n = len(m.seq_lens)
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(m.slot_mapping)
        self.slot_mapping[n:size] = -1
        self.block_tables[:size] = 0
        self.block_tables[:n, :m.block_tables.shape[1]].copy_(m.block_tables)
        self.seq_lens[:n].copy_(m.seq_lens)
        self.seq_lens[n:size] = 1
        if size not in self.graphs and not self._capture(size, m):
            return self.model(input_ids, positions, self.kv_cache, m)
        self.graphs[size].replay()
        return self.outputs[size][:n]

    def _capture(self, size: int, like: AttentionMetadata) -> bool:
        meta = AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size], self.seq_lens[:size],
                                 self.query_start_loc[:size + 1], size, like.kv_cache_dtype, self.backend)
        args = (self.input_ids[:size], self.positions[:size], self.kv_cache, meta)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the graph (rewrites the same K/V)
                self.model(*args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self.model(*args)
        except RuntimeError as e:
            warnings.warn(f"CUDA graph capture failed ({e}); running decode eagerly")
            self.enabled = False
            return False
        self.pool = graph.pool()
        self.graphs[size] = graph
        return True
