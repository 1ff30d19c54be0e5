"""Tile sizes and the split-K count of the weight-quantized GEMMs (w4a16.py, fp8_gemm.py).

Decode is a GEMV: M is a few rows, so the only parallelism is over N, and `N / BLOCK_N` programs (64 for
N = 8192) leave most of a 132-SM GPU idle and too few loads in flight to stream the weight at the HBM rate.
Split-K gives each of `split` programs per output tile a contiguous range of K tiles; they write fp32
partials `[split, M, N]` that one `sum` adds in a fixed order (deterministic, unlike atomics). Only for
M <= 64: the partials cost 8 * split * M * N bytes of traffic, small next to the weight only while M is.
The sizes are set from that reasoning, not tuned on a GPU (none was available when they were written).
"""
from __future__ import annotations

import triton

TARGET_PROGRAMS_PER_SM = 4
MIN_TILES_PER_SPLIT = 4


def gemm_tiles(m: int, n: int, k: int, block_k: int, num_sms: int, interpret: bool,
               max_block_n: int = 128, max_block_m: int = 128) -> tuple[dict, int, int]:
    """(launch config, split, K tiles per split) for an `[M, K] x [K, N]` product with K tiles of `block_k`,
    output tiles at most `max_block_n` wide (W4A16: 64, its dequantized weight tile lives in registers too) and
    at most `max_block_m` tall (W4A16 on a T4: 16, without tensor-core MMA the operands live in registers).
    The interpreter gets 16 x 32 tiles, one stage, and splits as if the device had one SM (so small test
    shapes run both the split and the plain path)."""
    if interpret:
        cfg, sms, min_tiles = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, num_warps=4, num_stages=1), 1, 2
    else:
        block_m = min(max_block_m, 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128)
        block_n = min(max_block_n, 64 if m <= 64 else 128)
        cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=8 if block_m >= 128 else 4,
                   num_stages=3)
        sms, min_tiles = num_sms, MIN_TILES_PER_SPLIT
    k_tiles = triton.cdiv(k, block_k)
    programs = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    split = 1 if m > 64 else max(1, min(k_tiles // min_tiles, triton.cdiv(TARGET_PROGRAMS_PER_SM * sms, programs)))
    per_split = triton.cdiv(k_tiles, split)
    return cfg, triton.cdiv(k_tiles, per_split), per_split  # no empty split
