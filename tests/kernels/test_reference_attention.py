"""kernels/reference.py against a naive float64 loop over tokens (the definition, written plainly):
varlen causal paged attention over prefill chunks with a cached prefix and decode rows, GQA,
scattered block tables, fp8 caches with scales; with a sliding window, against dense float64 attention with the
window mask written out (the table slots before the window may hold freed blocks, so they are filled with NaN here
to show they are never read)."""
from __future__ import annotations

import math

import pytest
import torch

from kernels.reference import DECODE_GROUP, paged_attention, paged_attention_decode, reshape_and_cache

FP8_DTYPE = torch.float8_e4m3fn


def naive(query, keys, values, q_lens, scale):
    """keys/values: per sequence `[seq_len, H_kv, D]` float64; query rows in sequence order."""
    out, row = [], 0
    for k, v, q_len in zip(keys, values, q_lens):
        group = query.shape[1] // k.shape[1]
        for r in range(q_len):
            pos = k.shape[0] - q_len + r
            for h in range(query.shape[1]):
                s = (k[:pos + 1, h // group] @ query[row, h].double()) * scale
                out.append((s.softmax(0)[:, None] * v[:pos + 1, h // group]).sum(0))
            row += 1
    return torch.stack(out).view(query.shape[0], query.shape[1], -1)


def build(seq_lens, q_lens, block_size, heads=4, kv_heads=2, dim=8, fp8=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(n / block_size) for n in seq_lens) + 3
    dtype = FP8_DTYPE if fp8 else torch.float32
    kc = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=dtype)
    vc = torch.zeros_like(kc)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks
    width = max(math.ceil(n / block_size) for n in seq_lens)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    keys, values = [], []
    k_scale, v_scale = (0.05, 0.02) if fp8 else (1.0, 1.0)
    for i, n in enumerate(seq_lens):
        nb = math.ceil(n / block_size)
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
        k, v = torch.randn(n, kv_heads, dim, generator=g), torch.randn(n, kv_heads, dim, generator=g)
        slots = (tables[i, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size)
        reshape_and_cache(k, v, kc, vc, slots, "fp8_e4m3" if fp8 else "auto", k_scale, v_scale)
        if fp8:  # the definition reads back what the cache holds: torch's own cast of x / scale
            k = (k / k_scale).to(FP8_DTYPE).double() * k_scale
            v = (v / v_scale).to(FP8_DTYPE).double() * v_scale
        keys.append(k.double())
        values.append(v.double())
    query = torch.randn(sum(q_lens), heads, dim, generator=g)
    qsl = torch.tensor([0] + q_lens).cumsum(0).int()
    return query, kc, vc, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, keys, values, (k_scale, v_scale)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("fp8", [False, True])
def test_paged_attention_matches_naive(block_size, fp8):
    seq_lens, q_lens = [1, 9, 20, 33, 7], [1, 9, 5, 1, 7]  # 1-token prompt, prefill, chunk over a prefix, decode
    q, kc, vc, bt, sl, qsl, keys, values, (ks, vs) = build(seq_lens, q_lens, block_size, fp8=fp8)
    got = paged_attention(q, kc, vc, bt, sl, qsl, 0.3, ks, vs)
    torch.testing.assert_close(got.double(), naive(q, keys, values, q_lens, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_attention_decode_matches_naive(block_size):
    seq_lens = [1, 17, 40, 5, 3, 9, 28, 2, 33, 12, 7]  # more than DECODE_GROUP: several length groups
    assert len(seq_lens) > DECODE_GROUP
    q, kc, vc, bt, sl, _, keys, values, _ = build(seq_lens, [1] * len(seq_lens), block_size)
    expected = naive(q, keys, values, [1] * len(seq_lens), 0.3)
    for splits in (1, 3):
        got = paged_attention_decode(q, kc, vc, bt, sl, 0.3, num_splits=splits)
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_decode(q, kc, vc, bt, sl, 0.3, num_splits=0)


@pytest.mark.parametrize("window, block_size", [(1, 4), (5, 4), (12, 16), (8, 1), (100, 4)])
def test_paged_attention_sliding_window_matches_dense(window, block_size):
    g = torch.Generator().manual_seed(window * 31 + block_size)
    heads, kv_heads, dim = 4, 2, 8
    seqs = [(37, 1), (20, 7), (9, 9), (50, 3)]  # (seq_len, q_len): decode rows, chunks, a whole prompt
    num_blocks = sum(-(-n // block_size) for n, _ in seqs) + 1
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    width = max(-(-n // block_size) for n, _ in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    ids = iter(torch.randperm(num_blocks - 1, generator=g).tolist())
    queries, expected = [], []
    for i, (n, q_len) in enumerate(seqs):
        blocks = [next(ids) for _ in range(-(-n // block_size))]
        tables[i, :len(blocks)] = torch.tensor(blocks)
        k = key_cache[blocks].reshape(-1, kv_heads, dim)[:n].double().repeat_interleave(heads // kv_heads, 1)
        v = value_cache[blocks].reshape(-1, kv_heads, dim)[:n].double().repeat_interleave(heads // kv_heads, 1)
        q = torch.randn(q_len, heads, dim, generator=g)
        pos_q, pos_k = torch.arange(n - q_len, n)[:, None], torch.arange(n)[None, :]
        mask = (pos_k <= pos_q) & (pos_k > pos_q - window)
        scores = torch.einsum("qhd,khd->hqk", q.double(), k) * dim ** -0.5
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        expected.append(torch.einsum("hqk,khd->qhd", probs, v))
        queries.append(q)
        first_seen = max(0, n - q_len - window + 1) // block_size
        for b in blocks[:first_seen]:  # out of every row's window: may be a freed block, never read
            key_cache[b] = float("nan")
            value_cache[b] = float("nan")
    query = torch.cat(queries)
    qsl = torch.tensor([0, *torch.tensor([q for _, q in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([n for n, _ in seqs], dtype=torch.int32)
    out = paged_attention(query, key_cache, value_cache, tables, seq_lens, qsl, dim ** -0.5,
                          sliding_window=window)
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_sliding_window_must_be_positive():
    q = torch.zeros(1, 1, 2)
    cache = torch.zeros(1, 1, 1, 2)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1]),
                        torch.tensor([0, 1]), 1.0, sliding_window=0)
