"""Prompt lookup (vLLM's n-gram proposer, `vllm/v1/spec_decode/ngram_proposer.py`): draft tokens from
the request's own tokens, no model.

If the last n tokens (n in [prompt_lookup_min, prompt_lookup_max], the longest n that matches) appeared
earlier in prompt + output, the tokens that followed that earlier occurrence are the draft. Among
several earlier occurrences of the longest suffix, the first one wins (vLLM's choice). Cheap enough to
run in the scheduler, on token ids it already has; it pays off on text that repeats its context
(summaries, edits, code), where a model would also copy.
"""
from __future__ import annotations

from typing import Sequence


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, num_speculative_tokens: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.k = num_speculative_tokens

    # seam: lab 10 (grader/seams.py)
    def propose(self, token_ids: Sequence[int], max_tokens: int | None = None) -> list[int]:
        """Up to min(k, max_tokens) draft tokens to follow `token_ids` ([] when no suffix matches).

        Fewer than k when the match sits so close to the end that fewer tokens follow it."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        n_tokens = len(token_ids)
        if k <= 0 or n_tokens < self.min_n + 1:
            return []
        tokens = list(token_ids)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            start = _first_occurrence(tokens, tokens[n_tokens - n:], n_tokens - n)
            if start is not None:
                return tokens[start + n:start + n + k]
        return []


def _first_occurrence(tokens: list[int], pattern: list[int], end: int) -> int | None:
    """The first i < end with tokens[i:i+len(pattern)] == pattern (the suffix itself starts at `end`)."""
    n, first = len(pattern), pattern[0]
    i = 0
    while i < end:
        try:
            i = tokens.index(first, i, end)
        except ValueError:
            return None
        if tokens[i:i + n] == pattern:
            return i
        i += 1
    return None
