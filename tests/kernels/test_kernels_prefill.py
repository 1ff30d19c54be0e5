"""Triton varlen paged attention (prefill chunks over a cached prefix, mixed with decode rows)
against a float64 oracle."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_attention_close, max_abs_value, oracle_attention

import kernels
from grader.harness import make_paged_kv

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
HEAD_DIM, NUM_KV_HEADS = 32, 2


def _mixed_batch(gen: torch.Generator, block_size: int) -> tuple[list[int], list[int]]:
    """(seq_lens, q_lens): a chunk over a cached prefix ending mid-block, a whole prompt, a
    decode row, a sequence with no rows this step, and a chunk longer than one query tile."""
    def r(a: int, b: int) -> int:
        return int(torch.randint(a, b + 1, (1,), generator=gen))
    prefix = r(1, 2 * block_size)
    seq_lens = [prefix + block_size + 3, r(2, 20), r(1, 40), r(1, 30), r(25, 45)]
    q_lens = [block_size + 3, seq_lens[1], 1, 0, r(17, seq_lens[4])]
    return seq_lens, q_lens


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_matches_oracle(seed: int, device: torch.device, poison_allocations: None, dtype: torch.dtype,
                                group: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    seq_lens, q_lens = _mixed_batch(gen, block_size)
    kv = make_paged_kv(gen, seq_lens, NUM_KV_HEADS, HEAD_DIM, block_size, dtype, device)
    query = torch.randn(sum(q_lens), NUM_KV_HEADS * group, HEAD_DIM, generator=gen).to(device, dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    scale = HEAD_DIM**-0.5
    out = kernels.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl, scale,
                                  backend="triton")
    assert out.shape == query.shape and out.dtype == dtype
    assert_attention_close(out, oracle_attention(query, kv, q_lens, scale), dtype, seed,
                           f"prefill {dtype} group={group} block_size={block_size} seq_lens={seq_lens} "
                           f"q_lens={q_lens}", max_abs_value(kv))


def test_prefill_reads_fp8_cache_with_scales(seed: int, device: torch.device, poison_allocations: None) -> None:
    gen = torch.Generator().manual_seed(seed)
    seq_lens, q_lens = _mixed_batch(gen, 16)
    kv = make_paged_kv(gen, seq_lens, NUM_KV_HEADS, HEAD_DIM, 16, torch.float32, device, fp8=True)
    query = torch.randn(sum(q_lens), 4, HEAD_DIM, generator=gen).to(device)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    out = kernels.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl, 0.2,
                                  kv.k_scale, torch.tensor(kv.v_scale, device=device), backend="triton")
    assert_attention_close(out, oracle_attention(query, kv, q_lens, 0.2), torch.float32, seed,
                           f"prefill fp8 seq_lens={seq_lens} q_lens={q_lens}", max_abs_value(kv))


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_prefill_reads_fp8_formats_with_per_head_scales(seed: int, device: torch.device, poison_allocations: None,
                                                        fp8_dtype: torch.dtype) -> None:
    """KV heads 4x apart in magnitude, each with its own scale ([num_kv_heads] tensors)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens, q_lens = _mixed_batch(gen, 16)
    kv = make_paged_kv(gen, seq_lens, NUM_KV_HEADS, HEAD_DIM, 16, torch.float32, device, fp8=True,
                       fp8_dtype=fp8_dtype, per_head_scales=True)
    query = torch.randn(sum(q_lens), 4, HEAD_DIM, generator=gen).to(device) * 0.25
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    out = kernels.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl, 0.2,
                                  kv.k_scale, kv.v_scale, backend="triton")
    assert_attention_close(out, oracle_attention(query, kv, q_lens, 0.2), torch.float32, seed,
                           f"prefill {fp8_dtype} per-head scales seq_lens={seq_lens} q_lens={q_lens}",
                           max_abs_value(kv))

