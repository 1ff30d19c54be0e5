"""The scheduler's side of method "draft_model": lookahead slots, no tokens yet.

The draft model runs in the model runner (engine_core.worker.draft_model), which owns the weights and
the request's sampling parameters, so the scheduler only decides how many drafts a decode gets: k,
capped by what `_schedule_drafts` allows. It reserves their slots as for n-gram drafts; the values here
are placeholders (the request's last token) that the runner replaces with the draft model's tokens
before the target's verifying forward. The scheduler reads only their number (metrics, rollback).
"""
from __future__ import annotations

from typing import Sequence


class DraftSlots:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.k = num_speculative_tokens

    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """min(k, max_tokens) placeholder drafts for the runner's draft model to fill."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        return [token_ids[-1]] * k if k > 0 and token_ids else []
