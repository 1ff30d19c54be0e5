"""Triton varlen paged attention: prefill chunks over a cached prefix, and decode rows, in one batch.

Sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]`: its last q_len_i
positions out of seq_lens[i]. Its K/V (prefix and this chunk alike, already written by
`reshape_and_cache`) are read through its block table, causally.

Work split (as vLLM's unified Triton attention): one program per (query tile, KV head). A
query tile is BLOCK_Q consecutive tokens of one sequence times the GROUP query heads that
share the KV head, packed into BLOCK_M = BLOCK_Q * GROUP rows, so each K/V tile is read once
for the whole group. Sequence i's tiles are numbered from `query_start_loc[i] // BLOCK_Q + i`;
that numbering is increasing, so a program finds its sequence by binary search, and the grid
`num_tokens // BLOCK_Q + num_seqs` is known from shapes alone (no host sync). Programs past
a sequence's last tile exit at once. Keys are streamed in BLOCK_N tiles up to the tile's last
query position with an online softmax in fp32 (base 2, as the decode kernel).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.triton._common import (INTERPRET, check_device, device_capability, dot, fp8_args, load_kv, load_scale,
                                    upcast_dot)

LOG2E = math.log2(math.e)


@triton.jit
def _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The largest i with query_start_loc[i] // BLOCK_Q + i <= tile (binary search)."""
    lo = num_seqs * 0  # int32 tensors from the start: loop-carried values keep one type
    hi = num_seqs + 0
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        lo = tl.where(first_tile <= tile, mid + 1, lo)
        hi = tl.where(first_tile <= tile, hi, mid)
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    scale_log2, k_scale, v_scale, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_ot, stride_oh,
    HEAD_DIM,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IS_FP8: tl.constexpr, FP8_BITS: tl.constexpr,
    K_SCALE_IS_PTR: tl.constexpr, V_SCALE_IS_PTR: tl.constexpr, K_SCALE_STRIDE: tl.constexpr,
    V_SCALE_STRIDE: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    first_token = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # within this sequence's query rows
    if first_token >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    context_len = seq_len - q_len  # tokens before this chunk (the cached prefix)

    # Row r of the tile: query token first_token + r // GROUP, query head kv_head*GROUP + r % GROUP.
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    token = first_token + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_mask = (r < BLOCK_Q * GROUP) & (token < q_len)
    d_mask = d < HEAD_DIM
    q_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    dtype = q.dtype
    q_pos = context_len + token  # each row's absolute position: it sees keys 0..q_pos
    k_sc = load_scale(k_scale, kv_head, K_SCALE_IS_PTR, K_SCALE_STRIDE)  # this KV head's (or the layer's) scale
    v_sc = load_scale(v_scale, kv_head, V_SCALE_IS_PTR, V_SCALE_STRIDE)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys up to the tile's last query position; nothing later can be attended.
    kv_end = context_len + tl.minimum(first_token + BLOCK_Q, q_len)
    block_table = block_tables_ptr + seq * stride_bt
    for kv_start in range(0, kv_end, BLOCK_N):
        t = kv_start + tl.arange(0, BLOCK_N)
        t_mask = t < kv_end
        block = tl.load(block_table + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        slot_row = t % BLOCK_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = load_kv(k_cache_ptr + block[:, None] * stride_kb + slot_row[:, None] * stride_kt
                    + kv_head * stride_kh + d[None, :], kv_mask, k_sc, IS_FP8, FP8_BITS, UPCAST, dtype)
        v = load_kv(v_cache_ptr + block[:, None] * stride_vb + slot_row[:, None] * stride_vt
                    + kv_head * stride_vh + d[None, :], kv_mask, v_sc, IS_FP8, FP8_BITS, UPCAST, dtype)

        s = dot(q, tl.trans(k), UPCAST) * scale_log2  # [BLOCK_M, BLOCK_N]
        causal = (t[None, :] <= q_pos[:, None]) & t_mask[None, :]
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows: 2^-inf = 0, not NaN
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m - m_shift)
        l = l * alpha + tl.sum(p, 1)
        if UPCAST:
            pv = dot(p, v, UPCAST)
        else:
            pv = dot(p.to(dtype), v, UPCAST)
        acc = acc * alpha[:, None] + pv
        m = m_new

    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # every real row saw key 0, so l > 0 there
    tl.store(out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _config(group: int, dtype: torch.dtype, capability: tuple[int, int] | None = (9, 0),
            fp8: bool = False) -> dict:
    """Tile sizes. GPU: 64 query rows x 32-key tiles, 8 warps, 2 stages (fixed and documented, no autotuning
    inside a serving step): at head_dim 128 a 64 x 64 tile with 4 warps sat at 255 registers per thread and
    spilled. Over an fp8 cache (its tiles decoded in registers) and where the operands of the dots sit in
    registers (every dot on a T4, sm_75, where Triton has no tensor-core dot): 32 x 16; fp32's exact dots:
    16 x 16. Each is the largest that compiles without a spill and within the register budget on every
    target (`make gpu-compile`). Interpreter: 16 x 16, small enough to be quick and to make tiles straddle
    sequences' ends and cache blocks in the tests."""
    if INTERPRET:
        return dict(BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=16, num_warps=1, num_stages=1)
    small = fp8 or (capability is not None and capability < (8, 0))
    block_m, block_n = (16, 16) if dtype == torch.float32 else (32, 16) if small else (64, 32)
    return dict(BLOCK_M=max(block_m, triton.next_power_of_2(group)), BLOCK_N=block_n, num_warps=8,
                num_stages=1 if dtype == torch.float32 else 2)


# seam: lab 18 (grader/seams.py)
def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, k_scale: float | torch.Tensor = 1.0,
                    v_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Same contract as `kernels.reference.paged_attention`."""
    check_device(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    num_seqs = seq_lens.shape[0]
    if cache_head_dim != head_dim or value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"query head_dim {head_dim} and caches {tuple(key_cache.shape)} / "
                         f"{tuple(value_cache.shape)} disagree")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks] and query_start_loc [{num_seqs + 1}], "
                         f"got {tuple(block_tables.shape)} and {tuple(query_start_loc.shape)}")
    if query.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("query, key_cache and value_cache need a contiguous last (head_dim) dim")
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    kc, vc, ks, vs, fp8_flags = fp8_args(key_cache, value_cache, k_scale, v_scale)
    cfg = _config(group, query.dtype, device_capability(query), fp8_flags["IS_FP8"])
    block_q = cfg["BLOCK_M"] // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query, kc, vc, block_tables, seq_lens, query_start_loc, out,
        scale * LOG2E, ks, vs, num_seqs,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        head_dim,
        BLOCK_SIZE=block_size, GROUP=group, BLOCK_Q=block_q, BLOCK_M=cfg["BLOCK_M"],
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=cfg["BLOCK_N"],
        UPCAST=upcast_dot(query.dtype), **fp8_flags, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
