"""Triton `reshape_and_cache`: write this step's K/V rows into the paged cache.

One program per token: it reads the token's slot, and copies all its KV heads
(`[num_kv_heads, head_dim]`, one contiguous row per head) into the cache row for that slot.
Slot -1 (padding, or a token whose KV is already cached) is skipped. The op is pure copy, so
its speed is the memory system's; the only arithmetic is the fp8 write path (`kernels.fp8`):
x / scale in fp32, correctly rounded (`div_rn`: plain `/` is an approximate division on the GPU,
which could move a value across an fp8 rounding boundary), saturated at the format's largest
value (448 for e4m3, 57344 for e5m2), then rounded to nearest even into the format: by the hardware's
conversion (sm_89 on) or with integer operations on the bits (`FP8_BITS`: GPUs without fp8 conversions, and
the interpreter; kernels/triton/_common.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import cache_format, fp8_max
from kernels.triton._common import check_device, f32_to_fp8_bits, fp8_storage, load_scale, scale_arg


@triton.jit
def quantize(x, scale, FP8_MAX: tl.constexpr, FP8_BITS: tl.constexpr, FP8_DTYPE: tl.constexpr):
    """x / scale in fp32 (correctly rounded), saturated at +-FP8_MAX, rounded to nearest even into FP8_DTYPE
    (FP8_BITS: into the codes of e4m3fn (1) or e5m2 (2), with integer operations)."""
    q = tl.math.div_rn(x.to(tl.float32), scale)
    if FP8_BITS:
        return f32_to_fp8_bits(q, FP8_BITS == 2)
    else:
        q = tl.clamp(q, -FP8_MAX, FP8_MAX)
        return q.to(FP8_DTYPE, fp_downcast_rounding="rtne")


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    NUM_KV_HEADS, HEAD_DIM,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANTIZE: tl.constexpr, FP8_MAX: tl.constexpr, FP8_BITS: tl.constexpr,
    K_SCALE_IS_PTR: tl.constexpr, V_SCALE_IS_PTR: tl.constexpr, K_SCALE_STRIDE: tl.constexpr,
    V_SCALE_STRIDE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)

    k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
    if QUANTIZE:
        # h is [BLOCK_H, 1]: each KV head's row divides by its own scale (or all by one); padding
        # rows (h >= NUM_KV_HEADS, never stored) read the last head's scale, not past the tensor.
        sh = tl.minimum(h, NUM_KV_HEADS - 1)
        k = quantize(k, load_scale(k_scale, sh, K_SCALE_IS_PTR, K_SCALE_STRIDE), FP8_MAX, FP8_BITS,
                     key_cache_ptr.dtype.element_ty)
        v = quantize(v, load_scale(v_scale, sh, V_SCALE_IS_PTR, V_SCALE_STRIDE), FP8_MAX, FP8_BITS,
                     value_cache_ptr.dtype.element_ty)
    kc = key_cache_ptr + block * stride_kcb + offset * stride_kct + h * stride_kch + d
    vc = value_cache_ptr + block * stride_vcb + offset * stride_vct + h * stride_vch + d
    tl.store(kc, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, kv_cache_dtype: str = "auto",
                      k_scale: float | torch.Tensor = 1.0, v_scale: float | torch.Tensor = 1.0) -> None:
    """Same contract as `kernels.reference.reshape_and_cache`."""
    check_device(key, value, key_cache, value_cache, slot_mapping)
    fmt = cache_format(kv_cache_dtype, key_cache)  # raises on an unknown kv_cache_dtype or a mismatched cache
    if fmt == torch.int8:
        raise ValueError("the Triton reshape_and_cache has no int8 KV cache: use an fp8 or model-dtype cache, or "
                         "the cpu / torch backend")
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"value_cache {tuple(value_cache.shape)} {value_cache.dtype} != key_cache "
                         f"{tuple(key_cache.shape)} {key_cache.dtype}")
    num_tokens = key.shape[0]
    for name, x in (("key", key), ("value", value)):
        if x.shape != (num_tokens, num_kv_heads, head_dim) or x.stride(-1) != 1:
            raise ValueError(f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] with a contiguous last dim, "
                             f"got shape {tuple(x.shape)} strides {x.stride()}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key_cache and value_cache need a contiguous last (head_dim) dim")
    if num_tokens == 0:
        return
    ks, ks_ptr, ks_stride = scale_arg(k_scale, num_kv_heads)
    vs, vs_ptr, vs_stride = scale_arg(v_scale, num_kv_heads)
    kc, bits = fp8_storage(key_cache)
    vc, _ = fp8_storage(value_cache)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, kc, vc, slot_mapping, ks, vs,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), QUANTIZE=fmt is not None,
        FP8_MAX=fp8_max(fmt) if fmt is not None else 0.0, FP8_BITS=bits,
        K_SCALE_IS_PTR=ks_ptr, V_SCALE_IS_PTR=vs_ptr, K_SCALE_STRIDE=ks_stride, V_SCALE_STRIDE=vs_stride,
        num_warps=1 if num_kv_heads * head_dim <= 256 else 4,
    )
