"""Token eviction at block granularity: StreamingLLM (attention sinks + a recent window) and H2O (heavy hitters
by accumulated attention + a recent window) choose which of a request's resident KV blocks to drop so that at
most a budget of them stay.

StreamingLLM (Xiao et al. 2023) keeps the first tokens (the "attention sinks", which soak up attention mass
whatever they say) and the most recent ones; H2O (Zhang et al. 2023) keeps the recent ones and the tokens
that have received the most attention so far. Both are per token in the papers; a paged cache frees whole
blocks, so here a block is kept or dropped whole, and its score is the sum of its tokens' scores.
"""
from __future__ import annotations

from typing import Sequence

from engine_core.config import KV_EVICTION_POLICIES as EVICTION_POLICIES


# seam: lab 16 (grader/seams.py)
def evict_tokens(policy: str, num_blocks: int, budget_blocks: int, num_sink_blocks: int, num_recent_blocks: int,
                 block_scores: Sequence[float] | None = None) -> list[int]:
    """Which of a request's `num_blocks` resident blocks (indices 0..num_blocks-1, oldest first) to evict so
    that at most `budget_blocks` stay; ascending. Nothing when they fit already.

    Both policies keep the first `num_sink_blocks` and the last `num_recent_blocks`. "streaming_llm" fills the
    rest of the budget with the most recent blocks too (sinks + one recent window); "h2o" fills it with the
    middle blocks of the highest `block_scores` (accumulated attention; one per block), the more recent one
    winning a tie."""
    if policy not in EVICTION_POLICIES:
        raise ValueError(f"policy must be one of {EVICTION_POLICIES}, got {policy!r}")
    for name, value in (("num_blocks", num_blocks), ("num_sink_blocks", num_sink_blocks)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if num_recent_blocks < 1:
        raise ValueError(f"num_recent_blocks must be >= 1 (the block being written stays), got {num_recent_blocks}")
    if budget_blocks < num_sink_blocks + num_recent_blocks:
        raise ValueError(f"budget_blocks must be >= num_sink_blocks + num_recent_blocks = "
                         f"{num_sink_blocks + num_recent_blocks}, got {budget_blocks}")
    if policy == "h2o" and (block_scores is None or len(block_scores) != num_blocks):
        got = None if block_scores is None else len(block_scores)
        raise ValueError(f"h2o needs one score per resident block: {num_blocks} block_scores, got {got}")
    if num_blocks <= budget_blocks:
        return []
    middle = range(num_sink_blocks, num_blocks - num_recent_blocks)
    num_heavy = budget_blocks - num_sink_blocks - num_recent_blocks
    if policy == "streaming_llm":
        return list(middle[:len(middle) - num_heavy])
    heavy = set(sorted(middle, key=lambda i: (block_scores[i], i), reverse=True)[:num_heavy])
    return [i for i in middle if i not in heavy]
