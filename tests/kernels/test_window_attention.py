"""paged_attention_window against dense float64 attention with the window mask written out; the table slots before
the window may hold freed blocks, so they are filled with NaN here to show they are never read."""
import pytest
import torch

from kernels.window_attention import paged_attention_window


@pytest.mark.parametrize("window, block_size", [(1, 4), (5, 4), (12, 16), (8, 1), (100, 4)])
def test_matches_dense_windowed_attention(window, block_size):
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
    out = paged_attention_window(query, key_cache, value_cache, tables, seq_lens, qsl, dim ** -0.5, window)
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_window_must_be_positive():
    q = torch.zeros(1, 1, 2)
    cache = torch.zeros(1, 1, 1, 2)
    with pytest.raises(ValueError, match="window"):
        paged_attention_window(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1]),
                               torch.tensor([0, 1]), 1.0, 0)
