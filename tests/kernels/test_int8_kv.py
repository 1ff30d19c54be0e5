"""The int8 KV format (kernels.int8_kv): symmetric per-tensor / per-head quantization and vLLM's
int8_per_token_head layout against float64, the paged cache write and the attention read on an int8 cache."""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.fp8 import cache_format, dequantize_fp8, quantize_fp8, scale_from_amax
from kernels.int8_kv import (INT8_MAX, dequantize_int8, dequantize_int8_per_token_head, int8_scale_from_amax,
                             quantize_int8, quantize_int8_per_token_head)


def _round_trip64(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """clamp(round(x / s), -127, 127) * s in float64, s per KV head broadcast over `[..., H, D]`."""
    s = scale.double()[:, None]
    return torch.round(x.double() / s).clamp(-INT8_MAX, INT8_MAX) * s


def test_int8_per_head_round_trip_equals_float64():
    """Scales of powers of two divide exactly in fp32, so the fp32 codes equal float64's; in-range values
    come back within scale / 2, out-of-range ones saturate at +-127 * scale."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, 16, generator=gen) * torch.tensor([0.5, 4.0, 30.0])[:, None]
    scale = torch.tensor([2.0**-7, 2.0**-4, 2.0**-2])  # head 2 saturates (|x| up to ~100 > 127 / 4)
    codes = quantize_int8(x, scale)
    assert codes.dtype == torch.int8 and codes.shape == x.shape
    assert torch.equal(codes.double(), torch.round(x.double() / scale.double()[:, None]).clamp(-127, 127))
    back = dequantize_int8(codes, scale, torch.float32)
    assert torch.equal(back.double(), _round_trip64(x, scale))
    inside = (x.abs() <= INT8_MAX * scale[:, None]).expand_as(x)
    assert (back - x).abs()[inside].max() <= scale.max() / 2
    assert inside.logical_not().any()


def test_int8_scales_zero_inf_and_nan():
    """amax 0 gives scale 1 (zeros stay exact); +-inf saturates at +-127; NaN stores 0, never garbage."""
    assert int8_scale_from_amax(torch.tensor([0.0, 254.0])).tolist() == [1.0, 2.0]
    x = torch.tensor([[[float("inf"), float("-inf"), float("nan"), 0.0, 1.5, 2.5, -0.5]]])
    assert quantize_int8(x, 1.0).tolist() == [[[127, -127, 0, 0, 2, 2, 0]]]  # round half to even


def test_int8_per_token_head_is_exact_per_vector_and_costs_4_bytes():
    """Each head vector's own scale amax / 127: its largest value is exact, every value within scale / 2 in
    float64, and an outlier token leaves the others' precision alone. 4 extra bytes per head vector:
    132 bytes instead of 128 at head_dim 128."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 2, 128, generator=gen)
    x[4] *= 1000.0  # an outlier token
    x[7, 1] = 0.0  # an all-zero head vector
    codes, scales = quantize_int8_per_token_head(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (9, 2)
    amax = x.double().abs().amax(dim=-1)
    assert torch.allclose(scales.double(), torch.where(amax > 0, amax / 127, torch.ones_like(amax)), rtol=1e-7)
    back = dequantize_int8_per_token_head(codes, scales, torch.float64)
    err = (back - x.double()).abs()
    assert (err <= scales.double()[..., None] / 2 * (1 + 1e-6)).all()
    assert back[7, 1].abs().max() == 0
    assert err[:4].max() < 0.02  # the ordinary tokens keep their own fine scale
    per_vector = codes[0, 0].nbytes + scales[0, 0].nbytes
    assert (per_vector, x[0, 0].to(torch.float8_e4m3fn).nbytes) == (132, 128)


def test_int8_beats_fp8_e4m3_near_the_top_of_the_range_and_loses_on_small_values():
    """Same byte, same per-head scale range: int8's uniform steps are finer for values near amax, e4m3's
    logarithmic ones for values far below it (the trade-off docs/fp8_kv_cache.md describes)."""
    gen = torch.Generator().manual_seed(2)
    big = torch.rand(1000, 1, 8, generator=gen) * 0.5 + 0.5  # in [0.5, 1]: amax ~1
    small = torch.cat([torch.tensor([[[1.0] * 8]]), torch.rand(999, 1, 8, generator=gen) * 1e-2])  # amax 1, the rest tiny

    def errors(x):
        amax = x.abs().amax()
        i8 = dequantize_int8(quantize_int8(x, int8_scale_from_amax(amax)), int8_scale_from_amax(amax), torch.float64)
        s8 = scale_from_amax(amax, torch.float8_e4m3fn)
        f8 = dequantize_fp8(quantize_fp8(x, s8, torch.float8_e4m3fn), s8, torch.float64)
        return (i8 - x.double()).abs().mean().item(), (f8 - x.double()).abs().mean().item()

    i8, f8 = errors(big)
    assert i8 < f8 / 4, (i8, f8)
    i8, f8 = errors(small)
    assert f8 < i8 / 4, (i8, f8)


def test_int8_cache_write_and_attention_read():
    """reshape_and_cache stores quantize_int8's codes at the slots (slot -1 skipped), and both attention paths
    read an int8 cache as codes * scale: equal to attention over the dequantized cache in fp32."""
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, heads, kv_heads, dim = 6, 4, 4, 2, 8
    kc = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=torch.int8)
    vc = torch.zeros_like(kc)
    key, value = torch.randn(11, kv_heads, dim, generator=gen), torch.randn(11, kv_heads, dim, generator=gen)
    slots = torch.tensor([0, 1, 2, 3, 8, 9, 10, -1, 12, 13, 14])
    k_scale, v_scale = torch.tensor([0.03, 0.02]), torch.tensor(0.025)
    assert cache_format("int8", kc) == torch.int8
    with pytest.raises(ValueError, match="needs a torch.float8_e4m3fn cache"):
        reference.reshape_and_cache(key, value, kc, vc, slots, "fp8", k_scale, v_scale)
    reference.reshape_and_cache(key, value, kc, vc, slots, "int8", k_scale, v_scale)
    keep = slots >= 0
    assert torch.equal(kc.view(-1, kv_heads, dim)[slots[keep]], quantize_int8(key[keep], k_scale))
    assert torch.equal(vc.view(-1, kv_heads, dim)[slots[keep]], quantize_int8(value[keep], v_scale))
    tables = torch.tensor([[0, 2, 3, -1], [3, 0, -1, -1]])
    seq_lens = torch.tensor([10, 5])
    query = torch.randn(2, heads, dim, generator=gen)
    got = reference.paged_attention_decode(query, kc, vc, tables, seq_lens, 0.3, k_scale, v_scale)
    kf, vf = dequantize_int8(kc, k_scale, torch.float32), dequantize_int8(vc, v_scale, torch.float32)
    want = reference.paged_attention_decode(query, kf, vf, tables, seq_lens, 0.3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    starts = torch.tensor([0, 1, 2])
    prefill = reference.paged_attention(query, kc, vc, tables, seq_lens, starts, 0.3, k_scale, v_scale)
    torch.testing.assert_close(prefill, want, rtol=0, atol=1e-6)
