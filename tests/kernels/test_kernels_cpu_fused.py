"""kernels.cpu.DecodeAttentionBlock (RoPE, cache write and decode attention in one C call) against the same
three steps run apart: bit for bit against the separate C kernels, and within the kernels' error bound of
the pure-PyTorch chain (the RoPE formula of `models.llama.Rope` in float64, `kernels.reference`'s cache
write and decode attention on float64 copies)."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_attention_close, max_abs_value

from engine_core.models.llama import Rope
from grader.harness import make_paged_kv
from kernels import cpu, reference

CPU = torch.device("cpu")


def _step(seed: int, num_seqs: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    lens = [1 + 17 * (i + 1) % 50 for i in range(num_seqs)]
    kv = make_paged_kv(gen, lens, kv_heads, head_dim, 16, dtype, CPU)
    positions = kv.seq_lens.long() - 1  # each sequence's new token is its last
    slots = torch.stack([kv.block_tables[i, p // 16].long() * 16 + p % 16 for i, p in enumerate(positions.tolist())])
    cos, sin = torch.randn(64, head_dim // 2, generator=gen), torch.randn(64, head_dim // 2, generator=gen)
    qkv = torch.randn(num_seqs, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    return kv, positions, slots, cos.to(dtype), sin.to(dtype), qkv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_seqs, heads, kv_heads, head_dim", [(1, 9, 3, 64), (5, 4, 2, 16), (3, 4, 4, 32)])
def test_block_equals_the_three_kernels_bit_for_bit(dtype: torch.dtype, num_seqs: int, heads: int, kv_heads: int,
                                                    head_dim: int) -> None:
    kv, positions, slots, cos, sin, qkv = _step(num_seqs, num_seqs, heads, kv_heads, head_dim, dtype)
    caches = (kv.key_cache.clone(), kv.value_cache.clone())
    apart = qkv.clone().view(num_seqs, heads + 2 * kv_heads, head_dim)
    cpu.rotary_embedding(apart[:, :heads + kv_heads], positions, cos, sin)
    cpu.reshape_and_cache(apart[:, heads:heads + kv_heads], apart[:, heads + kv_heads:], *caches, slots)
    want = cpu.paged_attention_decode(apart[:, :heads], *caches, kv.block_tables, kv.seq_lens, head_dim ** -0.5)
    block = cpu.DecodeAttentionBlock(positions, cos, sin, slots, kv.block_tables, kv.seq_lens, heads, kv_heads,
                                     head_dim)
    assert block.applies
    got = block(qkv, kv.key_cache, kv.value_cache, head_dim ** -0.5)
    assert got.shape == (num_seqs, heads * head_dim) and got.dtype == dtype
    assert torch.equal(got, want.reshape(num_seqs, -1))
    assert torch.equal(kv.key_cache, caches[0]) and torch.equal(kv.value_cache, caches[1])
    assert torch.equal(qkv, apart.reshape(num_seqs, -1))  # q and k rotated in place, v as it was


@pytest.mark.parametrize("num_seqs", [1, 4])
def test_block_matches_the_pytorch_chain_in_float64(num_seqs: int) -> None:
    heads, kv_heads, d = 6, 2, 32
    kv, positions, slots, cos, sin, qkv = _step(10 + num_seqs, num_seqs, heads, kv_heads, d, torch.float32)
    rows = qkv.double().view(num_seqs, heads + 2 * kv_heads, d)
    qk = Rope(cos.double(), sin.double(), positions, None)(rows[:, :heads + kv_heads])  # the model's formula
    k64, v64 = kv.key_cache.double(), kv.value_cache.double()
    reference.reshape_and_cache(qk[:, heads:], rows[:, heads + kv_heads:], k64, v64, slots)
    want = reference.paged_attention_decode(qk[:, :heads].contiguous(), k64, v64, kv.block_tables, kv.seq_lens,
                                            d ** -0.5)
    block = cpu.DecodeAttentionBlock(positions, cos, sin, slots, kv.block_tables, kv.seq_lens, heads, kv_heads, d)
    got = block(qkv, kv.key_cache, kv.value_cache, d ** -0.5)
    # the cache holds fp32 roundings of the rotated float64 k (RoPE: two products and a sum, ~2 ulps)
    torch.testing.assert_close(kv.key_cache.double(), k64, rtol=4 * 2.0 ** -24, atol=1e-6)
    assert torch.equal(kv.value_cache.double(), v64)
    kv64 = type(kv)(k64, v64, kv.block_tables, kv.seq_lens)
    assert_attention_close(got.view(num_seqs, heads, d), want, torch.float32, num_seqs, "fused decode block",
                           max_abs_value(kv64))


def test_block_raises_on_a_bad_position_before_writing() -> None:
    kv, positions, slots, cos, sin, qkv = _step(3, 2, 4, 2, 16, torch.float32)
    before = kv.key_cache.clone()
    block = cpu.DecodeAttentionBlock(positions + 64, cos, sin, slots, kv.block_tables, kv.seq_lens, 4, 2, 16)
    with pytest.raises(IndexError, match="outside the RoPE tables"):
        block(qkv, kv.key_cache, kv.value_cache, 0.25)
    assert torch.equal(kv.key_cache, before)


def test_block_refuses_a_qkv_of_another_shape() -> None:
    kv, positions, slots, cos, sin, qkv = _step(4, 2, 4, 2, 16, torch.float32)
    block = cpu.DecodeAttentionBlock(positions, cos, sin, slots, kv.block_tables, kv.seq_lens, 4, 2, 16)
    with pytest.raises(ValueError, match="DecodeAttentionBlock"):
        block(qkv[:, :-16], kv.key_cache, kv.value_cache, 0.25)
    with pytest.raises(ValueError, match="DecodeAttentionBlock"):
        block(qkv.bfloat16(), kv.key_cache, kv.value_cache, 0.25)


def test_the_engine_fuses_decode_steps_unless_a_seam_is_replaced(monkeypatch) -> None:
    """Decode steps take the fused block; with `AttentionPlan.write_kv` replaced (lab 14's seam) and the block
    switched off as the grader switches it (`grader.seams.fused_block_switch`), the replacement runs on every
    layer instead, and the greedy tokens are the same either way."""
    from engine_core.engine import LLMEngine
    from engine_core.models.attention import AttentionPlan
    from engine_core.request import SamplingParams
    from grader.seams import LAB14, fused_block_switch, seams_of

    engine = LLMEngine.from_kwargs("tiny-llama", dtype="float32")
    blocks, writes = [], []
    real_call, real_write = cpu.DecodeAttentionBlock.__call__, AttentionPlan.write_kv

    def generate(tag: str) -> list[int]:
        engine.add_request(tag, [5, 6, 7, 8, 9], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        out = []
        while engine.has_unfinished_requests():
            out = next((o.outputs[0].token_ids for o in engine.step() if o.finished), out)
        return list(out)

    monkeypatch.setattr(cpu.DecodeAttentionBlock, "__call__", lambda self, *a: blocks.append(1) or real_call(self, *a))
    fused = generate("fused")
    layers = len(engine.runner.model.layers)
    assert len(blocks) == 5 * layers  # 5 decode steps after the prefill, every layer
    monkeypatch.setattr(AttentionPlan, "write_kv", lambda self, *a: writes.append(1) or real_write(self, *a))
    monkeypatch.setattr(*fused_block_switch(seams_of(LAB14)), False)
    blocks.clear()
    assert generate("seam") == fused
    assert not blocks and len(writes) == 6 * layers
