"""Method "draft_model": a smaller checkpoint with the target's vocabulary drafts k tokens per step.

Design: the draft keeps, per request, its own Hugging Face KV cache (a DynamicCache) and the tokens it
covers, apart from the target's paged cache. Each step it crops that cache to the longest prefix still
equal to the request's tokens (the rejected drafts fall off, as the target's rollback drops them), runs
the tokens after it (the accepted drafts and the target's token, or the whole prompt the first time),
then k - 1 one-token steps. No blocks to keep in step with the target's: a request the runner forgets
(finished, aborted, preempted) drops its draft cache, and is recomputed from its tokens when it returns.

Greedy requests draft the draft's argmax chain (verified by `greedy_verify`). Sampled requests draft
from q, the draft's distribution after the request's temperature, top-k and top-p (as the target's p),
and hand q to `rejection_sample`, so the emitted tokens keep the target's distribution exactly. The
draft's noise for a seeded request is seeded by (seed, output position) with its own salt, independent
of the target's draws.
"""
from __future__ import annotations

import torch

from engine_core.models.config import ModelConfig
from engine_core.request import Request
from engine_core.worker.sampler import Sampler, apply_top_k_top_p, draw_seed

DRAFT_SALT = 0x5DEECE66D  # separates the draft's seeded draws from the target's


def check_draft_model(model: str, vocab_size: int, max_model_len: int) -> ModelConfig:
    """The draft checkpoint's config, checked against the target: the same vocab_size (drafts are target
    token ids, q and p the same support) and a context of at least max_model_len."""
    try:
        draft = ModelConfig.load(model)
    except ValueError as error:
        raise ValueError(f"speculative_config['model']: {error}") from None
    if draft.args.vocab_size != vocab_size:
        raise ValueError(f"speculative_config['model']={model!r} has vocab_size {draft.args.vocab_size}; a draft "
                         f"model needs the target's vocabulary, vocab_size {vocab_size}")
    if draft.args.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config['model']={model!r} has max_position_embeddings "
                         f"{draft.args.max_position_embeddings}, shorter than max_model_len {max_model_len}: the "
                         f"draft must cover the target's context (pass a smaller max_model_len)")
    return draft


class DraftModel:
    def __init__(self, draft: ModelConfig, num_speculative_tokens: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        self.k = num_speculative_tokens
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(draft.path, dtype=dtype).to(device).eval()
        self.caches: dict[str, tuple[list[int], object]] = {}  # request id -> (tokens its cache holds, cache)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.caches.pop(rid, None)

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_drafts: list[int], sampler: Sampler
                ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """For each request, num_drafts[i] draft tokens to follow its tokens, and for a sampled request
        q `[num_drafts[i], V]` (fp32, the distribution each draft was drawn from; None for greedy)."""
        drafts, probs = [], []
        for request, n in zip(requests, num_drafts):
            d, q = self._propose_one(request, n, sampler) if n else ([], None)
            drafts.append(d)
            probs.append(q)
        return drafts, probs

    def _propose_one(self, request: Request, n: int, sampler: Sampler) -> tuple[list[int], torch.Tensor | None]:
        sp = request.sampling_params
        context = request.all_token_ids
        cached, cache = self.caches.get(request.request_id, ([], None))
        keep = 0
        for a, b in zip(cached, context[:-1]):  # at least the last token runs: its logits draft d_1
            if a != b:
                break
            keep += 1
        if keep < len(cached):
            cache.crop(keep - len(cached))  # transformers 5 crops by a negative count of tokens to drop
        out = self.model(input_ids=torch.tensor([context[keep:]], device=self.device), cache=cache, use_cache=True)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for j in range(n):
            logits = out.logits[0, -1].float()
            if sp.greedy:
                token = int(logits.argmax())
            else:
                x = apply_top_k_top_p((logits / sp.temperature)[None], [sp.top_k], [sp.top_p])
                q = x.softmax(dim=-1)[0]
                token = int((q / self._noise(request, j, q.shape[0], sampler).to(q.device)).argmax())
                rows.append(q)
            tokens.append(token)
            if j + 1 < n:
                out = self.model(input_ids=torch.tensor([[token]], device=self.device),
                                 cache=out.cache, use_cache=True)
        self.caches[request.request_id] = (context + tokens[:-1], out.cache)
        return tokens, (torch.stack(rows) if rows else None)

    @staticmethod
    def _noise(request: Request, j: int, vocab: int, sampler: Sampler) -> torch.Tensor:
        """Exp(1) noise for the draft of output position num_output_tokens + j."""
        seed = request.sampling_params.seed
        if seed is None:
            return torch.empty(vocab).exponential_(generator=sampler.generator)
        sampler.seeded.manual_seed(draw_seed(seed ^ DRAFT_SALT, request.num_output_tokens + j))
        return torch.empty(vocab).exponential_(generator=sampler.seeded)
