"""Random paged-KV batches, a float64 attention oracle, and the error bounds the kernels must meet.

The oracle is independent of both backends: it reads each sequence's K/V through its block
table one token at a time and does plain softmax attention in float64.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@dataclass
class PagedKV:
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]; entries past a sequence's blocks are -1
    seq_lens: torch.Tensor  # int32 [num_seqs]
    k_scale: float | torch.Tensor = 1.0  # a float, or one per KV head ([num_kv_heads], on the cache's device)
    v_scale: float | torch.Tensor = 1.0


def awkward_lengths(gen: torch.Generator, count: int, block_size: int, max_len: int) -> list[int]:
    """Random lengths in [1, max_len], including 1 and one that ends mid-block."""
    lens = torch.randint(1, max_len + 1, (count,), generator=gen).tolist()
    lens[0] = 1
    lens[-1] = block_size * (max_len // block_size - 1) + 1 + int(torch.randint(0, block_size - 1, (1,), generator=gen))
    return lens


def make_paged_kv(gen: torch.Generator, seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                  dtype: torch.dtype, device: torch.device, fp8: bool = False, fp8_dtype: torch.dtype = FP8,
                  per_head_scales: bool = False) -> PagedKV:
    """Caches with a few spare blocks, physical blocks handed out in a shuffled order (a wrong
    block-table lookup reads another sequence's K/V), unused cache rows filled with huge values
    (reading one wrecks the output), and -1 past each sequence's last block. fp8: codes of
    `fp8_dtype` written with torch's own cast; `per_head_scales`: KV head h's values are 4^h times
    larger and its scales too, so a kernel that reads the wrong head's scale is off by 4x or more."""
    blocks_per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen, dtype=torch.float64)
    v = torch.randn(shape, generator=gen, dtype=torch.float64)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    used = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    taken = 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        tables[i, :nb] = perm[taken:taken + nb].to(torch.int32)
        taken += nb
        slots = tables[i, :nb].long()[:, None] * block_size + torch.arange(block_size)
        used[slots.flatten()[:n]] = True
    k.view(-1, num_kv_heads, head_dim)[~used] = 1e4
    v.view(-1, num_kv_heads, head_dim)[~used] = 1e4
    k_scale = v_scale = 1.0
    if fp8:
        k_scale, v_scale = 0.05, 0.03  # e4m3 codes up to 448: randn / scale stays well inside
        if per_head_scales:
            head_gain = 4.0 ** torch.arange(num_kv_heads, dtype=torch.float64)[:, None]  # [H_kv, 1]
            k, v = k * head_gain, v * head_gain
            k_scale, v_scale = k_scale * head_gain[:, 0].float(), v_scale * head_gain[:, 0].float()
        limit = torch.finfo(fp8_dtype).max
        k_cache = (k / _bcast(k_scale)).clamp(-limit, limit).to(fp8_dtype)
        v_cache = (v / _bcast(v_scale)).clamp(-limit, limit).to(fp8_dtype)
        if per_head_scales:
            k_scale, v_scale = k_scale.to(device), v_scale.to(device)
    else:
        k_cache, v_cache = k.to(dtype), v.to(dtype)
    return PagedKV(k_cache.to(device), v_cache.to(device), tables.to(device),
                   torch.tensor(seq_lens, dtype=torch.int32, device=device), k_scale, v_scale)


def _bcast(scale: float | torch.Tensor) -> float | torch.Tensor:
    """A per-head scale `[H_kv]` as `[H_kv, 1]` (float64), to broadcast over `[..., H_kv, D]`."""
    return scale.double().cpu()[:, None] if isinstance(scale, torch.Tensor) else scale


def gather64(cache: torch.Tensor, table: torch.Tensor, length: int, scale: float) -> torch.Tensor:
    """The first `length` tokens of one sequence, token by token through its block table: [length, H_kv, D]."""
    block_size = cache.shape[1]
    rows = [cache[int(table[t // block_size]), t % block_size] for t in range(length)]
    return torch.stack(rows).cpu().to(torch.float64) * _bcast(scale)


def max_abs_value(kv: PagedKV) -> float:
    """max |V| over every sequence's real tokens: the scale of the output's absolute error."""
    return max(float(gather64(kv.value_cache, kv.block_tables[i], n, kv.v_scale).abs().max())
               for i, n in enumerate(kv.seq_lens.tolist()))


def oracle_attention(query: torch.Tensor, kv: PagedKV, q_lens: list[int], scale: float) -> torch.Tensor:
    """Causal paged attention in float64; sequence i's rows are its last q_lens[i] positions."""
    out = torch.empty(query.shape, dtype=torch.float64)
    q64 = query.cpu().to(torch.float64)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(q_lens, kv.seq_lens.tolist())):
        if q_len == 0:
            continue
        k = gather64(kv.key_cache, kv.block_tables[i], seq_len, kv.k_scale)
        v = gather64(kv.value_cache, kv.block_tables[i], seq_len, kv.v_scale)
        group = query.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        q = q64[start:start + q_len]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        pos = torch.arange(seq_len - q_len, seq_len)
        scores.masked_fill_(torch.arange(seq_len)[None, :] > pos[:, None], float("-inf"))
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += q_len
    return out


def assert_attention_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, seed: int,
                           what: str, max_abs_v: float, fp8_score_abs: float = 0.0) -> None:
    """|actual - expected| <= atol + rtol * |expected|, where

    * rtol = the output dtype's unit roundoff: the final store rounds to nearest;
    * atol = max|V| * (1e-5 + ...): the fp32 arithmetic inside (exp2 of logits up to ~10 in
      magnitude, online rescaling, sums of <= 64 weights) is good to ~1e-6 relative; 1e-5 leaves
      a 10x margin. On a GPU the fp16/bf16 path also rounds the probabilities to the input dtype
      before the P @ V tensor-core dot (2 * unit roundoff), and with an fp8 cache the dequantized
      K as well, which moves each logit by up to u * sum|q||k| (`fp8_score_abs`, times 2 for the
      softmax's numerator and denominator).
    """
    assert not torch.isnan(actual).any(), (
        f"{what}: {int(torch.isnan(actual).sum())} outputs never written (still NaN-poisoned), first at "
        f"index {tuple(torch.nonzero(torch.isnan(actual))[0].tolist())}; seed {seed}")
    u = UNIT_ROUNDOFF[dtype]
    tensor_core_path = actual.is_cuda and dtype != torch.float32
    atol = max_abs_v * 1e-5
    if tensor_core_path:
        atol += max_abs_v * (2 * u + (torch.tensor(2 * u * fp8_score_abs).exp().item() - 1))
    err = (actual.cpu().double() - expected).abs()
    allowed = atol + u * expected.abs()
    if (err > allowed).any():
        idx = tuple(torch.nonzero(err > allowed)[0].tolist())
        raise AssertionError(
            f"{what}: at [row, head, dim] {idx} got {actual[idx].item():.7g}, expected {expected[idx].item():.7g} "
            f"(|err| {err[idx].item():.3g} > bound {allowed[idx].item():.3g}); max |err| {err.max().item():.3g}; "
            f"{int((err > allowed).sum())} entries out of bound; seed {seed}")
