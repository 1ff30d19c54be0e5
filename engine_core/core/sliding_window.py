"""Sliding-window attention's block rule: which leading blocks of a table no future query can see.

A model with `sliding_window = W` (Mistral, Qwen2 with `use_sliding_window`) lets the token at position p
attend to the keys at positions p - W + 1 .. p (W keys, itself included: Hugging Face's mask
`kv_idx > q_idx - W`, flash-attention's `window_size=(W - 1, 0)`). Positions only grow, so once the next
token to compute is p, every key below p - W + 1 is dead for good, and a block all of whose tokens are dead
can be freed (vLLM's `SlidingWindowManager.remove_skipped_blocks`; the table keeps a null entry in its slot).
"""
from __future__ import annotations


# seam: lab 16 (grader/seams.py)
def num_blocks_out_of_window(num_computed_tokens: int, window: int, block_size: int) -> int:
    """How many leading blocks of a request's table lie wholly out of the window of every query from
    `num_computed_tokens` (the next position to compute) on: block i's last token (i + 1) * block_size - 1 is
    below the first visible key num_computed_tokens - window + 1. Never negative."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_computed_tokens < 0:
        raise ValueError(f"num_computed_tokens must be >= 0, got {num_computed_tokens}")
    return max(0, (num_computed_tokens - window + 1) // block_size)
