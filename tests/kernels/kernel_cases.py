"""Awkward lengths, a float64 attention oracle, and the error bounds the kernels must meet (the paged
batches themselves come from the one builder, `grader.harness.make_paged_kv`).

The oracle is independent of both backends: it reads each sequence's K/V through its block
table one token at a time and does plain softmax attention in float64.
"""
from __future__ import annotations

import torch

from grader.harness import PagedKV

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def awkward_lengths(gen: torch.Generator, count: int, block_size: int, max_len: int) -> list[int]:
    """Random lengths in [1, max_len], including 1 and one that ends mid-block."""
    lens = torch.randint(1, max_len + 1, (count,), generator=gen).tolist()
    lens[0] = 1
    lens[-1] = block_size * (max_len // block_size - 1) + 1 + int(torch.randint(0, block_size - 1, (1,), generator=gen))
    return lens


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
                           what: str, max_abs_v: float, fp8_score_abs: float = 0.0, rounds_p: bool = False) -> None:
    """|actual - expected| <= atol + rtol * |expected|, where

    * rtol = the output dtype's unit roundoff: the final store rounds to nearest;
    * atol = max|V| * (1e-5 + ...): the fp32 arithmetic inside (exp2 of logits up to ~10 in
      magnitude, online rescaling, sums of <= 64 weights) is good to ~1e-6 relative; 1e-5 leaves
      a 10x margin. On a GPU the fp16/bf16 path also rounds the probabilities to the input dtype
      before the P @ V tensor-core dot (2 * unit roundoff), and with an fp8 cache the dequantized
      K as well, which moves each logit by up to u * sum|q||k| (`fp8_score_abs`, times 2 for the
      softmax's numerator and denominator). `rounds_p`: a CPU kernel that rounds P the same way (the bf16
      prefill tile on AVX512-BF16, kernels/cpu/csrc/paged_attention_avx512bf16.h).
    """
    assert not torch.isnan(actual).any(), (
        f"{what}: {int(torch.isnan(actual).sum())} outputs never written (still NaN-poisoned), first at "
        f"index {tuple(torch.nonzero(torch.isnan(actual))[0].tolist())}; seed {seed}")
    u = UNIT_ROUNDOFF[dtype]
    tensor_core_path = (actual.is_cuda or rounds_p) and dtype != torch.float32
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
