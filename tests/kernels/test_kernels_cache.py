"""Triton reshape_and_cache: every row lands in its slot, slot -1 rows nowhere, nothing else moves."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def _case(seed: int, device: torch.device, dtype: torch.dtype, block_size: int, num_kv_heads: int = 2,
          head_dim: int = 24, num_tokens: int = 13) -> tuple[torch.Tensor, ...]:
    """Random K/V rows, distinct random slots (a quarter of them -1), caches poisoned with NaN."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 5
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(device, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[: num_tokens // 4]] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    value_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    return key, value, key_cache, value_cache, slots.to(device)


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_land_in_their_slots(seed: int, device: torch.device, dtype: torch.dtype, block_size: int,
                                  slot_dtype: torch.dtype) -> None:
    key, value, key_cache, value_cache, slots = _case(seed, device, dtype, block_size)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots.to(slot_dtype), backend="triton")
    flat_k, flat_v = key_cache.view(-1, *key.shape[1:]), value_cache.view(-1, *key.shape[1:])
    keep = slots >= 0
    # A copy is exact: compare bitwise, not within a tolerance.
    assert torch.equal(flat_k[slots[keep]], key[keep]), f"K rows differ; slots {slots.tolist()}, seed {seed}"
    assert torch.equal(flat_v[slots[keep]], value[keep]), f"V rows differ; slots {slots.tolist()}, seed {seed}"
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=device)
    untouched[slots[keep]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all(), (
        f"a slot outside slot_mapping (or a slot -1 row) was written; slots {slots.tolist()}, seed {seed}")


def test_strided_key_and_value_views(seed: int, device: torch.device) -> None:
    """K and V as column slices of one fused qkv output, the way a model produces them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(6, 8, 16, generator=gen).to(device)  # 4 q heads, 2 k heads, 2 v heads
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    key_cache = torch.full((2, 8, 2, 16), float("nan"), device=device)
    value_cache = torch.full((2, 8, 2, 16), float("nan"), device=device)
    slots = torch.tensor([3, 9, -1, 0, 15, 8], device=device)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots, backend="triton")
    expected_k = torch.full_like(key_cache, float("nan"))
    expected_v = torch.full_like(value_cache, float("nan"))
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    assert torch.equal(key_cache.nan_to_num(123.0), expected_k.nan_to_num(123.0)), f"seed {seed}"
    assert torch.equal(value_cache.nan_to_num(123.0), expected_v.nan_to_num(123.0)), f"seed {seed}"


@pytest.mark.parametrize("scales", ["float", "tensor", "per_head"])
@pytest.mark.parametrize("kv_cache_dtype, fmt", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_quantizes_like_the_reference(seed: int, device: torch.device, scales: str, kv_cache_dtype: str,
                                          fmt: torch.dtype) -> None:
    """Bit for bit torch's cast of x / scale (kernels.reference): saturated, rounded to nearest even. On CPU (and
    GPUs before sm_89) the integer conversion runs (the interpreter's own fp32 -> e4m3 rounding is wrong: 31.7
    became 16); on an sm_89+ GPU the hardware's."""
    key, value, _, _, slots = _case(seed, device, torch.bfloat16, 16)
    key, value = key * 40, value * 40  # some values past 448 * scale: saturation must clamp, not overflow
    key[0, 0, :4] = torch.tensor([float("inf"), -float("inf"), 1e30, -1e30])  # past e5m2's 57344 too
    key_cache = torch.zeros(5, 16, 2, 24, dtype=fmt, device=device)
    value_cache = torch.zeros_like(key_cache)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    k_scale, v_scale = {"float": (0.3, 0.2),
                        "tensor": (torch.tensor(0.3, device=device), torch.tensor(0.2, device=device)),
                        "per_head": (torch.tensor([0.3, 0.007], device=device),
                                     torch.tensor([2.0, 0.2], device=device))}[scales]
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots, kv_cache_dtype, k_scale, v_scale,
                              backend="triton")
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots, kv_cache_dtype, k_scale, v_scale)
    assert torch.equal(key_cache.view(torch.uint8), expected_k.view(torch.uint8)), f"seed {seed}"
    assert torch.equal(value_cache.view(torch.uint8), expected_v.view(torch.uint8)), f"seed {seed}"
    assert not key_cache.float().isnan().any() and not key_cache.float().isinf().any()


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_write_uses_each_heads_scale(seed: int, device: torch.device, fmt: torch.dtype) -> None:
    """Per-KV-head scales 100x apart: each head's rows come back within 2x of what was written (the exact
    rounding is the test above; this one is about which scale a head reads). A kernel reading the wrong
    head's scale is off by 100x."""
    key, value, key_cache, value_cache, slots = _case(seed, device, torch.float32, 8, num_kv_heads=3)
    gain = torch.tensor([1.0, 100.0, 0.01], device=device)[:, None]
    key, value = key * gain, value * gain
    k_scale, v_scale = gain[:, 0] / 50, gain[:, 0] / 100
    key_cache, value_cache = key_cache.to(fmt), value_cache.to(fmt)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots, "auto", k_scale, v_scale, backend="triton")
    keep = slots >= 0
    for cache, x, scale in ((key_cache, key, k_scale), (value_cache, value, v_scale)):
        back = cache.view(-1, 3, 24)[slots[keep]].float() * scale[:, None]
        x = x[keep]
        big = x.abs() > 0.1 * gain  # away from the subnormal range, where relative error means nothing
        ratio = (back[big] / x[big]).cpu()
        assert ((ratio > 0.5) & (ratio < 2.0)).all(), f"{fmt}: ratios {ratio.min():.3g}..{ratio.max():.3g}; seed {seed}"


def test_shape_mismatch_is_a_value_error(device: torch.device) -> None:
    cache = torch.zeros(2, 8, 2, 16, device=device)
    with pytest.raises(ValueError, match="key must be"):
        kernels.reshape_and_cache(torch.zeros(3, 2, 8, device=device), torch.zeros(3, 2, 16, device=device),
                                  cache, cache.clone(), torch.zeros(3, dtype=torch.long, device=device),
                                  backend="triton")
