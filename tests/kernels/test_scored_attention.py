"""paged_attention_scored: its output is the reference paged attention's; its block scores are the float64 softmax
probabilities summed per block (over the block's tokens, the heads and the query rows), worked out densely here."""
import pytest
import torch

from kernels.reference import paged_attention
from kernels.scored_attention import paged_attention_scored


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_output_and_block_scores(block_size):
    g = torch.Generator().manual_seed(block_size)
    heads, kv_heads, dim = 4, 2, 8
    seqs = [(37, 1), (20, 7), (9, 9), (0, 0)]  # decode row, chunk over a prefix, whole prompt, nothing
    num_blocks = sum(-(-n // block_size) for n, _ in seqs) + 1
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g)
    width = max(-(-n // block_size) for n, _ in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    ids = iter(torch.randperm(num_blocks, generator=g).tolist())
    expected = torch.zeros(len(seqs), width, dtype=torch.float64)
    queries = []
    for i, (n, q_len) in enumerate(seqs):
        blocks = [next(ids) for _ in range(-(-n // block_size))]
        tables[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        q = torch.randn(q_len, heads, dim, generator=g)
        queries.append(q)
        if n == 0:
            continue
        k = key_cache[blocks].reshape(-1, kv_heads, dim)[:n].double().repeat_interleave(heads // kv_heads, 1)
        mask = torch.arange(n)[None, :] <= torch.arange(n - q_len, n)[:, None]
        probs = (torch.einsum("qhd,khd->hqk", q.double(), k) * dim ** -0.5).masked_fill(~mask, -torch.inf).softmax(-1)
        per_key = probs.sum((0, 1))
        for b in range(len(blocks)):
            expected[i, b] = per_key[b * block_size:(b + 1) * block_size].sum()
    query = torch.cat(queries)
    qsl = torch.tensor([0, *torch.tensor([q for _, q in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor([n for n, _ in seqs], dtype=torch.int32)
    out, scores = paged_attention_scored(query, key_cache, value_cache, tables, seq_lens, qsl, dim ** -0.5)
    torch.testing.assert_close(out, paged_attention(query, key_cache, value_cache, tables, seq_lens, qsl, dim ** -0.5),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores.sum(1).double(), torch.tensor([q * heads for _, q in seqs], dtype=torch.float64))
