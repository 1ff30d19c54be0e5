"""How many pieces flash-decoding cuts each context into: the engine's policy per decode step.

Decode launches one program per (sequence, KV head, split). At batch 1 with 8 KV heads that is 8
programs on a GPU with 132 SMs: most of the memory bandwidth sits idle, and splitting the context
multiplies the programs. Each split costs a fixed amount (loading q, writing a partial output and
its log-sum-exp, the merge), so a split should cover several K/V tiles.

The counts are powers of two up to 64 (`SPLIT_COUNTS`): a small set, so the engine can capture one
CUDA graph per (batch size, split count) it meets. On CPU (`num_sms=0`) the answer is always 1.
"""
from __future__ import annotations

SPLIT_COUNTS = (1, 2, 4, 8, 16, 32, 64)
MIN_TILES_PER_SPLIT = 4


# seam: lab 07 (grader/seams.py)
def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int, block_n: int = 64) -> int:
    """The smallest power of two that gives about two programs per SM, but no split shorter than
    MIN_TILES_PER_SPLIT tiles of `block_n` tokens (its fixed cost would dominate), at most 64."""
    programs = max(1, num_seqs * num_kv_heads)
    splits = 1
    while (programs * splits < 2 * num_sms and max_seq_len // (2 * splits) >= MIN_TILES_PER_SPLIT * block_n
           and splits < SPLIT_COUNTS[-1]):
        splits *= 2
    return splits
