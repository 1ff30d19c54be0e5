"""Method "draft_model": a smaller checkpoint with the target's vocabulary drafts k tokens per step.

Design (vLLM's draft proposer): the draft runs through the engine's own model code (`LlamaForCausalLM`)
on its own paged KV cache, with as many blocks as the target's and the target's block tables: position
i of a request lives in the same block id and slot in both caches, so the scheduler's allocation
(lookahead slots included) serves the draft too, and one varlen forward serves every speculating
request of the step. Per request the drafter remembers the tokens its cache holds; each step it keeps
the longest prefix still equal to the request's tokens (the rejected drafts fall off, as the target's
rollback drops them; their slots are written again), runs the tokens after it for all requests in one
forward (the accepted drafts and the target's token, or the whole context the first time), then
k - 1 batched one-token steps. A request the runner forgets (finished, aborted, preempted: its blocks
may change) drops its record and is recomputed from its tokens when it returns; nothing is swapped.
The draft's cache blocks never leave the request's table, so a block shared through the prefix cache
is at most rewritten with the same tokens by the draft of another request that recomputes it.

Greedy requests draft the draft's argmax chain (verified by `greedy_verify`). Sampled requests draft
from q, the draft's distribution after the request's temperature, top-k and top-p (as the target's p),
and hand q to `rejection_sample`, so the emitted tokens keep the target's distribution exactly. The
draft's noise for a seeded request is seeded by (seed, output position) with its own salt, independent
of the target's draws.
"""
from __future__ import annotations

import torch

from engine_core.models.attention import AttentionMetadata
from engine_core.models.config import ModelConfig
from engine_core.models.llama import load_model
from engine_core.request import Request
from engine_core.worker.kv_cache import KVCache
from engine_core.worker.sampler import Sampler, apply_top_k_top_p, draw_seed

DRAFT_SALT = 0x5DEECE66D  # separates the draft's seeded draws from the target's


class DraftModel:
    def __init__(self, draft: ModelConfig, num_speculative_tokens: int, dtype: torch.dtype, device: torch.device,
                 max_model_len: int, block_size: int, backend: str) -> None:
        self.k = num_speculative_tokens
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.backend = backend
        self.model = load_model(draft.path, draft.args, dtype, device, max_positions=max_model_len)
        self.args = draft.args
        self.kv_cache: KVCache | None = None  # allocate(), with the target's number of blocks
        self.cached: dict[str, list[int]] = {}  # request id -> the tokens (positions 0..n-1) its cache holds

    def block_bytes(self) -> int:
        """Bytes of one block of the draft's cache (every layer's K and V)."""
        a = self.args
        return 2 * len(self.model.layers) * self.block_size * self.model.num_kv_heads * a.head_dim * \
            torch.empty(0, dtype=self.dtype).element_size()

    def allocate(self, num_blocks: int) -> None:
        self.kv_cache = KVCache(len(self.model.layers), num_blocks, self.block_size, self.model.num_kv_heads,
                                self.args.head_dim, self.dtype, self.device)
        self.cached.clear()

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.cached.pop(rid, None)

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int], block_tables: torch.Tensor, sampler: Sampler
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """For each request (its block table the row of `block_tables` `[B, width]`, lookahead slots
        included), num_drafts[i] >= 1 draft tokens to follow its tokens, and for a sampled request q
        `[num_drafts[i], V]` (fp32, the distribution each draft was drawn from; None for greedy)."""
        contexts = [r.all_token_ids for r in requests]
        starts = [self._kept(r.request_id, c) for r, c in zip(requests, contexts)]
        self.forget([r.request_id for r in requests])  # until this step's record is whole (a step may raise)
        # the catch-up forward: each request's tokens from its kept prefix (one-row sequences first)
        order = sorted(range(len(requests)), key=lambda i: len(contexts[i]) - starts[i] != 1)
        tokens = [contexts[i][starts[i]:] for i in order]
        logits = self._forward(tokens, [starts[i] for i in order], block_tables[order])
        logits = logits[torch.tensor(sorted(range(len(order)), key=order.__getitem__), device=logits.device)]
        drafts: list[list[int]] = [[] for _ in requests]
        rows: list[list[torch.Tensor]] = [[] for _ in requests]
        active = list(range(len(requests)))
        for j in range(max(num_drafts)):
            for i, token, q in zip(active, *self._sample(logits, [requests[i] for i in active], j, sampler)):
                drafts[i].append(token)
                if q is not None:
                    rows[i].append(q)
            active = [i for i in active if len(drafts[i]) < num_drafts[i]]
            if not active:
                break
            positions = [len(contexts[i]) + j for i in active]
            logits = self._forward([[drafts[i][-1]] for i in active], positions, block_tables[active])
        for r, c, d in zip(requests, contexts, drafts):
            self.cached[r.request_id] = c + d[:-1]  # the last draft was sampled, never run
        return drafts, [torch.stack(q) if q else None for q in rows]

    def _kept(self, request_id: str, context: list[int]) -> int:
        """How many leading tokens of the request's record still equal its tokens (at most all but the last:
        the last token always runs, its logits draft d_1)."""
        keep = 0
        for a, b in zip(self.cached.get(request_id, ()), context[:-1]):
            if a != b:
                break
            keep += 1
        return keep

    def _forward(self, tokens: list[list[int]], starts: list[int], block_tables: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the last row of each sequence: sequence i is `tokens[i]` at positions starts[i]..,
        its K/V written through `block_tables[i]` (one-row sequences must come first)."""
        nums = torch.tensor([len(t) for t in tokens], dtype=torch.int64)
        start = torch.tensor(starts, dtype=torch.int64)
        qsl = torch.zeros(len(tokens) + 1, dtype=torch.int64)
        torch.cumsum(nums, 0, out=qsl[1:])
        seq = torch.repeat_interleave(torch.arange(len(tokens)), nums)
        positions = torch.arange(int(qsl[-1])) - qsl[seq] + start[seq]
        tables = block_tables.long()
        slots = tables[seq, positions // self.block_size] * self.block_size + positions % self.block_size
        last = qsl[1:] - 1
        every_row = len(tokens) == int(qsl[-1])
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev), block_tables=block_tables.to(device=dev, dtype=torch.int32),
            seq_lens=(start + nums).to(device=dev, dtype=torch.int32),
            query_start_loc=qsl.to(device=dev, dtype=torch.int32), num_decode_seqs=int((nums == 1).sum()),
            backend=self.backend, output_rows=None if every_row else last.to(dev),
            output_seqs=None if every_row else torch.arange(len(tokens), device=dev))
        ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64, device=dev)
        return self.model.compute_logits(self.model(ids, positions.to(dev), self.kv_cache, meta))

    def _sample(self, logits: torch.Tensor, requests: list[Request], j: int, sampler: Sampler
                ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Draft j of each request from its logits row: the argmax (greedy), or a draw from q (sampled)."""
        tokens = logits.argmax(dim=-1)
        probs: list[torch.Tensor | None] = [None] * len(requests)
        sampled = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if sampled:
            params = [requests[i].sampling_params for i in sampled]
            temps = torch.tensor([p.temperature for p in params], device=logits.device)
            x = apply_top_k_top_p(logits[sampled] / temps[:, None], [p.top_k for p in params],
                                  [p.top_p for p in params])
            q = x.softmax(dim=-1)
            noise = torch.stack([self._noise(requests[i], j, q.shape[1], sampler) for i in sampled]).to(q.device)
            tokens[sampled] = (q / noise).argmax(dim=-1)
            for r, i in enumerate(sampled):
                probs[i] = q[r]
        return tokens.tolist(), probs

    @staticmethod
    def _noise(request: Request, j: int, vocab: int, sampler: Sampler) -> torch.Tensor:
        """Exp(1) noise for the draft of output position num_output_tokens + j."""
        seed = request.sampling_params.seed
        if seed is None:
            return torch.empty(vocab).exponential_(generator=sampler.generator)
        sampler.seeded.manual_seed(draw_seed(seed ^ DRAFT_SALT, request.num_output_tokens + j))
        return torch.empty(vocab).exponential_(generator=sampler.seeded)
