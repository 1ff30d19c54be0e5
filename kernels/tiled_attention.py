"""FlashAttention's algorithm in plain PyTorch: causal attention of one sequence in tiles, with the online softmax.

The Triton prefill kernel (`kernels.triton.prefill_attention`) runs this loop nest on a GPU, one program per
query tile; here it is written out one tile at a time so that its arithmetic can be read and tested on a CPU
(lab 18 builds both). For each query tile the keys are visited tile by tile up to the tile's last query
position (the causal early exit, `causal_kv_tiles`), keeping per row the running max `m`, the running sum `l`
of `exp(s - m)` and the unnormalised output; a tile that raises the max rescales both by `exp(m_old - m_new)`.
No `N x N` tensor is ever created: the largest is one tile of scores per head.
"""
from __future__ import annotations

import torch


# seam: lab 18 (grader/seams.py)
def causal_kv_tiles(first_row: int, q_len: int, context_len: int, block_m: int, block_n: int) -> int:
    """How many `block_n`-key tiles the causal program of query rows `first_row .. first_row + block_m - 1` visits,
    for a chunk of `q_len` rows after `context_len` cached tokens: the tiles up to the one holding the last real
    row's position (0 when the program has no real row)."""
    if first_row >= q_len:
        return 0
    last_position = context_len + min(first_row + block_m, q_len) - 1
    return last_position // block_n + 1


# seam: lab 18 (grader/seams.py)
def tiled_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                    block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """Causal attention of one sequence's last q_len positions over its seq_len keys, in block_m x block_n tiles
    with the online softmax: query [q_len, H, D], key/value [seq_len, H_kv, D] -> [q_len, H, D] in the query's
    dtype, computed in fp32 (float64 for float64 inputs). Query head h reads KV head h // (H / H_kv)."""
    q_len, num_heads, head_dim = query.shape
    seq_len, num_kv_heads, _ = key.shape
    if q_len > seq_len or num_heads % num_kv_heads or block_m < 1 or block_n < 1:
        raise ValueError(f"need q_len <= seq_len, H a multiple of H_kv and blocks >= 1, got query "
                         f"{tuple(query.shape)}, key {tuple(key.shape)}, block_m {block_m}, block_n {block_n}")
    group = num_heads // num_kv_heads
    acc_dtype = torch.promote_types(query.dtype, torch.float32)
    context_len = seq_len - q_len
    device = query.device
    q_all = query.to(acc_dtype).transpose(0, 1)  # [H, q_len, D]
    k_all = key.to(acc_dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, seq_len, D]: head h -> h // group
    v_all = value.to(acc_dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    out = torch.empty(num_heads, q_len, head_dim, dtype=acc_dtype, device=device)
    for first in range(0, q_len, block_m):
        q = q_all[:, first:first + block_m]
        rows = q.shape[1]
        q_pos = context_len + first + torch.arange(rows, device=device)  # absolute positions of the rows
        m = torch.full((num_heads, rows), float("-inf"), dtype=acc_dtype, device=device)
        l = torch.zeros(num_heads, rows, dtype=acc_dtype, device=device)
        acc = torch.zeros(num_heads, rows, head_dim, dtype=acc_dtype, device=device)
        kv_end = causal_kv_tiles(first, q_len, context_len, block_m, block_n) * block_n
        for start in range(0, min(kv_end, seq_len), block_n):
            stop = min(start + block_n, seq_len)
            s = q @ k_all[:, start:stop].transpose(1, 2) * scale  # [H, rows, cols]
            t = torch.arange(start, stop, device=device)
            s = s.masked_fill(t[None, None, :] > q_pos[None, :, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))  # finite: key 0 is in every row's first tile
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m - m_new)  # rescale what was summed under the old max
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ v_all[:, start:stop]
            m = m_new
        out[:, first:first + rows] = acc / l[..., None]
    return out.transpose(0, 1).to(query.dtype)
