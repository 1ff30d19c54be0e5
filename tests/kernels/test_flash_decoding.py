"""Flash-decoding's semantics (kernels/flash_decoding.py): cutting a context into splits and
merging the partials by their log-sum-exp gives unsplit attention, for 1..16 splits, with empty
splits, with fp8 caches; and the merge's rules, stated as small cases."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import reference
from kernels.flash_decoding import merge_partials, paged_attention_decode_split, split_ranges


def _batch(seq_lens: list[int], block_size: int, fp8: bool = False, seed: int = 0):
    """A decode batch over a scattered paged cache (fp32, or e4m3 codes with per-KV-head scales)."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = 2, 16
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    kc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    vc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    scales = (1.0, 1.0)
    if fp8:
        scales = (torch.tensor([0.01, 0.05]), torch.tensor([0.02, 0.004]))
        kc = (kc / scales[0][:, None]).to(torch.float8_e4m3fn)
        vc = (vc / scales[1][:, None]).to(torch.float8_e4m3fn)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(blocks + [1]), dtype=torch.int32)
    taken = 0
    for i, nb in enumerate(blocks):
        tables[i, :nb] = perm[taken:taken + nb]
        taken += nb
    query = torch.randn(len(seq_lens), 4, head_dim, generator=gen)
    return query, kc, vc, tables, torch.tensor(seq_lens, dtype=torch.int32), *scales


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("block_size", [4, 16])
def test_split_equals_unsplit_for_1_to_16_splits(block_size: int, fp8: bool):
    """Lengths 1..61 with 4-token tiles: at 16 splits most splits of the short rows are empty."""
    seq_lens = [1, 2, 5, 16, 17, 33, 61]
    q, kc, vc, tables, lens, ks, vs = _batch(seq_lens, block_size, fp8)
    unsplit = reference.paged_attention_decode(q, kc, vc, tables, lens, 0.25, ks, vs)
    for num_splits in range(1, 17):
        split = paged_attention_decode_split(q, kc, vc, tables, lens, 0.25, ks, vs, num_splits=num_splits, tile=4)
        # Both sides compute in fp32 over <= 61 tokens of |v| <= ~4: a few fp32 ulps of the output.
        torch.testing.assert_close(split, unsplit, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"num_splits={num_splits} seq_lens={seq_lens}: {m}")


def test_split_ranges_cover_the_context_in_whole_tiles():
    assert split_ranges(10, 3, 4) == [(0, 4), (4, 8), (8, 10)]
    assert split_ranges(10, 5, 4) == [(0, 4), (4, 8), (8, 10), (10, 10), (10, 10)]  # 3 tiles, 5 splits: 2 empty
    assert split_ranges(0, 2, 4) == [(0, 0), (0, 0)]
    for n in range(0, 40):
        for s in range(1, 9):
            r = split_ranges(n, s, 4)
            assert r[0][0] == 0 and r[-1][1] == n and all(a[1] == b[0] for a, b in zip(r, r[1:]))
            assert all(a % 4 == 0 for a, _ in r if a < n)


def test_merge_weighs_each_split_by_its_softmax_mass():
    """Two splits, logits [0] and [log 3]: the second holds 3/4 of the softmax mass."""
    outputs = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # [1, S=2, D=2]
    lse = torch.tensor([[0.0, math.log(3.0)]])
    torch.testing.assert_close(merge_partials(outputs, lse), torch.tensor([[0.25, 0.75]]))


def test_an_empty_split_weighs_nothing_and_all_empty_gives_zeros():
    outputs = torch.tensor([[[2.0, 4.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]])
    lse = torch.tensor([[1.5, float("-inf")], [float("-inf"), float("-inf")]])
    got = merge_partials(outputs, lse)
    assert got.tolist() == [[2.0, 4.0], [0.0, 0.0]] and not got.isnan().any()


def test_merge_does_not_overflow_on_large_logits():
    outputs = torch.tensor([[[1.0], [3.0]]])
    assert merge_partials(outputs, torch.tensor([[1000.0, 1000.0]])).tolist() == [[2.0]]


@settings(max_examples=60, deadline=None)
@given(logits=st.lists(st.floats(-30, 30), min_size=1, max_size=24), cuts=st.lists(st.integers(0, 24), max_size=6))
def test_merging_any_partition_is_softmax_over_the_whole(logits: list[float], cuts: list[int]):
    """Property: cut one row of logits anywhere (empty pieces allowed), attend each piece, merge."""
    x = torch.tensor(logits, dtype=torch.float64)
    v = torch.arange(len(logits), dtype=torch.float64)[:, None] + 1.0  # [n, 1]
    bounds = sorted({0, len(logits), *[min(c, len(logits)) for c in cuts]})
    pieces = [(bounds[0], bounds[0])] + list(zip(bounds, bounds[1:]))  # includes an empty piece
    outputs, lse = [], []
    for a, b in pieces:
        if a == b:
            outputs.append(torch.zeros(1, dtype=torch.float64))
            lse.append(torch.tensor(float("-inf"), dtype=torch.float64))
        else:
            outputs.append(x[a:b].softmax(0) @ v[a:b])
            lse.append(torch.logsumexp(x[a:b], 0))
    got = merge_partials(torch.stack(outputs)[None], torch.stack(lse)[None])
    torch.testing.assert_close(got[0], x.softmax(0) @ v)
