"""kernels.cpu.paged_attention (the C varlen prefill kernel) against the float64 oracle.

Random paged batches from the one builder (shuffled blocks, poisoned unowned rows, a padded table column):
chunks over a cached prefix and whole prompts, one-row chunks (decode rows through the varlen op), a
sequence with no rows this step, lengths that end mid-block and mid-tile (a tile is 8 query rows), every
GQA group the engine's presets use and the block sizes the kernels are tested at.
"""
from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_attention_close, awkward_lengths, max_abs_value, oracle_attention

from grader.harness import PagedKV, make_paged_kv
from kernels import cpu

CPU = torch.device("cpu")
# bf16 on AVX512-BF16 rounds P to bf16 before P @ V (csrc/paged_attention_avx512bf16.h), as GPU kernels do
ROUNDS_P = "avx512_bf16" in open("/proc/cpuinfo").read()


@pytest.fixture(autouse=True)
def c_kernels() -> None:
    assert cpu.load() is not None, f"the C kernels did not build: {cpu.load_error()}"


def _batch(gen: torch.Generator, dtype: torch.dtype, block_size: int, group: int, num_kv_heads: int = 2,
           head_dim: int = 64, max_len: int = 70) -> tuple[torch.Tensor, PagedKV, list[int], torch.Tensor]:
    lens = awkward_lengths(gen, 6, max(block_size, 2), max_len=max_len)
    q_lens = [int(torch.randint(1, n + 1, (1,), generator=gen)) for n in lens]
    q_lens[1], q_lens[2], q_lens[3] = lens[1], 1, 0  # a whole prompt, a decode row, no rows this step
    kv = make_paged_kv(gen, lens, num_kv_heads, head_dim, block_size, dtype, CPU)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return query, kv, q_lens, torch.tensor([0] + q_lens).cumsum(0)


def _run(query: torch.Tensor, kv: PagedKV, starts: torch.Tensor, scale: float) -> torch.Tensor:
    return cpu.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, starts, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill_matches_oracle(seed: int, dtype: torch.dtype, block_size: int, group: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    query, kv, q_lens, starts = _batch(gen, dtype, block_size, group)
    out = _run(query, kv, starts, 0.125)
    assert out.shape == query.shape and out.dtype == dtype
    assert_attention_close(out, oracle_attention(query, kv, q_lens, 0.125), dtype, seed,
                           f"cpu prefill {dtype} group={group} block_size={block_size} seq_lens={kv.seq_lens.tolist()} "
                           f"q_lens={q_lens}", max_abs_value(kv), rounds_p=ROUNDS_P)


@pytest.mark.parametrize("head_dim", [32, 128, 24])  # 24: the unspecialised loop
def test_prefill_head_dims(seed: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    query, kv, q_lens, starts = _batch(gen, torch.float32, 16, 2, head_dim=head_dim)
    assert_attention_close(_run(query, kv, starts, head_dim ** -0.5),
                           oracle_attention(query, kv, q_lens, head_dim ** -0.5), torch.float32, seed,
                           f"cpu prefill head_dim={head_dim}", max_abs_value(kv))


def test_prefill_reads_a_strided_query(seed: int) -> None:
    """The query is a view into the fused QKV output: rows further apart than heads * head_dim."""
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(gen, [9, 40], 2, 16, 8, torch.float32, CPU)
    qkv = torch.randn(9 + 17, 8, 16, generator=gen)
    query = qkv[:, :4]
    out = _run(query, kv, torch.tensor([0, 9, 26]), 0.25)
    assert_attention_close(out, oracle_attention(query, kv, [9, 17], 0.25), torch.float32, seed, "strided query",
                           max_abs_value(kv))


def test_the_result_does_not_depend_on_the_thread_count(seed: int) -> None:
    """Each tile is computed alone: the threaded loop (a long prompt) gives the bits of one thread."""
    gen = torch.Generator().manual_seed(seed)
    kv = make_paged_kv(gen, [300, 45], 2, 64, 16, torch.bfloat16, CPU)
    query = torch.randn(300 + 20, 4, 64, generator=gen).bfloat16()
    starts = torch.tensor([0, 300, 320])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(query, kv, starts, 0.125)
        torch.set_num_threads(max(2, threads))
        many = _run(query, kv, starts, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    assert_attention_close(many, oracle_attention(query, kv, [300, 20], 0.125), torch.bfloat16, seed,
                           "threaded prefill", max_abs_value(kv), rounds_p=ROUNDS_P)


def test_prefill_refuses_bad_tables_and_row_counts() -> None:
    kv = make_paged_kv(torch.Generator().manual_seed(0), [20], 2, 16, 8, torch.float32, CPU)
    query, starts = torch.randn(4, 2, 16), torch.tensor([0, 4])
    tables = kv.block_tables.clone()
    tables[0, 1] = kv.key_cache.shape[0]
    with pytest.raises(IndexError, match="outside the cache"):
        cpu.paged_attention(query, kv.key_cache, kv.value_cache, tables, kv.seq_lens, starts, 1.0)
    with pytest.raises(IndexError, match="more blocks than its block table row"):
        past_the_row = torch.full_like(kv.seq_lens, kv.block_tables.shape[1] * 8 + 1)
        cpu.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, past_the_row, starts, 1.0)
    with pytest.raises(IndexError, match="outnumber its tokens"):
        cpu.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, torch.tensor([3]), starts, 1.0)
    two = make_paged_kv(torch.Generator().manual_seed(1), [20, 20], 2, 16, 8, torch.float32, CPU)
    with pytest.raises(IndexError, match="query rows .query_start_loc. fall"):  # the second sequence's -2 rows
        cpu.paged_attention(query, two.key_cache, two.value_cache, two.block_tables, two.seq_lens,
                            torch.tensor([0, 6, 4]), 1.0)
    with pytest.raises(ValueError, match="query_start_loc must rise from 0"):
        cpu.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, torch.tensor([0, 3]),
                            1.0)
    with pytest.raises(ValueError, match=r"query_start_loc \[2\]"):
        cpu.paged_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, torch.tensor([0]), 1.0)
