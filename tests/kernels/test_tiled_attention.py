"""kernels.tiled_attention (FlashAttention's loop nest in PyTorch) against kernels.reference.paged_attention and
float64 SDPA; causal_kv_tiles against a brute-force count of the tiles holding an attended key."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from kernels.tiled_attention import causal_kv_tiles, tiled_attention


@pytest.mark.parametrize("q_len,seq_len,heads,kv_heads,block_m,block_n",
                         [(37, 37, 2, 2, 16, 8), (20, 53, 6, 2, 8, 16), (1, 29, 4, 1, 4, 8), (64, 64, 2, 1, 64, 64)])
def test_tiled_attention_matches_sdpa(q_len, seq_len, heads, kv_heads, block_m, block_n) -> None:
    gen = torch.Generator().manual_seed(q_len)
    q = torch.randn(q_len, heads, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(seq_len, kv_heads, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                          scale=0.3, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(tiled_attention(q, k, v, 0.3, block_m, block_n), want, rtol=1e-10, atol=1e-10)


def test_tiled_attention_equals_the_paged_reference() -> None:
    """The same sequence through kernels.reference.paged_attention (one block table in order), fp32."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(11, 4, 16, generator=gen)
    k, v = (torch.randn(32, 2, 16, generator=gen) for _ in range(2))
    out = reference.paged_attention(q, k.view(4, 8, 2, 16), v.view(4, 8, 2, 16), torch.arange(4, dtype=torch.int32)[None],
                                    torch.tensor([32], dtype=torch.int32), torch.tensor([0, 11], dtype=torch.int32), 0.25)
    torch.testing.assert_close(tiled_attention(q, k, v, 0.25, 4, 8), out, rtol=1e-5, atol=1e-5)


def test_causal_kv_tiles_is_the_tiles_holding_an_attended_key() -> None:
    for q_len in (0, 1, 7, 16, 33):
        for context in (0, 5, 16):
            for block_m, block_n in ((1, 1), (4, 8), (16, 16), (8, 3)):
                for first in range(0, 40, block_m):
                    positions = [context + r for r in range(first, min(first + block_m, q_len))]
                    want = max((p // block_n + 1 for p in positions), default=0)
                    assert causal_kv_tiles(first, q_len, context, block_m, block_n) == want


def test_tiled_attention_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="q_len <= seq_len"):
        tiled_attention(torch.zeros(5, 2, 4), torch.zeros(3, 2, 4), torch.zeros(3, 2, 4), 1.0)
