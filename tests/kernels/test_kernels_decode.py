"""Triton paged decode attention (and its flash-decoding split) against a float64 oracle."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_attention_close, awkward_lengths, gather64, max_abs_value, oracle_attention

import kernels
from grader.harness import PagedKV, make_paged_kv
from kernels import reference

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
HEAD_DIM, NUM_KV_HEADS = 32, 2


def _fp8_score_abs(query: torch.Tensor, kv: PagedKV, scale: float) -> float:
    """max over (sequence, head, real key) of scale * sum_d |q_d| |k_d|: how far rounding K can move a logit."""
    q = query.cpu().double().abs()
    group = q.shape[1] // kv.key_cache.shape[2]
    return max(float(torch.einsum("hd,khd->hk", q[i], gather64(kv.key_cache, kv.block_tables[i], n, kv.k_scale)
                                  .abs().repeat_interleave(group, 1)).max()) * scale
               for i, n in enumerate(kv.seq_lens.tolist()))


def _run(seed: int, device: torch.device, dtype: torch.dtype, group: int, block_size: int, num_splits: int,
         fp8: bool = False, tensor_scales: bool = False, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
         per_head_scales: bool = False) -> None:
    gen = torch.Generator().manual_seed(seed)
    lens = awkward_lengths(gen, 4, block_size, max_len=45)
    kv = make_paged_kv(gen, lens, NUM_KV_HEADS, HEAD_DIM, block_size, dtype, device, fp8=fp8, fp8_dtype=fp8_dtype,
                       per_head_scales=per_head_scales)
    # per-head scales: head 1's K is 4x head 0's, so smaller queries keep the logits in the usual range
    query = torch.randn(len(lens), NUM_KV_HEADS * group, HEAD_DIM, generator=gen).to(device, dtype) * (
        0.25 if per_head_scales else 1.0)
    scale = HEAD_DIM**-0.5
    k_scale, v_scale = kv.k_scale, kv.v_scale
    if tensor_scales and not per_head_scales:
        k_scale, v_scale = torch.tensor(k_scale, device=device), torch.tensor(v_scale, device=device)
    out = kernels.paged_attention_decode(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, scale,
                                         k_scale, v_scale, num_splits=num_splits, backend="triton")
    assert out.shape == query.shape and out.dtype == dtype
    expected = oracle_attention(query, kv, [1] * len(lens), scale)
    assert_attention_close(out, expected, dtype, seed,
                           f"decode {dtype} group={group} block_size={block_size} num_splits={num_splits} "
                           f"fp8={fp8 and fp8_dtype} per_head={per_head_scales} seq_lens={lens}", max_abs_value(kv),
                           _fp8_score_abs(query, kv, scale) if fp8 else 0.0)


@pytest.mark.parametrize("num_splits", [1, 2, 4])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_oracle(seed: int, device: torch.device, poison_allocations: None, dtype: torch.dtype,
                               group: int, block_size: int, num_splits: int) -> None:
    _run(seed, device, dtype, group, block_size, num_splits)


@pytest.mark.parametrize("tensor_scales", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_decode_reads_fp8_cache_with_scales(seed: int, device: torch.device, poison_allocations: None,
                                            dtype: torch.dtype, tensor_scales: bool) -> None:
    _run(seed, device, dtype, group=2, block_size=16, num_splits=2, fp8=True, tensor_scales=tensor_scales)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_decode_reads_fp8_formats_with_per_head_scales(seed: int, device: torch.device, poison_allocations: None,
                                                       fp8_dtype: torch.dtype, num_splits: int) -> None:
    """e4m3 and e5m2 caches, one scale per KV head ([num_kv_heads] tensors), KV heads 4x apart."""
    _run(seed, device, torch.float32, group=2, block_size=8, num_splits=num_splits, fp8=True, fp8_dtype=fp8_dtype,
         per_head_scales=True)


def test_many_splits_on_short_sequences_leave_empty_splits_harmless(seed: int, device: torch.device,
                                                                    poison_allocations: None) -> None:
    """8 splits of a 1..20-token context: most splits own no tokens and must weigh nothing."""
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(gen, [1, 7, 20], NUM_KV_HEADS, HEAD_DIM, 8, torch.float32, device)
    query = torch.randn(3, 4, HEAD_DIM, generator=gen).to(device)
    out = kernels.paged_attention_decode(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.2,
                                         num_splits=8, backend="triton")
    assert_attention_close(out, oracle_attention(query, kv, [1, 1, 1], 0.2), torch.float32, seed,
                           "decode num_splits=8", max_abs_value(kv))


def test_oracle_agrees_with_the_reference_op(seed: int) -> None:
    """The float64 oracle and kernels.reference (the contract) say the same thing, so matching
    the oracle is matching the contract."""
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(gen, awkward_lengths(gen, 3, 8, 30), NUM_KV_HEADS, HEAD_DIM, 8, torch.float32,
                       torch.device("cpu"))
    query = torch.randn(3, 8, HEAD_DIM, generator=gen)
    ref = reference.paged_attention_decode(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.3)
    assert_attention_close(ref, oracle_attention(query, kv, [1, 1, 1], 0.3), torch.float32, seed, "reference",
                           max_abs_value(kv))


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_bad_num_splits_is_a_value_error(device: torch.device, bad: object) -> None:
    gen = torch.Generator().manual_seed(0)
    kv = make_paged_kv(gen, [3], 1, 16, 8, torch.float32, device)
    with pytest.raises(ValueError, match="num_splits"):
        kernels.paged_attention_decode(torch.zeros(1, 1, 16, device=device), kv.key_cache, kv.value_cache,
                                       kv.block_tables, kv.seq_lens, 1.0, num_splits=bad, backend="triton")


@pytest.mark.parametrize("num_splits", [1, 4])
def test_empty_rows_give_zeros_not_nan(device: torch.device, poison_allocations: None, num_splits: int) -> None:
    """A seq_len-0 row (how a padded CUDA-graph batch looks) writes zeros, whatever the split count,
    and does not disturb its neighbours."""
    gen = torch.Generator().manual_seed(0)
    kv = make_paged_kv(gen, [5, 1], 1, 16, 8, torch.float32, device)
    seq_lens = torch.tensor([5, 0], dtype=torch.int32, device=device)
    query = torch.randn(2, 2, 16, generator=gen).to(device)
    out = kernels.paged_attention_decode(query, kv.key_cache, kv.value_cache, kv.block_tables, seq_lens, 0.25,
                                         num_splits=num_splits, backend="triton")
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    kv.seq_lens = seq_lens[:1]
    assert_attention_close(out[:1], oracle_attention(query[:1], kv, [1], 0.25), torch.float32, 0, "row 0",
                           max_abs_value(kv))
